"""Resolve ``ortwrap::StopGradient(x)`` markers into non-trainable copies of graph inputs.

ONNX has no stop-gradient op. ortwrap's symbolics mark values whose gradient must not flow (the
padding row of an embedding) with ``ortwrap::StopGradient``. When ``x`` is a graph input (a
parameter), the marker is replaced by a second graph input, ``x`` + :data:`STOP_GRADIENT_SUFFIX`,
that the runtime feeds with the *same* tensor but that is not among the inputs ORT differentiates:
forward values are bit-identical and no gradient reaches ``x`` through it.
"""

from __future__ import annotations

import onnx_ir as ir

from ..errors import PassError
from ..export.symbolics import ORTWRAP_DOMAIN

STOP_GRADIENT_SUFFIX = "::stop_gradient"


class ResolveStopGradientPass(ir.passes.InPlacePass):
    """Replace every ``ortwrap::StopGradient`` of a graph input by a frozen duplicate input."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        frozen: dict[str, ir.Value] = {}
        modified = False
        for node in list(graph):
            if node.domain != ORTWRAP_DOMAIN or node.op_type != "StopGradient":
                continue
            src = node.inputs[0]
            if src is None or not src.is_graph_input():
                raise PassError(
                    f"node {node.name!r}: a stop-gradient (embedding padding_idx) is only supported on a "
                    "parameter used directly, not on a computed tensor"
                )
            dup = frozen.get(src.name)
            if dup is None:
                dup = ir.Value(name=f"{src.name}{STOP_GRADIENT_SUFFIX}", type=src.type, shape=src.shape)
                graph.inputs.append(dup)
                frozen[src.name] = dup
            node.outputs[0].replace_all_uses_with(dup)
            graph.remove(node, safe=True)
            modified = True
        if modified and not any(n.domain == ORTWRAP_DOMAIN for n in graph.all_nodes()):
            model.opset_imports.pop(ORTWRAP_DOMAIN, None)
            graph.opset_imports.pop(ORTWRAP_DOMAIN, None)
        return ir.passes.PassResult(model, modified=modified)
