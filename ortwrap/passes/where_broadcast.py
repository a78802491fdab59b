"""Expand a value that ``Where`` broadcasts to the output's shape before the ``Where``.

ORT 1.19.2's ``Where`` gradient gives each of X and Y a gradient of the *output's* shape and never
reduces it over the dims the forward broadcast: a value smaller than the output gets a gradient
of the wrong shape (T5: the relative position bias, (1, heads, q, k), masked against a
(batch, 1, 1, k) attention mask; the backward failed in the Unsqueeze below it). ``Expand``'s
gradient does reduce (``ReduceSum`` over the broadcast dims), so this pass feeds ``Where`` an
``Expand`` of such an input to the shape of all three operands: ``Expand`` broadcasts both ways,
so ``Expand(Expand(x, Shape(cond)), Shape(other))`` has exactly the output's shape. Same values.

Skipped: constants (no gradient), non-floating inputs, and inputs whose inferred shape already
equals the output's.
"""

from __future__ import annotations

import onnx_ir as ir

from ._build import NodeBuilder, constant_value


def _same_shape(a: ir.Shape | None, b: ir.Shape | None) -> bool:
    if a is None or b is None or len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif isinstance(x, ir.SymbolicDim) and isinstance(y, ir.SymbolicDim) and x.value is not None:
            if x.value != y.value:
                return False
        else:
            return False
    return True


class WhereBroadcastPass(ir.passes.InPlacePass):
    """Give each broadcast floating input of ``Where`` the output's shape with an ``Expand``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 3:
                continue
            out = node.outputs[0]
            for i in (1, 2):
                x = node.inputs[i]
                if x is None or x.dtype is None or not x.dtype.is_floating_point():
                    continue
                if constant_value(x) is not None or _same_shape(x.shape, out.shape):
                    continue
                b = NodeBuilder(f"{node.name or f'where_{id(node):x}'}/input{i}")
                other = node.inputs[3 - i]
                expanded = b.op("Expand", x, b.op("Shape", node.inputs[0]))
                expanded = b.op("Expand", expanded, b.op("Shape", other))
                expanded.dtype, expanded.shape = x.dtype, out.shape
                graph.insert_before(node, b.nodes)
                node.replace_input_with(i, expanded)
                modified = True
        return ir.passes.PassResult(model, modified=modified)
