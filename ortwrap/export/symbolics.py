"""Custom TorchScript symbolics, registered only while ortwrap exports.

``ortwrap_symbolics`` installs them on entry and, on exit, restores whatever the registry held
before (including a user's own custom symbolic for the same op), so a user's ``torch.onnx.export``
calls are unaffected.

=============================  =================================================================
aten op                        why ortwrap overrides it
=============================  =================================================================
embedding                      ``padding_idx``: ONNX ``Gather`` would send gradient to the padding
                               row. Padding positions read the row through a stop-gradient copy of
                               the weight (``ortwrap::StopGradient``, resolved by a pass).
cross_entropy_loss             ``label_smoothing`` is refused by torch's symbolic; emitted as
                               ``SoftmaxCrossEntropyLoss`` (both outputs) plus the smoothing term.
unflatten                      torch's symbolic lets shape inference bake the traced sizes of the
                               dimensions before the split (``nn.MultiheadAttention``: a new
                               sequence length failed); ortwrap's keeps them symbolic.
scaled_dot_product_attention   ``enable_gqa=True`` (Llama's grouped-query attention) is refused by
                               torch's symbolic; key/value heads are repeated for their query group.
adaptive_avg/max_pool{1,2,3}d  the default symbolic bakes the traced input size into a fixed
                               pooling kernel; ortwrap records that the graph needs static spatial
                               shapes (see ``export.torchscript``).
prim::PythonOp                 autograd.Function calls become PythonOps (``bridge/symbolic.py``).
``Options.aten_ops``           each listed op becomes an ATen node (``bridge/aten.py``).
softmax, log_softmax           with ``dtype=``, torch's symbolic casts the result; ortwrap casts
                               the input first, as eager does.
squeeze (training graphs)      of a dim whose size ONNX lost (``LocalResponseNorm``'s, after a
                               computed ``Pad``): torch writes an ``If``; ortwrap an ATen node
                               ``ortwrap_ops::squeeze_ones`` where the traced call squeezed.
repeat_interleave              torch's symbolic normalizes a negative dim in place, on the constant
                               the trace shares with every other ``-1`` (a ``stack``'s dim): it
                               gets a constant of its own.
``aten::unfold``               a negative dim: torch's symbolic puts the window axis last (wrong
                               forward); the dim is made non-negative first.
``ops.ATEN_OPS``          hardtanh/relu6 and clamp/clip at their bounds (the installed torch's
                               gradient), softplus (beta/threshold), threshold, diagonal, cdist,
                               avg_pool with ``divisor_override``, p-norms, index_fill of a tensor value,
                               pairwise_distance, cosine_similarity, lerp, circular pad, var/std
                               with a fractional correction: torch's ONNX form is wrong or
                               untrainable (cdist: NaN gradient at distance 0); ATen nodes
                               (PyTorch's kernel and autograd), where the entry's ``when`` says so.
adaptive pools, unbatched      torch's symbolic pools the last ``rank - 2`` dims: ATen nodes.
sort, argsort                  the ``stable=`` overload's arguments are read as the other's
                               (sorted along the wrong dim).
feature_dropout                (``dropout2d``/``3d``) no ONNX form: ONNX Dropout of a ones tensor
                               of shape ``[N, C, 1, ...]`` makes the channel mask.
=============================  =================================================================
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import torch

from .._compat import torch as compat
from ..graph.names import ORTWRAP_DOMAIN
from ..ops import ATEN_OPS

#: Reasons, collected during one export, why the graph needs static non-batch dimensions.
_static_reasons: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("ortwrap_static", default=None)


def _embedding(g, weight, indices, padding_idx, scale_grad_by_freq, sparse):
    padding_idx = compat.ts_constant(padding_idx, "i")
    if compat.ts_constant(scale_grad_by_freq, "b"):
        raise RuntimeError("ortwrap: nn.Embedding(scale_grad_by_freq=True) has no ONNX Runtime equivalent")
    gathered = g.op("Gather", weight, indices)
    if padding_idx is None or padding_idx < 0:
        return gathered
    from .schemas import register_schemas

    register_schemas()  # its shape inference keeps the shapes downstream
    frozen = g.op(f"{ORTWRAP_DOMAIN}::StopGradient", weight)
    frozen_rows = g.op("Gather", frozen, indices)
    pad = g.op("Constant", value_t=torch.tensor(padding_idx, dtype=torch.int64))
    is_pad = g.op("Equal", g.op("Cast", indices, to_i=7), pad)
    is_pad = g.op("Unsqueeze", is_pad, g.op("Constant", value_t=torch.tensor([-1], dtype=torch.int64)))
    return g.op("Where", is_pad, frozen_rows, gathered)


def _detach(g, self):
    """``x.detach()``: torch's symbolic erases it (ONNX is inference-only), so ORT's gradient would
    flow through. ``ortwrap::StopGradient`` marks it; ``ResolveStopGradientPass`` resolves it."""
    from .schemas import register_schemas

    register_schemas()
    out = g.op(f"{ORTWRAP_DOMAIN}::StopGradient", self)
    out.setType(self.type())  # the input's type: torch's shape inference does not know the op
    return out


def _cross_entropy_loss(g, logits, target, weight, reduction, ignore_index, label_smoothing):
    if not isinstance(compat.ts_constant(ignore_index, "i"), int):
        # ignore_index computed from a traced size: an ATen node reads it at run time (ONNX's
        # SoftmaxCrossEntropyLoss takes it as an attribute only).
        return _aten_symbolic("cross_entropy_loss")(g, logits, target, weight, reduction, ignore_index, label_smoothing)
    reduction = compat.ts_constant(reduction, "i")
    ignore_index = compat.ts_constant(ignore_index, "i")
    label_smoothing = float(compat.ts_constant(label_smoothing, "f") or 0.0)
    mode = {0: "none", 1: "mean", 2: "sum"}[reduction]
    has_weight = not compat.ts_is_none(weight)
    inputs = [logits, target] + ([weight] if has_weight else [])
    loss, _log_prob = g.op("SoftmaxCrossEntropyLoss", *inputs, reduction_s=mode, ignore_index_i=ignore_index, outputs=2)
    if label_smoothing == 0.0:
        return loss
    if has_weight:
        raise RuntimeError("ortwrap: cross_entropy with both class weights and label_smoothing is not supported")
    # torch: (1 - eps) * nll + eps / C * sum_c(-log p_c), zero at ignored targets, reduced like nll.
    # (Cast, not CastLike: ORT 1.19.2 has no gradient for CastLike.)
    onnx_type, torch_dtype = compat.ts_scalar_type(logits)

    def const(v: float):
        return g.op("Constant", value_t=torch.tensor(v, dtype=torch_dtype))

    log_p = g.op("LogSoftmax", logits, axis_i=1)
    smooth = g.op("Neg", g.op("ReduceSum", log_p, g.op("Constant", value_t=torch.tensor([1])), keepdims_i=0))
    ignored = g.op("Equal", target, g.op("Constant", value_t=torch.tensor(ignore_index, dtype=torch.int64)))
    zero = const(0.0)
    smooth = g.op("Where", ignored, zero, smooth)
    if mode == "mean":
        kept = g.op("Cast", g.op("Not", ignored), to_i=onnx_type)
        smooth = g.op("Div", g.op("ReduceSum", smooth, keepdims_i=0), g.op("ReduceSum", kept, keepdims_i=0))
    elif mode == "sum":
        smooth = g.op("ReduceSum", smooth, keepdims_i=0)
    classes = g.op("Gather", g.op("Shape", logits), g.op("Constant", value_t=torch.tensor(1)), axis_i=0)
    classes = g.op("Cast", classes, to_i=onnx_type)
    return g.op(
        "Add",
        g.op("Mul", const(1.0 - label_smoothing), loss),
        g.op("Mul", g.op("Div", const(label_smoothing), classes), smooth),
    )


def _adaptive_pool(name: str, default: Callable) -> Callable:
    dims = int(name[-2])  # adaptive_avg_pool2d -> 2

    def symbolic(g, x, output_size, *rest):
        if compat.ts_rank(x) != dims + 2:
            # Unbatched (or of unknown rank): torch's symbolic pools the last ``rank - 2`` dims
            # (GlobalAveragePool of a [C, D, H, W] input averaged H and W only).
            return _aten_symbolic(name)(g, x, output_size, *rest)
        sizes = compat.ts_constant(output_size, "is")
        if not isinstance(sizes, (list, tuple)) or (name.startswith("adaptive_max") and all(s == 1 for s in sizes)):
            # An output size read off the input (``(None, 3)``): torch's symbolic has no form for it.
            # A max pool to size 1: GlobalMaxPool, which ORT cannot differentiate (nor return indices of).
            return _aten_symbolic(name)(g, x, output_size, *rest)
        t = x.type()
        spatial = t.varyingSizes()[2:] if hasattr(t, "varyingSizes") and t.varyingSizes() else None
        if (
            isinstance(sizes, (list, tuple))
            and any(s != 1 for s in sizes)
            and (spatial is None or any(i is None or o <= 0 or i % o for i, o in zip(spatial, sizes)))
        ):
            # torch's symbolic has no ONNX form for an output size that does not divide the input
            # (it writes an op ORT cannot load): PyTorch's kernel and autograd, as an ATen node.
            return _aten_symbolic(name)(g, x, output_size, *rest)
        if not isinstance(sizes, (list, tuple)) or any(s != 1 for s in sizes):
            reasons = _static_reasons.get()
            if reasons is not None:
                reasons.append(f"{name} with output size {sizes} bakes the traced input size into its kernel")
        return default(g, x, output_size, *rest)

    return symbolic


_ADAPTIVE = [f"aten::adaptive_{kind}_pool{d}d" for kind in ("avg", "max") for d in (1, 2, 3)]


def _unflatten(g, x, dim, sizes):
    """``x.unflatten(dim, sizes)`` as one Reshape whose shape keeps every other dimension symbolic.

    torch's symbolic computes the split position with Add/Mod on the rank and slices the shape with
    it; its shape inference then folds the dimensions before the split to the sizes seen while
    tracing (``nn.MultiheadAttention``'s packed in-projection: ``k.view(k.shape[0], ...)`` became
    ``Reshape(k, [6, ...])``, so a new sequence length failed). Here the dimensions before ``dim``
    are ``0`` (copy) and those after it are read from ``Shape(x)`` one by one."""
    rank = compat.ts_rank(x)
    d = compat.ts_constant(dim, "i")
    if rank is None or not isinstance(d, int):
        raise RuntimeError("ortwrap: unflatten needs a known rank and a constant dim")
    d = d % rank

    def const(values):
        return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))

    parts = [const([0] * d)] if d else []
    known = compat.ts_constant(sizes, "is")
    parts.append(const(list(known)) if isinstance(known, (list, tuple)) else sizes)
    if d + 1 < rank:
        shape = g.op("Shape", x)
        parts += [g.op("Gather", shape, const([i]), axis_i=0) for i in range(d + 1, rank)]
    return g.op("Reshape", x, g.op("Concat", *parts, axis_i=0) if len(parts) > 1 else parts[0])


_TRACED_DTYPES = {"Float": torch.float32, "Half": torch.float16, "BFloat16": torch.bfloat16, "Double": torch.float64}


def _explicit_scale(g, query, scale):
    """The scale (given, or the default ``1/sqrt(E)`` when E is static) as a constant of the
    query's dtype.

    Otherwise the exporter mixes a float32 scale with a bfloat16 query, and its type promotion (or
    the symbolic's own cast of the default scale) writes ``Cast(to=15)``, complex128, for bfloat16:
    the graph does not load under autocast(bfloat16)."""
    traced = next(iter(g.original_node.inputs())).type()
    dtype = _TRACED_DTYPES.get(traced.scalarType()) if hasattr(traced, "scalarType") else None
    if dtype is None:
        return scale
    if compat.ts_is_none(scale):
        sizes = traced.sizes() if hasattr(traced, "sizes") else None
        if not sizes or sizes[-1] is None:
            return scale
        value = 1.0 / math.sqrt(sizes[-1])
    else:
        value = compat.ts_constant(scale, "f")
        if not isinstance(value, float):
            return scale
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def _sdpa(default: Callable) -> Callable:
    """``enable_gqa=True`` (grouped-query attention: fewer key/value heads than query heads, as in
    Llama) is refused by torch's symbolic. Each key/value head is repeated for its group of query
    heads (``repeat_interleave`` on the head dimension, written as Unsqueeze/Expand/Reshape), then
    torch's symbolic runs on the expanded tensors."""

    def symbolic(g, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        scale = _explicit_scale(g, query, scale)
        if not compat.ts_constant(enable_gqa, "b"):
            return default(g, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if compat.ts_rank(query) != 4 or compat.ts_rank(key) != 4:
            raise RuntimeError("ortwrap: scaled_dot_product_attention(enable_gqa=True) needs 4-D (B, H, T, D) inputs")

        def const(values):
            return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))

        def dim(shape, i):
            return g.op("Gather", shape, const([i]), axis_i=0)

        q_heads = dim(g.op("Shape", query), 1)

        def repeat(t):
            shape = g.op("Shape", t)
            batch, heads, length, depth = (dim(shape, i) for i in range(4))
            group = g.op("Div", q_heads, heads)
            expanded = g.op(
                "Expand", g.op("Unsqueeze", t, const([2])), g.op("Concat", batch, heads, group, length, depth, axis_i=0)
            )
            return g.op("Reshape", expanded, g.op("Concat", batch, q_heads, length, depth, axis_i=0))

        return default(g, query, repeat(key), repeat(value), attn_mask, dropout_p, is_causal, scale, False)

    return symbolic


#: a TorchScript value's type kind -> the schema argument type kinds it can fill
_TS_KINDS = {
    "IntType": {"IntType", "NumberType", "SymIntType", "ScalarTypeType", "LayoutType", "MemoryFormatType"},
    "FloatType": {"FloatType", "NumberType"},
    "BoolType": {"BoolType", "NumberType"},
    "ListType": {"ListType"},
    "TensorType": {"TensorType", "NumberType"},
}


def _fits(schema, kinds: list[str]) -> bool:
    """Whether a call whose arguments have these TorchScript type kinds fits ``schema``."""
    arguments = list(schema.arguments)
    if any(a.alias_info is not None and a.alias_info.is_write and a.kwarg_only for a in arguments):
        return False  # an out= overload
    required = sum(not a.has_default_value() for a in arguments)
    if not required <= len(kinds) <= len(arguments):
        return False
    for arg, kind in zip(arguments, kinds):
        want = arg.type.kind()
        if want == "OptionalType":
            if kind == "NoneType":
                continue
            want = arg.type.getElementType().kind()
        accepted = _TS_KINDS.get(kind)
        if accepted is not None and want not in accepted:
            return False
    return True


def _ts_kind(value) -> str:
    """A TorchScript argument's type kind, a constant tensor (the exporter's form of an ``int``,
    ``float`` or ``int[]`` argument by the time symbolics run) read as the Python value it holds."""
    kind = value.type().kind()
    if kind != "TensorType" or value.node().kind() not in ("onnx::Constant", "prim::Constant"):
        return kind
    rank = compat.ts_rank(value)
    if rank == 1:
        return "ListType"
    if rank != 0:
        return kind
    dtype = compat.ts_scalar_type(value)[1]
    return "BoolType" if dtype is torch.bool else "FloatType" if dtype.is_floating_point else "IntType"


def _ts_overload(name: str, node) -> str:
    """The overload of ``aten::<name>`` a TorchScript node calls: its schema's, where the node still
    has one that fits its arguments; else the one its argument kinds fit ("" for ``default``). The
    exporter's passes can leave a node without its schema (``squeeze(x, 1)`` then read as the
    one-argument ``squeeze()``, ``softmax(x, -1)`` as no overload at all)."""
    given = compat.ts_overload_name(node)
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return given
    kinds = [_ts_kind(v) for v in node.inputs()]
    names = [given or "default"] + [o for o in packet.overloads() if o != (given or "default")]
    for overload in names:
        op = getattr(packet, overload, None)
        if op is not None and _fits(compat.op_schema(op), kinds):
            return "" if overload == "default" else overload
    return given


def _aten_symbolic(name: str) -> Callable:
    """Export ``aten::<name>`` as an ATen node running PyTorch's own kernel (``Options.aten_ops``)."""

    def symbolic(g, *args, **kwargs):
        node = g.original_node
        outputs = list(node.outputs())
        result = g.aten_op(name, *args, overload_name=_ts_overload(name, node), outputs=len(outputs))
        results = list(result) if isinstance(result, (list, tuple)) else [result]
        first = compat.ts_sizes(args[0]) if args else None
        for r, o in zip(results, outputs):
            # dtype and rank only: the traced sizes would make every dim static (a new batch size then
            # fails in the backward); type inference through ATen nodes finds the symbolic dims. A
            # size-1 dim the first input has too stays (a later squeeze(dim) of it would be an If).
            t = o.type()
            sizes = t.varyingSizes() if hasattr(t, "varyingSizes") else None
            if sizes is None:
                r.setType(t)
                continue
            same = first is not None and len(first) == len(sizes)
            r.setType(t.with_sizes([1 if same and s == 1 and first[i] == 1 else None for i, s in enumerate(sizes)]))
        return result

    return symbolic


def _softmax_in(default: Callable) -> Callable:
    """``softmax``/``log_softmax`` with ``dtype=``: eager casts the input first, torch's symbolic casts
    the result (the op then runs in the input's dtype: float64 has no SoftmaxGrad on ORT's CPU
    provider). Here the input is cast, then torch's symbolic runs without a dtype."""

    def symbolic(g, input, dim, dtype=None):
        from ..bridge.aten import _SCALAR_TYPES, ONNX_TYPES

        code = None if dtype is None or compat.ts_is_none(dtype) else compat.ts_constant(dtype, "i")
        if isinstance(code, int) and _SCALAR_TYPES.get(code) in ONNX_TYPES:
            input = g.op("Cast", input, to_i=ONNX_TYPES[_SCALAR_TYPES[code]])
            dtype = None
        return default(g, input, dim, dtype)

    return symbolic


#: ONNX ops (as the TorchScript exporter writes them) that keep their first input's axes in place.
_AXIS_PRESERVING = frozenset(
    f"onnx::{op}"
    for op in ("Pad", "AveragePool", "MaxPool", "LpPool", "Mul", "Div", "Add", "Sub", "Pow", "Cast", "Identity")
)


def _constant_one(value, axis: int, depth: int = 12) -> bool:
    """Whether ``axis`` of ``value`` is a size-1 axis the graph itself makes (an ``Unsqueeze`` at that
    axis, or a ``Reshape`` to a shape whose entry there is the constant 1), reached through ops that
    keep axes in place: its size is 1 whatever the inputs, only ONNX shape inference lost it."""
    while depth > 0:
        node = value.node()
        kind = node.kind()
        inputs = list(node.inputs())
        if kind == "onnx::Unsqueeze" and len(inputs) > 1:
            axes = compat.ts_constant(inputs[1], "is")
            rank = compat.ts_rank(value)
            return isinstance(axes, list) and rank is not None and axis in [a % rank for a in axes]
        if kind == "onnx::Reshape" and len(inputs) > 1:
            shape = inputs[1].node()  # the size list (``view(s0, 1, s1, ...)``), as traced or as ONNX
            if shape.kind() not in ("prim::ListConstruct", "onnx::Concat"):
                return False
            parts = list(shape.inputs())
            if len(parts) != compat.ts_rank(value) or axis >= len(parts):
                return False
            piece = parts[axis]
            if piece.node().kind() not in ("prim::Constant", "onnx::Constant"):
                return False
            one = compat.ts_constant(piece, "is" if shape.kind() == "onnx::Concat" else "i")
            return one in ([1], 1)
        if kind not in _AXIS_PRESERVING or not inputs:
            return False
        value, depth = inputs[0], depth - 1
    return False


def _squeeze(default: Callable) -> Callable:
    """``squeeze(dim)`` of a size-1 dim the graph makes but whose size ONNX shape inference lost (an
    ``Unsqueeze`` then a computed ``Pad``: ``F.local_response_norm``): torch's symbolic writes an
    ``If`` (squeeze when the size is 1), which ORT cannot differentiate; ``ortwrap_ops::squeeze_ones``
    runs torch's squeeze as an ATen node instead. Only there (:func:`_constant_one`): a dim that comes
    from the inputs (a batch or a length traced at 1) keeps torch's ``If``, which makes the build
    static-shape or fall back, as eager's squeeze depends on the size. Training graphs only."""

    def symbolic(g, self, dim=None):
        if dim is None or compat.ts_is_none(dim):
            return default(g, self, dim)
        d = compat.ts_constant(dim, "i")
        sizes, out_rank = compat.ts_sizes(self), compat.ts_rank(g.original_node.output())
        if not isinstance(d, int) or sizes is None or out_rank != len(sizes) - 1:
            return default(g, self, dim)
        d %= len(sizes)
        if sizes[d] is not None or not _constant_one(self, d):
            return default(g, self, dim)
        dims = g.op("Constant", value_t=torch.tensor([d], dtype=torch.int64))
        out = g.aten_op("ortwrap_ops::squeeze_ones", self, dims, overload_name="", outputs=1)
        t = g.original_node.output().type()
        out.setType(t.with_sizes([sizes[i] for i in range(len(sizes)) if i != d]))
        return out

    return symbolic


def _multinomial(default: Callable) -> Callable:
    """``multinomial`` of 1-D probabilities: torch's symbolic writes ONNX Multinomial, which takes
    2-D input only. The probabilities get a batch of one, the samples lose it."""

    def symbolic(g, input, num_samples, replacement=False, generator=None):
        if compat.ts_rank(input) != 1:
            return default(g, input, num_samples, replacement, generator)
        axes = g.op("Constant", value_t=torch.tensor([0], dtype=torch.int64))
        out = default(g, g.op("Unsqueeze", input, axes), num_samples, replacement, generator)
        return g.op("Squeeze", out, axes)

    return symbolic


def _unfold(default: Callable) -> Callable:
    """``unfold(dim, size, step)`` with a negative ``dim``: torch's symbolic unsqueezes each window at
    ``dim`` *after* adding the window axis, so ``x.unfold(-1, 4, 2)`` of ``[B, T, 8]`` comes out
    ``[B, T, 4, 3]`` instead of ``[B, T, 3, 4]``: a silently wrong forward. The dim is made
    non-negative first (the rank is known wherever torch's symbolic can export it)."""

    def symbolic(g, input, dimension, size, step):
        d, rank = compat.ts_constant(dimension, "i"), compat.ts_rank(input)
        if isinstance(d, int) and d < 0 and rank is not None:
            dimension = d + rank
        return default(g, input, dimension, size, step)

    return symbolic


def _repeat_interleave(default: Callable) -> Callable:
    """``repeat_interleave`` with a negative ``dim``: torch's symbolic normalizes it in place
    (``dim += rank`` on the tensor its constant node holds), and the trace pools equal constants,
    so every other op reading that ``-1`` (Cohere's RoPE: the ``stack(..., dim=-1)`` of
    ``rotate_half``) read the repeat's normalized dim instead: a wrong Concat axis ("Incompatible
    dimensions" in ORT, "All tensors must have the same rank" in GLM's export). It gets a
    constant node of its own."""

    def symbolic(g, self, repeats, dim=None, output_size=None):
        if dim is not None and not compat.ts_is_none(dim):
            d = compat.ts_constant(dim, "i")
            if isinstance(d, int):
                dim = g.op("Constant", value_t=torch.tensor(d, dtype=torch.int64))
        return default(g, self, repeats, dim, output_size)

    return symbolic


def _feature_dropout(g, input, p, train):
    """``feature_dropout`` (``dropout2d``/``dropout3d``: one draw per channel): torch has no ONNX
    form for it. Here ONNX ``Dropout`` of a ones tensor of shape ``[N, C, 1, ...]`` makes the scaled
    channel mask (``1/(1-p)`` or 0), which multiplies the input: one random draw, which the
    gradient (``Mul``'s, reading the mask) reuses."""
    if not compat.ts_constant(train, "b"):
        return input
    rank = compat.ts_rank(input)
    if rank is None or rank < 2:
        raise RuntimeError("ortwrap: feature_dropout needs an input of known rank >= 2")
    dtype = compat.ts_scalar_type(input)[1]
    sizes = g.op("Slice", g.op("Shape", input), *(g.op("Constant", value_t=torch.tensor([v])) for v in (0, 2)))
    shape = g.op("Concat", sizes, g.op("Constant", value_t=torch.ones(rank - 2, dtype=torch.int64)), axis_i=0)
    ones = g.op("ConstantOfShape", shape, value_t=torch.ones(1, dtype=dtype))
    ratio = g.op("Constant", value_t=torch.tensor(float(compat.ts_constant(p, "f")), dtype=dtype))
    mask, _ = g.op("Dropout", ones, ratio, g.op("Constant", value_t=torch.tensor(True)), outputs=2)
    return g.op("Mul", input, mask)


def _stable_sort(default: Callable) -> Callable:
    """``sort``/``argsort`` with ``stable=``: the ``.stable`` overload's arguments are ``(self, stable,
    dim, descending)``, which torch's symbolic reads as ``(self, dim, descending, out)``: it sorted
    along ``stable`` (dim 1 for True, 0 for False), in the order ``dim`` said (a silently wrong
    result). ONNX TopK keeps equal values in index order, as a stable sort does."""

    def symbolic(g, self, *args):
        if len(args) == 3:
            _stable, dim, descending = args
            return default(g, self, dim, descending)
        return default(g, self, *args)

    return symbolic


def _native_layer_norm(default: Callable) -> Callable:
    """``native_layer_norm``'s mean and inverse standard deviation: PyTorch's autograd gives them no
    gradient (only the normalized output is differentiable), torch's symbolic returns them as plain
    values that ORT's gradient builder differentiates through: an input gradient off by ~0.1 where
    the statistics are read. Each is marked ``ortwrap::StopGradient``."""

    def symbolic(g, *args):
        out, mean, rstd = default(g, *args)
        return out, _detach(g, mean), _detach(g, rstd)

    return symbolic


def _aten_when(name: str, when: Callable | None, default: Callable, floating_only: bool = False) -> Callable:
    """``aten::<name>`` as an ATen node where ``when`` says the ONNX form is wrong (and, with
    ``floating_only``, the first argument is floating); torch's otherwise."""
    aten = _aten_symbolic(name)

    def symbolic(g, *args):
        if floating_only and args and not compat.ts_scalar_type(args[0])[1].is_floating_point:
            return default(g, *args)
        if when is None or when([_ts_argument(a) for a in args]):
            return aten(g, *args)
        return default(g, *args)

    return symbolic


def _ts_argument(value) -> object:
    """A symbolic argument as the Python constant it holds (a number, a string, a list of numbers), or
    None where it is not a constant (a tensor computed by the graph) or is an absent optional."""
    try:
        if compat.ts_is_none(value):
            return None
        node = value.node()
        if node.kind() in ("prim::Constant", "onnx::Constant") and node.hasAttribute("value"):
            if node.kindOf("value") == "s":
                return node.s("value")
        for desc in ("f", "is", "fs"):
            try:
                v = compat.ts_constant(value, desc)
            except Exception:
                continue
            if isinstance(v, (int, float, list, tuple)):
                return v
    except Exception:
        pass
    return None


def _split(default: Callable) -> Callable:
    """``split(x, size)`` (and ``unsafe_split``) along a dimension the export left dynamic: torch's
    symbolic takes the dimension to be ``size * outputs`` and writes ``Split`` with that many equal
    sizes, which ORT rejects where the last chunk is shorter ("Sum of sizes in 'split' ... was 6"
    for 5 rows in chunks of 2). Each chunk is a ``Slice`` instead (the last one to the end)."""

    def symbolic(g, self, split_size_or_sizes, dim, _outputs=None):
        try:
            size, d = compat.ts_constant(split_size_or_sizes, "i"), compat.ts_constant(dim, "i")
        except Exception:  # a list of sizes
            size, d = None, None
        sizes = compat.ts_sizes(self)
        if isinstance(d, int) and d < 0 and sizes is not None:
            d += len(sizes)
        if (
            _outputs is None
            or not isinstance(size, int)
            or not isinstance(d, int)
            or sizes is None
            or sizes[d] is not None
        ):
            return default(g, self, split_size_or_sizes, dim, _outputs)

        def const(v: int):
            return g.op("Constant", value_t=torch.tensor([v], dtype=torch.int64))

        last = torch.iinfo(torch.int64).max
        return [
            g.op("Slice", self, const(i * size), const((i + 1) * size if i + 1 < _outputs else last), const(d))
            for i in range(_outputs)
        ]

    return symbolic


def _permute(default: Callable) -> Callable:
    """``permute`` with negative dims: torch's symbolic writes them into ``Transpose``'s ``perm``,
    which ONNX refuses ("Invalid attribute perm {0, -2, -1, 1}"). They are made non-negative."""

    def symbolic(g, self, dims):
        d, rank = compat.ts_constant(dims, "is"), compat.ts_rank(self)
        if isinstance(d, list) and rank is not None:
            dims = [v + rank if v < 0 else v for v in d]
        return default(g, self, dims)

    return symbolic


def _movedim(default: Callable) -> Callable:
    """``movedim`` with negative dims: torch's symbolic builds the permutation from them as given
    (``perm {-3, 0, -1, -2}``). They are made non-negative."""

    def symbolic(g, self, source, destination):
        rank = compat.ts_rank(self)
        if rank is not None:
            source, destination = (
                torch.as_tensor(compat.ts_constant(v, "v") if not isinstance(v, torch.Tensor) else v)
                for v in (source, destination)
            )
            if isinstance(source, torch.Tensor) and isinstance(destination, torch.Tensor):
                source, destination = source % rank, destination % rank
        return default(g, self, source, destination)

    return symbolic


def _reduce_of_zero_d(default: Callable) -> Callable:
    """``sum``/``mean``/``logsumexp`` of a 0-d tensor over ``dim=0`` or ``-1`` (which torch allows):
    torch's symbolic writes a ``Reduce*`` with that axis, which ONNX refuses on a rank-0 input
    ("axis must be in [-rank, rank-1]. input rank was 0"). Reducing one value is the value."""

    def symbolic(g, self, *args):
        dims = args[0] if len(args) >= 2 else None  # (not the dtype of the overload without dims)
        dtype = args[2] if len(args) > 2 else None
        if (
            compat.ts_rank(self) == 0
            and dims is not None
            and not compat.ts_is_none(dims)
            and (dtype is None or compat.ts_is_none(dtype))
        ):
            return g.op("Identity", self)
        return default(g, self, *args)

    return symbolic


def _stack_by_rank(name: str, default: Callable) -> Callable:
    """``hstack``/``dstack``/``column_stack`` of a list of tensors of known ranks: torch's symbolics
    write a sequence and an ``If`` on the first tensor's rank (hstack), or an ATen node of the list
    (dstack, column_stack), neither of which ORT 1.19.2 can differentiate. The ranks are known:
    each tensor is reshaped as torch does and the list concatenated."""

    def symbolic(g, tensor_list):
        tensors = compat.ts_unpack_list(tensor_list)
        ranks = [compat.ts_rank(t) for t in tensors] if tensors else None
        if not tensors or any(r is None for r in ranks):
            return default(g, tensor_list)

        def unsqueeze(t, axes):
            return g.op("Unsqueeze", t, g.op("Constant", value_t=torch.tensor(axes, dtype=torch.int64)))

        if name == "hstack":
            parts = [unsqueeze(t, [0]) if r == 0 else t for t, r in zip(tensors, ranks)]
            axis = 0 if max(ranks[0], 1) == 1 else 1
        elif name == "dstack":
            axes = {0: [0, 1, 2], 1: [0, 2], 2: [2]}
            parts = [unsqueeze(t, axes[r]) if r < 3 else t for t, r in zip(tensors, ranks)]
            axis = 2
        else:  # column_stack: a 0-d or 1-D tensor becomes a column
            parts = [
                g.op("Reshape", t, g.op("Constant", value_t=torch.tensor([-1, 1], dtype=torch.int64))) if r <= 1 else t
                for t, r in zip(tensors, ranks)
            ]
            axis = 1
        return g.op("Concat", *parts, axis_i=axis)

    return symbolic


@contextlib.contextmanager
def ortwrap_symbolics(opset: int, aten_ops: tuple[str, ...] = (), with_backward: bool = True) -> Iterator[list[str]]:
    """Install ortwrap's symbolics for one export; yields the list that collects static-shape reasons.

    ``with_backward``: the graph will be differentiated (an inference graph keeps torch's ``If``
    for ``squeeze``, which ORT runs)."""
    from ..bridge.symbolic import pythonop_symbolic
    from .grouped_mm import grouped_mm_symbolic

    symbolics: dict[str, Callable] = {
        "aten::embedding": _embedding,
        "aten::detach": _detach,
        "aten::unflatten": _unflatten,
        "aten::cross_entropy_loss": _cross_entropy_loss,
        "prim::PythonOp": pythonop_symbolic,
        "aten::_grouped_mm": grouped_mm_symbolic,
        "aten::feature_dropout": _feature_dropout,
    }
    compat.ts_load_opset_symbolics(opset)
    wrappers = {  # torch's symbolic, wrapped where it is wrong for training (see the module docstring)
        "aten::multinomial": _multinomial,
        "aten::unfold": _unfold,
        "aten::repeat_interleave": _repeat_interleave,
        "aten::native_layer_norm": _native_layer_norm,
        "aten::sort": _stable_sort,
        "aten::argsort": _stable_sort,
        "aten::split": _split,
        "aten::unsafe_split": _split,
        "aten::permute": _permute,
        "aten::movedim": _movedim,
        "aten::sum": _reduce_of_zero_d,
        "aten::mean": _reduce_of_zero_d,
        "aten::logsumexp": _reduce_of_zero_d,
    }
    for name, wrap in wrappers.items():
        default = compat.ts_symbolic(name, opset)
        if default is not None:
            symbolics[name] = wrap(default)
    for name in ("hstack", "dstack", "column_stack"):
        default = compat.ts_symbolic(f"aten::{name}", opset)
        symbolics[f"aten::{name}"] = _stack_by_rank(name, default or _aten_symbolic(name))
    default_squeeze = compat.ts_symbolic("aten::squeeze", opset)
    if default_squeeze is not None and with_backward:
        symbolics["aten::squeeze"] = _squeeze(default_squeeze)
    for name in ("aten::softmax", "aten::log_softmax"):
        default = compat.ts_symbolic(name, opset)
        if default is not None:
            symbolics[name] = _softmax_in(default)
    for entry in ATEN_OPS:  # ops whose ONNX form loses what training needs (ortwrap/registry.py)
        if "torchscript" not in entry.exporters:
            continue
        default = compat.ts_symbolic(f"aten::{entry.aten}", opset)
        if (entry.when is None and not entry.floating_only) or default is None:
            symbolics[f"aten::{entry.aten}"] = _aten_symbolic(entry.aten)
        else:
            symbolics[f"aten::{entry.aten}"] = _aten_when(entry.aten, entry.when, default, entry.floating_only)
    for op in aten_ops:
        symbolics[f"aten::{op}"] = _aten_symbolic(op)
    default_sdpa = compat.ts_symbolic("aten::scaled_dot_product_attention", opset)
    if default_sdpa is not None:
        symbolics["aten::scaled_dot_product_attention"] = _sdpa(default_sdpa)
    for name in _ADAPTIVE:
        default = compat.ts_symbolic(name, opset)
        if default is not None:
            symbolics[name] = _adaptive_pool(name.split("::")[1], default)
    saved: dict[str, Callable | None] = {}
    for name, fn in symbolics.items():
        saved[name] = compat.ts_custom_symbolic(name, opset)
        compat.ts_register(name, opset, fn)
    reasons: list[str] = []
    token = _static_reasons.set(reasons)
    try:
        yield reasons
    finally:
        _static_reasons.reset(token)
        for name, prev in saved.items():
            compat.ts_unregister(name, opset)
            if prev is not None:
                compat.ts_register(name, opset, prev)
