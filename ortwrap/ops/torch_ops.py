"""ortwrap's own PyTorch ops (``torch.ops.ortwrap_ops.<name>``): each one's implementation, then
its declaration in :data:`OPS` (``ops/declare.py``'s :class:`~ortwrap.ops.declare.Op`: schema,
implementation, backward op, dtype argument, optional gradients, float32 form, weight copy,
recompute cost). ``ops/tables.py`` derives every table the stages read from :data:`OPS`;
:func:`define_ops` defines them in a process.

Three kinds: composites with ONNX semantics where no PyTorch op has them (``prelu``, ``shrink``,
``hard_sigmoid``, ``reduce``, ``pad``, ...: what ``ops/mappers.py``'s ``GRADIENTS`` run ONNX ops
ORT cannot differentiate as; their autograd is that of their decomposition), the GEMMs and
attention of the native bf16 and torch-GEMM routes (``passes/half_matmul.py``,
``passes/half_values.py``) with their explicit backward ops, and helpers other passes write
(``cat2``, ``squeeze_ones``, ``gelu``). And the backward ops of some of PyTorch's own ops
(:data:`ATEN_GRADIENTS`: ``elu``, ``softplus``, ``mish``, ...), which run as ATen nodes of their own name.

Each op costs a Python call per node per step (forward, and one for its gradient), and runs where
ORT's ATen kernel runs; the CPU ones are tested, CUDA is not.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

from .declare import OPS_NAMESPACE, Gradient, Op, gradient

__all__ = ["ATEN_GRADIENTS", "NO_WEIGHT_COPY", "OPS", "define_ops", "op"]


def _prelu(x, slope):
    import torch

    return torch.where(x > 0, x, x * slope)


def _is_torch_hardsigmoid(alpha: float, beta: float) -> bool:
    return abs(alpha - 1 / 6) < 1e-7 and beta == 0.5


def _hard_sigmoid_impl(x, alpha: float, beta: float):
    import torch.nn.functional as F

    if _is_torch_hardsigmoid(alpha, beta):
        return F.hardsigmoid(x)
    return (x * alpha + beta).clamp(0.0, 1.0)


def _hard_sigmoid_backward(grad, x, alpha: float, beta: float, output_mask: list[bool]):
    """dx of :func:`_hard_sigmoid_impl`, as eager's autograd computes it (``hardsigmoid_backward``, or
    ``clamp``'s then ``mul``'s backward), without recomputing the forward under autograd."""
    import torch

    grad = grad.to(x.dtype)
    if _is_torch_hardsigmoid(alpha, beta):
        return [torch.ops.aten.hardsigmoid_backward(grad, x)]
    v = x * alpha + beta
    inside = (v >= 0.0) & (v <= 1.0) if clamp_passes_gradient_at_bounds() else (v > 0.0) & (v < 1.0)
    return [torch.where(inside, grad, torch.zeros((), dtype=grad.dtype)) * alpha]


@functools.cache
def clamp_passes_gradient_at_bounds() -> bool:
    """Whether autograd's ``clamp`` passes the gradient at a value equal to a bound: torch 2.13 does,
    2.14 does not (checked on 2.13.0 and 2.14.1). Read once from the installed torch, which is eager's
    contract: a HardSigmoid of other alpha/beta comes from a user's ``clamp(alpha * x + beta, 0, 1)``,
    and ``ops.ATEN_OPS`` sends the clamps whose ONNX form's ORT gradient has the other convention to
    PyTorch (2.14 also splits the gradient half and half where ``x`` equals a tensor bound)."""
    import torch

    with torch.inference_mode(False), torch.enable_grad():  # (first called inside ORT's run: grad off)
        x = torch.tensor([0.0, 1.0], requires_grad=True)
        (g,) = torch.autograd.grad(x.clamp(0.0, 1.0), x, torch.ones(2))
    return bool((g == 1.0).all())


def _conv_transpose(
    x, w, b, stride: list[int], padding: list[int], dilation: list[int], output_padding: list[int], groups: int
):
    """ONNX ConvTranspose (symmetric pads) as PyTorch's transposed ``convolution``."""
    import torch

    # (a bf16 graph's bias may be a constant that HalfPrecisionOnCPUPass made float32)
    b = None if b is None else b.to(x.dtype)
    return torch.ops.aten.convolution(x, w.to(x.dtype), b, stride, padding, dilation, True, output_padding, groups)


def _conv_transpose_backward(
    grad, x, w, stride: list[int], padding: list[int], dilation: list[int], output_padding: list[int], groups: int,
    output_mask: list[bool],
):  # fmt: skip
    """dx, dw, db of :func:`_conv_transpose`: PyTorch's ``convolution_backward``, as eager's autograd
    calls it (no recompute of the forward under autograd)."""
    import torch

    grads = torch.ops.aten.convolution_backward(
        grad.to(x.dtype), x, w.to(x.dtype), [w.shape[1] * groups], stride, padding, dilation, True, output_padding,
        groups, output_mask,
    )  # fmt: skip
    return _conv_grads(grads, x, w, output_mask)


def _conv_grads(grads, x, w, output_mask: list[bool]):
    """``convolution_backward``'s (dx, dw, db) in the dtypes of x, w and x, an empty tensor where
    ``output_mask`` asked for none."""
    import torch

    empty = torch.empty(0, dtype=x.dtype)
    return tuple(g.to(t.dtype) if want else empty for g, t, want in zip(grads, (x, w, x), output_mask))


