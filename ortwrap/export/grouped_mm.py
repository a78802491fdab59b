"""Grouped matrix multiplication (mixture-of-experts layers) as plain ONNX, for both exporters.

``grouped_mm(a: (M, K), b: (G, K, N), offs: (G,))`` multiplies the rows of ``a`` that belong to
group ``g`` (rows sorted by group, ``offs`` the cumulative end of each group) by ``b[g]``. Current
transformers route Mixtral's and Qwen2-MoE's experts through it: ``torch._grouped_mm`` in eager
(the TorchScript path sees ``aten::_grouped_mm``) and the custom op
``transformers::grouped_mm_fallback`` under ``torch.export``. PyTorch's meta kernel of
``_grouped_mm`` accepts bf16 only, so as an ATen node its type inference failed on fp32 models.

Written here as one ``Slice`` of ``a``'s rows, one ``Gather`` of ``b[g]`` and one ``MatMul`` per
group, then a ``Concat``: every op has an ORT gradient (``SliceGrad`` and ``GatherGrad`` scatter
the gradients back), and the arithmetic is eager's. ``G`` (the number of experts) must be static.
"""

from __future__ import annotations

import torch

from .._compat import torch as compat


def _static_groups(n: int | None, what: str) -> int:
    if not isinstance(n, int):
        raise RuntimeError(f"ortwrap: {what}: the number of groups (experts), mat_b.shape[0], must be static")
    return n


def grouped_mm_symbolic(g, mat_a, mat_b, offs, bias=None, out_dtype=None):
    """TorchScript symbolic of ``aten::_grouped_mm``."""
    sizes = compat.ts_sizes(mat_b)
    groups = _static_groups(sizes[0] if sizes else None, "aten::_grouped_mm")
    if compat.ts_is_none(offs):
        raise RuntimeError("ortwrap: aten::_grouped_mm without offs (a 3-D mat_a) is not supported")
    if out_dtype is not None and not compat.ts_is_none(out_dtype):
        raise RuntimeError("ortwrap: aten::_grouped_mm(out_dtype=...) is not supported")
    has_bias = bias is not None and not compat.ts_is_none(bias)

    def const(values):
        return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))

    ends = g.op("Cast", offs, to_i=7)
    start = const([0])
    outputs = []
    for i in range(groups):
        end = g.op("Slice", ends, const([i]), const([i + 1]), const([0]))
        rows = g.op("Slice", mat_a, start, end, const([0]))
        out = g.op("MatMul", rows, g.op("Gather", mat_b, const(i), axis_i=0))
        if has_bias:
            out = g.op("Add", out, g.op("Gather", bias, const(i), axis_i=0))
        outputs.append(out)
        start = end
    return g.op("Concat", *outputs, axis_i=0)


def grouped_mm_translation(mat_a, mat_b, offs, bias=None, out_dtype=None):
    """onnxscript translation of ``aten._grouped_mm`` and ``transformers.grouped_mm_fallback``."""
    from onnxscript import opset18 as op

    if out_dtype is not None:
        raise RuntimeError("ortwrap: grouped_mm(out_dtype=...) is not supported")
    groups = _static_groups(mat_b.shape[0] if mat_b.shape is not None else None, "grouped_mm")
    ends = op.Cast(offs, to=7)
    axes = op.Constant(value_ints=[0])
    start = op.Constant(value_ints=[0])
    outputs = []
    for i in range(groups):
        end = op.Slice(ends, op.Constant(value_ints=[i]), op.Constant(value_ints=[i + 1]), axes)
        rows = op.Slice(mat_a, start, end, axes)
        out = op.MatMul(rows, op.Gather(mat_b, op.Constant(value_int=i), axis=0))
        if bias is not None:
            out = op.Add(out, op.Gather(bias, op.Constant(value_int=i), axis=0))
        outputs.append(out)
        start = end
    return op.Concat(*outputs, axis=0)


def grouped_mm_ops() -> list:
    """The grouped-mm overloads registered in this process (the transformers op once imported)."""
    ops = [op for op in (compat.grouped_mm_op(),) if op is not None]
    try:
        ops.append(torch.ops.transformers.grouped_mm_fallback.default)
    except (AttributeError, RuntimeError):
        pass
    return ops
