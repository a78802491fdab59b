"""Drop buffer outputs that return their graph input unchanged.

The exporter returns every buffer; a buffer the forward does not update comes back as
``out = Identity(buffer_input)`` (or as the input itself). Such outputs cost a copy each step and
mean nothing, so they are removed. Outputs are recognised by the ``buffer:`` prefix of their name.
"""

from __future__ import annotations

import onnx_ir as ir

BUFFER_OUTPUT_PREFIX = "buffer:"


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
                if producer is not None and producer.op_type == "Identity":
                    src = producer.inputs[0]
                if id(src) in inputs:
                    modified = True
                    if producer is not None and producer.op_type == "Identity" and len(out.uses()) == 0:
                        graph.remove(producer, safe=False)
                    continue
            keep.append(out)
        if modified:
            graph.outputs.clear()
            graph.outputs.extend(keep)
        return ir.passes.PassResult(model, modified=modified)