def _conv(x, w, b, stride: list[int], padding: list[int], dilation: list[int], groups: int, half: bool):
    """ONNX Conv (symmetric pads) as PyTorch's ``convolution`` (oneDNN on CPU): the route ``gemm_choice``
    picks for a convolution that measures faster there than ORT's Conv + ConvGrad. ``half``: computed
    in bf16 from float32 inputs (an autocast convolution: the casts inside, vectorized, where ORT's Casts
    would be scalar), the bf16 result returned widened to float32, as eager's is read."""
    import torch

    dt = torch.bfloat16 if half else x.dtype
    b = None if b is None else b.to(dt)
    y = torch.ops.aten.convolution(x.to(dt), w.to(dt), b, stride, padding, dilation, False, [0] * len(stride), groups)
    return y.to(x.dtype)


def _conv_backward(
    grad, x, w, stride: list[int], padding: list[int], dilation: list[int], groups: int, half: bool,
    output_mask: list[bool],
):  # fmt: skip
    """dx, dw, db of :func:`_conv`: PyTorch's ``convolution_backward`` (in bf16 with ``half``, on the
    output gradient rounded to bf16, as eager autocast's), as eager's autograd calls it."""
    import torch

    dt = torch.bfloat16 if half else x.dtype
    grads = torch.ops.aten.convolution_backward(
        grad.to(dt), x.to(dt), w.to(dt), [w.shape[0]], stride, padding, dilation, False, [0] * len(stride),
        groups, output_mask,
    )  # fmt: skip
    return _conv_grads(grads, x, w, output_mask)


def _hardswish(x):
    import torch

    return torch.ops.aten.hardswish(x)


def _hardswish_backward(grad, x, output_mask: list[bool]):
    """dx of ``hardswish`` (PyTorch's ``hardswish_backward``, eager's formula), in x's dtype."""
    import torch

    return [torch.ops.aten.hardswish_backward(grad.to(x.dtype), x)]


def _like_input(grad, x):
    """``grad`` in x's dtype and shape (ORT may hand a 0-d value's gradient over as [1])."""
    grad = grad.to(x.dtype)
    return grad.reshape(x.shape) if grad.shape != x.shape and grad.numel() == x.numel() else grad


# The backward ops of PyTorch's own activations (ATEN_GRADIENTS): each is the one ATen backward op
# eager's autograd calls (derivatives.yaml), so the gradient is eager's, bit for bit. NOTE: the
# Python defaults repeat the schemas': torch leaves an argument equal to its schema default out of a
# Python kernel's call.
def _elu_backward(grad, x, alpha=1, scale=1, input_scale=1, output_mask: list[bool] = (True,)):
    """dx of ``elu`` (``selu`` and ``celu`` are ``elu`` of other constants), from the input as eager's."""
    import torch

    return [torch.ops.aten.elu_backward(_like_input(grad, x), alpha, scale, input_scale, False, x)]


def _softplus_backward(grad, x, beta=1, threshold=20, output_mask: list[bool] = (True,)):
    import torch

    return [torch.ops.aten.softplus_backward(_like_input(grad, x), x, beta, threshold)]


def _mish_backward(grad, x, output_mask: list[bool]):
    import torch

    return [torch.ops.aten.mish_backward(_like_input(grad, x), x)]


def _threshold_backward(grad, x, threshold, value, output_mask: list[bool]):
    import torch

    return [torch.ops.aten.threshold_backward(_like_input(grad, x), x, threshold)]


def _leaky_relu_backward(grad, x, negative_slope=0.01, output_mask: list[bool] = (True,)):
    import torch

    return [torch.ops.aten.leaky_relu_backward(_like_input(grad, x), x, negative_slope, False)]


def _aten_gelu_backward(grad, x, approximate: str = "none", output_mask: list[bool] = (True,)):
    import torch

    return [torch.ops.aten.gelu_backward(_like_input(grad, x), x, approximate=approximate)]


def _shrink(x, lambd: float, bias: float):
    import torch

    zero = torch.zeros((), dtype=x.dtype)
    return torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, zero))


def _reduce_impl(x, kind: str, dims: list[int], keepdim: bool):
    import torch

    dims = list(dims) or list(range(x.dim()))
    if kind == "prod":
        for d in sorted((d % x.dim() for d in dims), reverse=True):
            x = x.prod(d, keepdim=True)
        return x if keepdim else x.squeeze(dims) if dims else x
    if kind == "l1":
        return torch.linalg.vector_norm(x, 1, dims, keepdim)
    if kind == "l2":
        return torch.linalg.vector_norm(x, 2, dims, keepdim)
    if kind == "sum_square":
        return (x * x).sum(dims, keepdim)
    if kind == "log_sum":
        return x.sum(dims, keepdim).log()
    raise ValueError(f"ortwrap_ops::reduce: unknown kind {kind!r}")


def _cumsum_impl(x, axis: int, exclusive: bool, reverse: bool):
    y = x.flip(axis) if reverse else x
    # NOTE: dtype=x.dtype: torch's cumsum of an integer tensor is int64, and an ATen node's output
    # must have the type the graph declares for it (ORT reads the buffer as that type).
    y = y.cumsum(axis, dtype=x.dtype)
    if exclusive:
        y = y - (x.flip(axis) if reverse else x)
    return y.flip(axis) if reverse else y


