"""Give each graph input a node reads twice its own copy for the second read.

ORT 1.19.2's gradient builder names the gradient of a graph input ``<input>_grad`` for each use in
one node: ``Mul(x, x)`` of an input ``x`` (``x * x``, ``linalg.matrix_norm``'s Frobenius norm of an
input) fails to build ("Duplicate definition of name (input:x_grad)"). The later reads go through an
``Identity``, whose gradient ORT sums with the first's. Training graphs only.
"""

from __future__ import annotations

import onnx_ir as ir


class RepeatedGraphInputsPass(ir.passes.InPlacePass):
    """``Op(x, x)`` of a graph input ``x`` -> ``Op(x, Identity(x))``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        inputs = {id(v) for v in graph.inputs}
        modified = False
        for node in list(graph):
            seen: set[int] = set()
            for i, value in enumerate(node.inputs):
                if value is None or id(value) not in inputs:
                    continue
                if id(value) in seen:
                    copy = ir.node("Identity", [value], name=f"{node.name or node.op_type}/ortwrap/input{i}_copy")
                    copy.outputs[0].dtype, copy.outputs[0].shape = value.dtype, value.shape
                    graph.insert_before(node, copy)
                    node.replace_input_with(i, copy.outputs[0])
                    modified = True
                seen.add(id(value))
        return ir.passes.PassResult(model, modified=modified)
