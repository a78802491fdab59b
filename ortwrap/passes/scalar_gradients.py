"""Keep ORT's gradients of 0-d values from growing a dimension.

ORT 1.19.2's gradient builders broadcast some gradients against constants of shape ``[1]``
(``Sqrt``'s ``HalfConstant``, ``Pow``, ``Erf``, ``Where``, ...): the gradient of a 0-d value arrives
as ``[1]``. Where that value is a reduction with ``keepdims=0`` over axes (``x.mean(0)`` of a
vector), the reduction's gradient unsqueezes the ``[1]`` to ``[1, 1]`` and expands it against the
input: the gradient of a ``[5]`` input comes out ``[1, 5]``, and ORT, reusing a buffer of the
declared shape, computed ``std(x, 0)``'s gradient as zeros (``masked.std``'s slightly wrong).
So each reduction to 0-d keeps its dims and is reshaped to 0-d (``Reshape``'s gradient reads the
input's shape, whatever the gradient's), a 0-d ``Squeeze`` is a ``Reshape``, and ``Sqrt``/``Pow``/``Erf``
of a 0-d input run on ``[1]``. Training graphs only.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._build import NodeBuilder

#: ops whose ORT 1.19.2 gradient broadcasts a 0-d gradient to [1]
SCALAR_GRADIENT_OPS = frozenset({"Sqrt", "Pow", "Erf"})
_REDUCTIONS = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                         "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"})  # fmt: skip


def _zero_d_float(value: ir.Value | None) -> bool:
    return (
        value is not None
        and value.shape is not None
        and len(value.shape) == 0
        and value.dtype is not None
        and value.dtype.is_floating_point()
    )


def _to_scalar(b: NodeBuilder, value: ir.Value) -> ir.Value:
    return b.op("Reshape", value, b.const(np.zeros((0,), dtype=np.int64)))


class ScalarGradientShapesPass(ir.passes.InPlacePass):
    """Reductions to 0-d keep their dims, then reshape; ``Sqrt``/``Pow``/``Erf`` of 0-d run on ``[1]``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(model.graph):
            if node.domain not in ("", "ai.onnx") or not node.outputs or not _zero_d_float(node.outputs[0]):
                continue
            x = node.inputs[0] if node.inputs else None
            b = NodeBuilder(node.name or f"{node.op_type}_{id(node):x}")
            if node.op_type in _REDUCTIONS and len(node.outputs) == 1:
                keep = node.attributes.get("keepdims")
                if keep is None or keep.as_int() != 0 or x is None or x.shape is None:
                    continue
                attrs = {k: a.value for k, a in node.attributes.items() if k != "keepdims"}
                kept = b.node(node.op_type, list(node.inputs), keepdims=1, **attrs)
                kept.outputs[0].dtype = node.outputs[0].dtype
                kept.outputs[0].shape = ir.Shape([1] * len(x.shape))
                out = _to_scalar(b, kept.outputs[0])
            elif node.op_type == "Squeeze" and x is not None:
                out = _to_scalar(b, x)
            elif node.op_type in SCALAR_GRADIENT_OPS and _zero_d_float(x):
                one = b.op("Reshape", x, b.const(np.array([1], dtype=np.int64)))
                inner = b.node(node.op_type, [one, *node.inputs[1:]])
                inner.outputs[0].dtype = node.outputs[0].dtype
                inner.outputs[0].shape = ir.Shape([1])
                out = _to_scalar(b, inner.outputs[0])
            else:
                continue
            b.replace(model.graph, node, [out])
            modified = True
        return ir.passes.PassResult(model, modified=modified)