def _pad_impl(x, pads: list[int], mode: str):
    """ONNX pads ([begin per dim, end per dim]) in ``F.pad``'s order (last dim first)."""
    import torch.nn.functional as F

    rank = x.dim()
    begin, end = pads[:rank], pads[rank:]
    first = next((i for i in range(rank) if begin[i] or end[i]), rank)
    if mode != "constant" and first < rank:
        # reflect/replicate/circular pad k = 1, 2 or 3 trailing dims of a rank k+1 or k+2 input:
        # zero pads on leading dims are added until k is one of them ((-4, 5) alone on a 4-D input
        # was refused: "Padding size 2 is not supported for 4D input tensor")
        k = rank - first
        valid = [n for n in (rank - 2, rank - 1) if 1 <= n <= 3 and n >= k]
        if valid:
            first = rank - min(valid)
    torch_pad: list[int] = []
    for d in range(rank - 1, first - 1, -1):
        torch_pad += [begin[d], end[d]]
    return F.pad(x, torch_pad, mode=mode) if torch_pad else x.clone()


def _slice_impl(x, starts: list[int], ends: list[int], axes: list[int], steps: list[int]):
    """ONNX Slice (negative steps included) from ``flip`` and ``aten::slice``."""
    import torch

    for s, e, a, st in zip(starts, ends, axes, steps):
        a = a % x.dim()
        dim = x.shape[a]
        if st > 0:
            x = torch.ops.aten.slice.Tensor(x, a, s, e, st)
            continue
        s = s + dim if s < 0 else s
        e = e + dim if e < 0 else e
        s, e = min(max(s, 0), dim - 1), min(max(e, -1), dim - 1)
        x = torch.ops.aten.slice.Tensor(x.flip(a), a, dim - 1 - s, max(dim - 1 - e, dim - 1 - s), -st)
    return x  # a view of the input is copied by the ATen bridge


def _scatter_nd_add(data, indices, updates):
    """ONNX ``ScatterND(reduction="add")``: ``indices[..., k]`` index the first dims of ``data``."""
    return data.index_put(tuple(indices[..., i] for i in range(indices.shape[-1])), updates, accumulate=True)


def _cat2(a, b, dim: int):
    import torch

    return torch.cat([a, b], dim)


def _squeeze_ones(x, dims: list[int]):
    """``x.squeeze(dims)`` where the export traced every ``dims`` size as 1: a size that is not 1 at
    run time is an error (the graph after it was traced for the squeezed rank)."""
    dims = [d % x.dim() for d in dims]
    if x.device.type == "meta":  # type inference (symbolic dims stand in as 2): the squeezed rank
        return x.new_empty([s for i, s in enumerate(x.shape) if i not in dims])
    for d in dims:
        if x.shape[d] != 1:
            raise RuntimeError(
                f"squeeze({d}) was exported for a size-1 dimension; this input has size {x.shape[d]} "
                f"(shape {tuple(x.shape)}): the graph after it assumes the squeezed rank"
            )
    return x.squeeze(dims)


#: torch's ScalarType codes of the float dtypes (``bridge/aten.py`` ``_SCALAR_TYPES``)
_FLOAT_CODES = {5: "float16", 6: "float32", 7: "float64", 15: "bfloat16"}


def _dtypes(codes) -> list:
    """The torch dtypes named by a ``dtypes`` argument (torch's ScalarType codes)."""
    import torch

    return [getattr(torch, _FLOAT_CODES[int(c)]) for c in codes]


#: A last ``dtypes`` code of the bf16 GEMM ops (``linear``, ``matmul`` and their variants): return
#: an empty tensor in place of the weight's bf16 copy, whose backward casts the weight itself again
#: (``grad.recompute._recast_weight_copies``).
NO_WEIGHT_COPY = -1


def _weight_copy(wc, dtypes, n_inputs: int):
    """``wc`` (the weight's copy in the compute dtype), or an empty tensor where ``dtypes`` (of an op
    with ``n_inputs`` float inputs) ends with :data:`NO_WEIGHT_COPY`."""
    if len(dtypes) > 2 + n_inputs and int(dtypes[-1]) == NO_WEIGHT_COPY:
        return wc.new_empty(0)
    return wc


def _saved(x, dtype):
    """``x`` in ``dtype`` for the backward. A tensor already in it is returned as it is: the ATen
    bridge copies a result that shares an input's memory (ORT owns the input)."""
    return x.to(dtype)


def _linear(x, w, b, dtypes: list[int]):
    """``F.linear`` computed in ``dtypes[0]`` (a bf16 GEMM): the result, rounded to that dtype and
    returned in ``dtypes[1]``, then the copies of x and w in the compute dtype (what the backward
    reads). ``dtypes``: torch's ScalarType codes of [compute, result, x, w, b]; the backward returns
    each input's gradient in its dtype (``passes/half_values.py`` keeps some of them bf16)."""
    import torch.nn.functional as F

    compute, result = _dtypes(dtypes[:2])
    xc, wc = _saved(x, compute), _saved(w, compute)
    return F.linear(xc, wc, None if b is None else b.to(compute)).to(result), xc, _weight_copy(wc, dtypes, 3)


def _matmul(a, b, dtypes: list[int]):
    """``torch.matmul`` computed in ``dtypes[0]``: the result in ``dtypes[1]``, then the copies of a
    and b. ``dtypes``: [compute, result, a, b] (torch's codes)."""
    import torch

    compute, result = _dtypes(dtypes[:2])
    ac, bc = _saved(a, compute), _saved(b, compute)
    return torch.matmul(ac, bc).to(result), ac, _weight_copy(bc, dtypes, 2)


