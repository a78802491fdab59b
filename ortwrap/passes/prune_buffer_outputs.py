"""Drop buffer outputs that return their graph input unchanged.

The exporter returns every buffer; a buffer the forward does not update comes back as
``out = Identity(buffer_input)``, a Cast to its own type, or the input itself. Such outputs cost a copy each step and
mean nothing, so they are removed. Outputs are recognised by the ``buffer:`` prefix of their name.
"""

from __future__ import annotations

import onnx_ir as ir

from ..graph.names import BUFFER_OUTPUT_PREFIX


def _is_identity(node: ir.Node) -> bool:
    """Identity, or a Cast to the type its input already has (transformers' ``inv_freq.float()``)."""
    if node.op_type == "Identity" and node.domain == "":
        return True
    if node.op_type == "Cast" and node.domain == "" and "to" in node.attributes:
        source = node.inputs[0]
        return source is not None and source.dtype is not None and int(source.dtype) == node.attributes["to"].as_int()
    return False


class PruneUnchangedBufferOutputsPass(ir.passes.InPlacePass):
    """Remove ``buffer:*`` graph outputs that equal a graph input."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        inputs = {id(v) for v in graph.inputs}
        keep = []
        modified = False
        for out in graph.outputs:
            if out.name and out.name.startswith(BUFFER_OUTPUT_PREFIX):
                src = out
                producer = out.producer()
                if producer is not None and _is_identity(producer):
                    src = producer.inputs[0]
                if id(src) in inputs:
                    modified = True
                    if producer is not None and _is_identity(producer) and len(out.uses()) == 0:
                        graph.remove(producer, safe=False)
                    continue
            keep.append(out)
        if modified:
            graph.outputs.clear()
            graph.outputs.extend(keep)
        return ir.passes.PassResult(model, modified=modified)
