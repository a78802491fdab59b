"""Give ops the optional outputs that ONNX Runtime's gradient builders read.

ORT 1.19.2 differentiates some ops from their saved optional outputs and fails with
``i < node_->OutputDefs().size() was false`` when the exporter left them out:

=========================  ===============================  ======================
op                         outputs the gradient needs       exported by torch
=========================  ===============================  ======================
LayerNormalization         Y, Mean, InvStdDev               Y only
SoftmaxCrossEntropyLoss    output, log_prob                 output only
Dropout (training)         output, mask                     usually both
=========================  ===============================  ======================

The pass adds the missing outputs with fresh names; nothing else in the graph changes.
"""

from __future__ import annotations

import onnx_ir as ir

#: (domain, op_type) -> number of outputs the gradient builder needs.
REQUIRED_OUTPUTS: dict[tuple[str, str], int] = {
    ("", "LayerNormalization"): 3,
    ("", "SoftmaxCrossEntropyLoss"): 2,
    ("", "Dropout"): 2,
}


class RestoreOptionalOutputsPass(ir.passes.InPlacePass):
    """Resize the outputs of the ops in :data:`REQUIRED_OUTPUTS`."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            wanted = REQUIRED_OUTPUTS.get((node.domain, node.op_type))
            if wanted is None or len(node.outputs) >= wanted:
                continue
            base = node.outputs[0].name or node.name or node.op_type
            node.resize_outputs(wanted)
            for i, value in enumerate(node.outputs):
                if not value.name:
                    value.name = f"{base}/ortwrap_optional_{i}"
            modified = True
        return ir.passes.PassResult(model, modified=modified)