def _attention(q, kt, v, mask, scale: float, dtypes: list[int]):
    """Softmax attention (PyTorch's CPU flash attention) computed in ``dtypes[0]`` from q, k^T and
    v: the output in ``dtypes[1]``, then what the backward reads with it: the operands in the
    compute dtype (k, not k^T) and the log-sum-exp. ``dtypes``: [compute, result, q, kt, v]."""
    from .._compat.torch import flash_attention_cpu

    compute, result = _dtypes(dtypes[:2])
    qc, kc, vc = _saved(q, compute), kt.to(compute).transpose(-1, -2).contiguous(), _saved(v, compute)
    out, lse = flash_attention_cpu()[0](qc, kc, vc, 0.0, False, attn_mask=mask, scale=scale)
    return out.to(result), qc, kc, vc, lse


def _linear_keep_input(x, w, b, dtypes: list[int]):
    """:func:`_linear` of an ``x`` already in the compute dtype (``passes/half_values.py``): the
    result and w's copy; the backward reads x itself (a returned x would be copied: see ``_saved``)."""
    y, _, wc = _linear(x, w, b, dtypes)
    return y, wc


def _linear_keep_input_half(x, w, b, dtypes: list[int]):
    """:func:`_linear_keep_input` whose result is also read in the compute dtype (a float32 result
    that the graph also narrows: an LM head's logits, float32 for the loss and bf16 for the caller,
    as eager autocast returns them): the result, w's copy, then the result in the compute dtype (the
    GEMM's own output, bf16-exact) in place of ORT's ``Cast`` of the float32 one."""
    import torch.nn.functional as F

    compute, result = _dtypes(dtypes[:2])
    wc = _saved(w, compute)
    y = F.linear(x, wc, None if b is None else b.to(compute))
    return y.to(result), _weight_copy(wc, dtypes, 3), y


def _attention_keep_inputs(q, kt, v, mask, scale: float, dtypes: list[int]):
    """:func:`_attention` of q, k^T and v already in the compute dtype: the result, k (contiguous)
    and the log-sum-exp; the backward reads q and v themselves."""
    out, _, kc, _, lse = _attention(q, kt, v, mask, scale, dtypes)
    return out, kc, lse


def _attention_bf16_backward(
    grad, qc, kc, vc, out, lse, mask, scale: float, dtypes: list[int], output_mask: list[bool]
):
    """dq, d(k^T), dv of :func:`_attention` (PyTorch's flash attention backward) in the inputs'
    dtypes; ``out`` is the forward's result (in the compute dtype exactly, whatever its dtype)."""
    import torch

    from .._compat.torch import flash_attention_cpu

    types = _dtypes(dtypes[2:5])
    dq, dk, dv = flash_attention_cpu()[1](
        grad.to(qc.dtype), qc, kc, vc, out.to(qc.dtype), lse, 0.0, False, attn_mask=mask, scale=scale
    )
    return (
        dq.to(types[0]) if output_mask[0] else torch.empty(0, dtype=types[0]),
        dk.transpose(-1, -2).to(types[1]).contiguous() if output_mask[1] else torch.empty(0, dtype=types[1]),
        dv.to(types[2]) if output_mask[2] else torch.empty(0, dtype=types[2]),
    )


def _attention_backward(grad, qc, kc, vc, out, lse, mask, scale: float, output_mask: list[bool], causal=False):
    """dq, d(k^T), dv of :func:`_attention` (PyTorch's flash attention backward), in grad's dtype."""
    import torch

    from .._compat.torch import flash_attention_cpu

    dq, dk, dv = flash_attention_cpu()[1](
        grad.to(qc.dtype), qc, kc, vc, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )
    empty = torch.empty(0, dtype=grad.dtype)
    return (
        dq.to(grad.dtype) if output_mask[0] else empty,
        dk.transpose(-1, -2).to(grad.dtype).contiguous() if output_mask[1] else empty,
        dv.to(grad.dtype) if output_mask[2] else empty,
    )


def _gelu_in_dtype(x, approximate: int):
    """``F.gelu`` in x's dtype (PyTorch's bf16 kernel for the bf16 values of ``passes/half_values.py``)."""
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh" if approximate else "none")


def _gelu_backward(grad, x, approximate: int, output_mask: list[bool]):
    """dx of :func:`_gelu_in_dtype` (PyTorch's ``gelu_backward``), in x's dtype."""
    import torch

    return [torch.ops.aten.gelu_backward(grad.to(x.dtype), x, approximate="tanh" if approximate else "none")]


def _linear_f32(x, w, b):
    """``F.linear`` in the inputs' dtype (float32): its backward reads the inputs themselves."""
    import torch.nn.functional as F

    return F.linear(x, w, b)


def _matmul_f32(a, b):
    """``torch.matmul`` in the inputs' dtype (float32)."""
    import torch

    return torch.matmul(a, b)


def _attention_f32(q, kt, v, mask, scale: float):
    """:func:`_attention` in the inputs' dtype (float32): the output, then k (contiguous, not k^T) and
    the log-sum-exp, which the backward reads with q, v and the output (no T x T probabilities)."""
    from .._compat.torch import flash_attention_cpu

    k = kt.transpose(-1, -2).contiguous()
    out, lse = flash_attention_cpu()[0](q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    return out, k, lse


def _attention_causal_f32(q, kt, v, scale: float):
    """:func:`_attention_f32` with flash attention's causal mask (top-left aligned) instead of a mask
    tensor: the blocks above the diagonal are skipped, not computed and masked."""
    from .._compat.torch import flash_attention_cpu

    k = kt.transpose(-1, -2).contiguous()
    out, lse = flash_attention_cpu()[0](q, k, v, 0.0, True, attn_mask=None, scale=scale)
    return out, k, lse


def _attention_causal_backward(grad, q, k, v, out, lse, scale: float, output_mask: list[bool]):
    """dq, d(k^T), dv of :func:`_attention_causal_f32`."""
    return _attention_backward(grad, q, k, v, out, lse, None, scale, output_mask, causal=True)


def _attention_bthd_f32(q, k, v, mask, scale: float, causal: bool):
    """Flash attention on q, k, v in the projections' [B, T, H, D] layout (the kernel reads the
    [B, H, T, D] views, strided; nothing copied): the output in [B, T, H, D] (flash attention writes
    it so) and the log-sum-exp, which the backward reads with q, k, v and the output."""
    from .._compat.torch import flash_attention_cpu

    out, lse = flash_attention_cpu()[0](
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2).contiguous(), lse


def _attention_bthd_backward(grad, q, k, v, out, lse, mask, scale: float, causal: bool, output_mask: list[bool]):
    """dq, dk, dv of :func:`_attention_bthd_f32`, in [B, T, H, D]."""
    import torch

    from .._compat.torch import flash_attention_cpu

    t = [x.transpose(1, 2) for x in (grad, q, k, v, out)]
    grads = flash_attention_cpu()[1](*t, lse, 0.0, causal, attn_mask=mask, scale=scale)
    empty = torch.empty(0, dtype=grad.dtype)
    return tuple(d.transpose(1, 2).contiguous() if m else empty for d, m in zip(grads, output_mask))


def _sum_to(t, shape):
    """``t`` summed over the dims it was broadcast along to reach its shape from ``shape``."""
    lead = t.dim() - len(shape)
    if lead:
        t = t.sum(list(range(lead)))
    dims = [i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1]
    return t.sum(dims, keepdim=True) if dims else t


def _linear_backward(grad, xc, wc, output_mask: list[bool]):
    """dx = dy W, dW = dy^T x, db = sum(dy) from the forward's copies ``xc``, ``wc`` (in the
    compute dtype), as eager autocast computes them: GEMMs in that dtype (the output gradient
    rounded to it first), results in the output gradient's dtype; nothing recomputed."""
    import torch

    empty = torch.empty(0, dtype=grad.dtype)
    g = grad.to(wc.dtype)
    g2 = g.reshape(-1, g.shape[-1])
    dx = torch.matmul(g, wc).to(grad.dtype) if output_mask[0] else empty
    dw = g2.t().mm(xc.reshape(-1, xc.shape[-1])).to(grad.dtype) if output_mask[1] else empty
    db = g2.sum(0).to(grad.dtype) if output_mask[2] else empty
    return dx, dw, db


def _matmul_backward(grad, ac, bc, output_mask: list[bool]):
    """da = dy b^T, db = a^T dy from the forward's copies (rank >= 2), summed over broadcast dims."""
    import torch

    empty = torch.empty(0, dtype=grad.dtype)
    g = grad.to(ac.dtype)
    da = _sum_to(torch.matmul(g, bc.transpose(-1, -2)), ac.shape).to(grad.dtype) if output_mask[0] else empty
    if not output_mask[1]:
        db = empty
    elif bc.dim() == 2:  # a weight: one GEMM over all rows
        db = ac.reshape(-1, ac.shape[-1]).t().mm(g.reshape(-1, g.shape[-1])).to(grad.dtype)
    else:
        db = _sum_to(torch.matmul(ac.transpose(-1, -2), g), bc.shape).to(grad.dtype)
    return da, db


def _weight_grad(a, b):
    """``a^T b`` of two row-major [rows, n] operands in a half dtype (a weight's gradient, the rows
    reduced). NOTE: where ``a`` is no wider than ``b``, ``a^T`` is made contiguous first: PyTorch's
    bf16 GEMM (oneDNN, AMX) reads a transposed left operand slowly, and copying the narrower operand
    costs less than that (GPT-2's 3072 -> 768 layer: 5.4 -> 3.8 ms CPU with the copy). A wider
    ``a`` is read transposed: its transposing copy (PyTorch's is slow, and cold in a training step)
    cost more than it saved. The products are summed in float32 either way; only the order of the
    sums differs (rare last-bit differences from eager, which reads ``a`` transposed)."""
    return (a.t().contiguous() if a.shape[1] <= b.shape[1] else a.t()).mm(b)


def _linear_bf16_backward(grad, xc, wc, dtypes: list[int], output_mask: list[bool]):
    """:func:`_linear_backward` of :func:`_linear` with each gradient cast once, from the compute
    dtype to its input's dtype (``dtypes`` [compute, result, x, w, b]): a bf16 dx of a float32
    output gradient is not widened to float32 and narrowed again."""
    compute = _dtypes(dtypes[:1])[0]
    return _linear_grads(grad.to(compute), xc, wc.to(compute), _dtypes(dtypes[2:5]), output_mask)


def _linear_bf16_backward_half(grad, grad_half, xc, wc, dtypes: list[int], output_mask: list[bool]):
    """:func:`_linear_bf16_backward` of :func:`_linear_keep_input_half`: the result's two gradients
    summed as eager autocast sums them (the float32 one rounded to the compute dtype first, then
    added in it: eager's bf16 result had both readers). Either may be absent (no gradient reaches
    that result: ``OPTIONAL_GRADIENT_OPS``)."""
    compute = _dtypes(dtypes[:1])[0]
    g = None if grad is None else grad.to(compute)
    if grad_half is not None:
        g = grad_half.to(compute) if g is None else g + grad_half.to(compute)
    return _linear_grads(g, xc, wc.to(compute), _dtypes(dtypes[2:5]), output_mask)


def _linear_grads(g, xc, wc, types: list, output_mask: list[bool]):
    """dx, dW, db of a linear from its output gradient ``g`` in the compute dtype, each in ``types``."""
    import torch

    g2 = g.reshape(-1, g.shape[-1])
    dx = torch.matmul(g, wc).to(types[0]) if output_mask[0] else torch.empty(0, dtype=types[0])
    if output_mask[1]:
        dw = _weight_grad(g2, xc.reshape(-1, xc.shape[-1])).to(types[1])
    else:
        dw = torch.empty(0, dtype=types[1])
    db = g2.sum(0).to(types[2]) if output_mask[2] else torch.empty(0, dtype=types[2])
    return dx, dw, db


def _matmul_bf16_backward(grad, ac, bc, dtypes: list[int], output_mask: list[bool]):
    """:func:`_matmul_backward` of :func:`_matmul`, each gradient cast once to its input's dtype."""
    import torch

    types = _dtypes(dtypes[2:4])
    bc = bc.to(ac.dtype)  # the weight itself where the backward reads it (grad/recompute.py)
    g = grad.to(ac.dtype)
    if not output_mask[0]:
        da = torch.empty(0, dtype=types[0])
    else:
        da = _sum_to(torch.matmul(g, bc.transpose(-1, -2)), ac.shape).to(types[0])
    if not output_mask[1]:
        db = torch.empty(0, dtype=types[1])
    elif bc.dim() == 2:  # a weight: one GEMM over all rows
        db = _weight_grad(ac.reshape(-1, ac.shape[-1]), g.reshape(-1, g.shape[-1])).to(types[1])
    else:
        db = _sum_to(torch.matmul(ac.transpose(-1, -2), g), bc.shape).to(types[1])
    return da, db


_GI3 = ["GI(0)", "GI(1)", "GI(2)"]

#: Every op of ``torch.ops.ortwrap_ops``, one declaration each.
OPS: tuple[Op, ...] = (
    Op("cat2(Tensor a, Tensor b, int dim) -> Tensor", _cat2),
    Op("scatter_nd_add(Tensor data, Tensor indices, Tensor updates) -> Tensor", _scatter_nd_add),
    Op("squeeze_ones(Tensor x, int[] dims) -> Tensor", _squeeze_ones),
    # The native bf16 route's GEMMs (passes/half_matmul.py) and their variants (passes/half_values.py):
    # a dtype argument, the operands' copies in the compute dtype returned for the explicit backward op.
    Op(
        "linear(Tensor x, Tensor w, Tensor? b, int[] dtypes) -> (Tensor, Tensor, Tensor)",
        _linear,
        gradient("linear_bf16_backward", ["GO(0)", "O(1)", "O(2)", "I(3)"], _GI3, stop=[3]),
        dtype_operands=3,
        float32_form="linear_f32",
        weight_copy_output=2,
        heavy=True,
    ),
    Op(
        "matmul(Tensor a, Tensor b, int[] dtypes) -> (Tensor, Tensor, Tensor)",
        _matmul,
        gradient("matmul_bf16_backward", ["GO(0)", "O(1)", "O(2)", "I(2)"], ["GI(0)", "GI(1)"], stop=[2]),
        dtype_operands=2,
        float32_form="matmul_f32",
        weight_copy_output=2,
        heavy=True,
    ),
    Op(
        "attention(Tensor q, Tensor kt, Tensor v, Tensor? mask, float scale, int[] dtypes) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        _attention,
        gradient(
            "attention_bf16_backward",
            ["GO(0)", "O(1)", "O(2)", "O(3)", "O(0)", "O(4)", "I(3)", "I(4)", "I(5)"],
            _GI3,
            stop=[3, 4, 5],
        ),
        dtype_operands=3,
        float32_form="attention_f32",
        heavy=True,
    ),
    Op(
        "linear_keep_input(Tensor x, Tensor w, Tensor? b, int[] dtypes) -> (Tensor, Tensor)",
        _linear_keep_input,
        gradient("linear_bf16_backward", ["GO(0)", "I(0)", "O(1)", "I(3)"], _GI3, stop=[3]),
        dtype_operands=3,
        weight_copy_output=1,
        heavy=True,
    ),
    Op(
        "linear_keep_input_half(Tensor x, Tensor w, Tensor? b, int[] dtypes) -> (Tensor, Tensor, Tensor)",
        _linear_keep_input_half,
        gradient("linear_bf16_backward_half", ["GO(0)", "GO(2)", "I(0)", "O(1)", "I(3)"], _GI3, stop=[3]),
        dtype_operands=3,
        weight_copy_output=1,
        heavy=True,
    ),
    Op(
        "attention_keep_inputs(Tensor q, Tensor kt, Tensor v, Tensor? mask, float scale, int[] dtypes) "
        "-> (Tensor, Tensor, Tensor)",
        _attention_keep_inputs,
        gradient(
            "attention_bf16_backward",
            ["GO(0)", "I(0)", "O(1)", "I(2)", "O(0)", "O(2)", "I(3)", "I(4)", "I(5)"],
            _GI3,
            stop=[3, 4, 5],
        ),
        dtype_operands=3,
        heavy=True,
    ),
    Op(
        "attention_bf16_backward(Tensor grad, Tensor qc, Tensor kc, Tensor vc, Tensor out, Tensor lse, Tensor? mask, "
        "float scale, int[] dtypes, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _attention_bf16_backward,
        heavy=True,
    ),
    Op(
        "linear_bf16_backward(Tensor grad, Tensor xc, Tensor wc, int[] dtypes, bool[3] output_mask) "
        "-> (Tensor, Tensor, Tensor)",
        _linear_bf16_backward,
        heavy=True,
    ),
    Op(
        "linear_bf16_backward_half(Tensor? grad, Tensor? grad_half, Tensor xc, Tensor wc, int[] dtypes, "
        "bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _linear_bf16_backward_half,
        optional_gradients=True,
        heavy=True,
    ),
    Op(
        "matmul_bf16_backward(Tensor grad, Tensor ac, Tensor bc, int[] dtypes, bool[2] output_mask) -> (Tensor, Tensor)",
        _matmul_bf16_backward,
        heavy=True,
    ),
    # PyTorch's bf16 GELU, in place of ortwrap's float32 kernel between bf16 GEMMs (passes/half_values.py).
    Op(
        "gelu(Tensor x, int approximate) -> Tensor",
        _gelu_in_dtype,
        gradient("gelu_backward", ["GO(0)", "I(0)", "I(1)"], ["GI(0)"], stop=[1]),
    ),
    Op(
        "gelu_backward(Tensor grad, Tensor x, int approximate, bool[1] output_mask) -> Tensor[]",
        _gelu_backward,
    ),
    # The torch-GEMM route's float32 ops (Options.gemm="torch"): their backward reads the forward's inputs.
    Op(
        "linear_f32(Tensor x, Tensor w, Tensor? b) -> Tensor",
        _linear_f32,
        gradient("linear_backward", ["GO(0)", "I(0)", "I(1)"], _GI3),
        heavy=True,
    ),
    Op(
        "linear_backward(Tensor grad, Tensor xc, Tensor wc, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _linear_backward,
        heavy=True,
    ),
    Op(
        "matmul_f32(Tensor a, Tensor b) -> Tensor",
        _matmul_f32,
        gradient("matmul_backward", ["GO(0)", "I(0)", "I(1)"], ["GI(0)", "GI(1)"]),
        heavy=True,
    ),
    Op(
        "matmul_backward(Tensor grad, Tensor ac, Tensor bc, bool[2] output_mask) -> (Tensor, Tensor)",
        _matmul_backward,
        heavy=True,
    ),
    Op(
        "attention_f32(Tensor q, Tensor kt, Tensor v, Tensor? mask, float scale) -> (Tensor, Tensor, Tensor)",
        _attention_f32,
        gradient(
            "attention_backward", ["GO(0)", "I(0)", "O(1)", "I(2)", "O(0)", "O(2)", "I(3)", "I(4)"], _GI3, stop=[3, 4]
        ),
        heavy=True,
    ),
    Op(
        "attention_backward(Tensor grad, Tensor qc, Tensor kc, Tensor vc, Tensor out, Tensor lse, Tensor? mask, "
        "float scale, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _attention_backward,
        heavy=True,
    ),
    Op(
        "attention_causal_f32(Tensor q, Tensor kt, Tensor v, float scale) -> (Tensor, Tensor, Tensor)",
        _attention_causal_f32,
        gradient(
            "attention_causal_backward", ["GO(0)", "I(0)", "O(1)", "I(2)", "O(0)", "O(2)", "I(3)"], _GI3, stop=[3]
        ),
        heavy=True,
    ),
    Op(
        "attention_causal_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, "
        "bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _attention_causal_backward,
        heavy=True,
    ),
    Op(
        "attention_bthd_f32(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal) -> (Tensor, Tensor)",
        _attention_bthd_f32,
        gradient(
            "attention_bthd_backward",
            ["GO(0)", "I(0)", "I(1)", "I(2)", "O(0)", "O(1)", "I(3)", "I(4)", "I(5)"],
            _GI3,
            stop=[3, 4, 5],
        ),
        heavy=True,
    ),
    Op(
        "attention_bthd_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? mask, "
        "float scale, bool causal, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _attention_bthd_backward,
        heavy=True,
    ),
    # Composites with ONNX semantics (ops/mappers.py's GRADIENTS run ONNX ops ORT cannot differentiate as these).
    Op("slice(Tensor x, int[] starts, int[] ends, int[] axes, int[] steps) -> Tensor", _slice_impl),
    Op("pad(Tensor x, int[] pads, str mode) -> Tensor", _pad_impl),
    Op("reduce(Tensor x, str kind, int[] dims, bool keepdim) -> Tensor", _reduce_impl),
    Op("cumsum(Tensor x, int axis, bool exclusive, bool reverse) -> Tensor", _cumsum_impl),
    Op("prelu(Tensor x, Tensor slope) -> Tensor", _prelu),
    # HardSwish and HardSigmoid (MobileNetV3's activations) with their backward ops: a vjp would
    # recompute each under autograd, ~50-140 us a node against eager's ~5 (docs/performance.md).
    Op(
        "hard_sigmoid(Tensor x, float alpha, float beta) -> Tensor",
        _hard_sigmoid_impl,
        gradient("hard_sigmoid_backward", ["GO(0)", "I(0)", "I(1)", "I(2)"], ["GI(0)"], stop=[1, 2]),
    ),
    Op(
        "hard_sigmoid_backward(Tensor grad, Tensor x, float alpha, float beta, bool[1] output_mask) -> Tensor[]",
        _hard_sigmoid_backward,
    ),
    # ConvTranspose (no ConvTransposeGrad kernel on CPU in ORT 1.19.2) with its backward op: a vjp would
    # recompute the convolution under autograd before convolution_backward.
    Op(
        "conv_transpose(Tensor x, Tensor w, Tensor? b, int[] stride, int[] padding, int[] dilation, "
        "int[] output_padding, int groups) -> Tensor",
        _conv_transpose,
        gradient(
            "conv_transpose_backward",
            ["GO(0)", "I(0)", "I(1)", "I(3)", "I(4)", "I(5)", "I(6)", "I(7)"],
            _GI3,
            stop=[3, 4, 5, 6, 7],
        ),
        heavy=True,  # a convolution: recompute="cheap" keeps its result
    ),
    Op(
        "conv_transpose_backward(Tensor grad, Tensor x, Tensor w, int[] stride, int[] padding, int[] dilation, "
        "int[] output_padding, int groups, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _conv_transpose_backward,
        heavy=True,
    ),
    # Conv where gemm_choice measured PyTorch's convolution faster than ORT's Conv + ConvGrad on
    # the graph's shapes (passes/torch_conv.py), with its backward op (no vjp: no recompute).
    Op(
        "conv(Tensor x, Tensor w, Tensor? b, int[] stride, int[] padding, int[] dilation, int groups, bool half) "
        "-> Tensor",
        _conv,
        gradient(
            "conv_backward",
            ["GO(0)", "I(0)", "I(1)", "I(3)", "I(4)", "I(5)", "I(6)", "I(7)"],
            _GI3,
            stop=[3, 4, 5, 6, 7],
        ),
        heavy=True,
    ),
    Op(
        "conv_backward(Tensor grad, Tensor x, Tensor w, int[] stride, int[] padding, int[] dilation, int groups, "
        "bool half, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _conv_backward,
        heavy=True,
    ),
    Op("hardswish(Tensor x) -> Tensor", _hardswish, gradient("hardswish_backward", ["GO(0)", "I(0)"], ["GI(0)"])),
    Op("hardswish_backward(Tensor grad, Tensor x, bool[1] output_mask) -> Tensor[]", _hardswish_backward),
    Op("shrink(Tensor x, float lambd, float bias) -> Tensor", _shrink),
    # The backward ops of ATEN_GRADIENTS (PyTorch's activations): their arguments after x have the
    # forward's defaults, for an ATen node that leaves trailing defaults out.
    Op(
        "elu_backward(Tensor grad, Tensor x, Scalar alpha=1, Scalar scale=1, Scalar input_scale=1, "
        "bool[1] output_mask) -> Tensor[]",
        _elu_backward,
    ),
    Op(
        "softplus_backward(Tensor grad, Tensor x, Scalar beta=1, Scalar threshold=20, bool[1] output_mask) -> Tensor[]",
        _softplus_backward,
    ),
    Op("mish_backward(Tensor grad, Tensor x, bool[1] output_mask) -> Tensor[]", _mish_backward),
    Op(
        "threshold_backward(Tensor grad, Tensor x, Scalar threshold, Scalar value, bool[1] output_mask) -> Tensor[]",
        _threshold_backward,
    ),
    Op(
        "leaky_relu_backward(Tensor grad, Tensor x, Scalar negative_slope=0.01, bool[1] output_mask) -> Tensor[]",
        _leaky_relu_backward,
    ),
    Op(
        'aten_gelu_backward(Tensor grad, Tensor x, str approximate="none", bool[1] output_mask) -> Tensor[]',
        _aten_gelu_backward,
    ),
)

#: PyTorch's own ops, as ATen nodes name them (``torch.ops.aten.<name>``), whose gradient is one of
#: the backward ops above instead of the ATen bridge's vjp (which recomputes the op under autograd
#: and calls ``torch.autograd.grad``: ~23 us a call against ~8 us for the backward op's, as the bridge
#: runs them; docs/performance.md). The ONNX ops ORT cannot differentiate that ``ops/mappers.py`` runs as these
#: (Elu, Selu, Celu, Softplus, Mish; LeakyRelu and Gelu in float64), and TorchScript's ATen nodes
#: (``softplus`` with a threshold, ``threshold``). The forward's scalars are stop-gradient inputs.
ATEN_GRADIENTS: Mapping[str, Gradient] = MappingProxyType({
    "elu": gradient("elu_backward", ["GO(0)", "I(0)", "I(1)", "I(2)", "I(3)"], ["GI(0)"], stop=[1, 2, 3]),
    "softplus": gradient("softplus_backward", ["GO(0)", "I(0)", "I(1)", "I(2)"], ["GI(0)"], stop=[1, 2]),
    "mish": gradient("mish_backward", ["GO(0)", "I(0)"], ["GI(0)"]),
    "threshold": gradient("threshold_backward", ["GO(0)", "I(0)", "I(1)", "I(2)"], ["GI(0)"], stop=[1, 2]),
    "leaky_relu": gradient("leaky_relu_backward", ["GO(0)", "I(0)", "I(1)"], ["GI(0)"], stop=[1]),
    "gelu": gradient("aten_gelu_backward", ["GO(0)", "I(0)", "I(1)"], ["GI(0)"], stop=[1]),
})  # fmt: skip


@functools.cache
def op(name: str) -> Op:
    """The declaration of ``ortwrap_ops::<name>``."""
    for o in OPS:
        if o.name == name:
            return o
    raise KeyError(f"no ortwrap op named {name!r}")


_library: list = []


def define_ops() -> None:
    """Define ortwrap's ops (``torch.ops.ortwrap_ops.*``, :data:`OPS`) in this process, once."""
    if _library:
        return
    import torch

    lib = torch.library.Library(OPS_NAMESPACE, "DEF")
    for o in OPS:
        lib.define(o.schema)
        lib.impl(o.name, o.impl, "CompositeImplicitAutograd")
    _library.append(lib)
