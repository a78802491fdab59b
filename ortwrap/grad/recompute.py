"""Activation recompute: the backward recomputes forward values instead of keeping them.

ORT's training graph (``builder.build_graph``) is one forward, a ``YieldOp`` and one backward; every
forward value a backward node reads is *stashed*: ORT keeps it in the partial-run state from the
forward to the backward. At training scale those stashed activations are most of the memory a
step needs beyond parameters, gradients and optimizer state.

:func:`recompute_segments` rewrites the built graph so that fewer activations stay stashed:

1. **Checkpoints.** Walking the forward in graph order, a value is a checkpoint when it is the
   only floating-point activation (a value computed from the user inputs' data, not only from
   their shapes) that later forward nodes still read. In a residual network those are the
   residual stream between sublayers: the input of each transformer block and the value after its
   attention's residual add. The forward between two checkpoints is a *segment* (half a
   transformer layer; the embedding and the head are segments too).
2. **Recompute.** Stashed values of a segment that recomputable nodes produce are computed again
   by copies of the segment's forward nodes; the backward reads the copies and the originals are
   freed during the forward. Which ones, by mode:

   * ``"layers"``: every one, from the segment's entry checkpoint, the parameters and the values
     that do not depend on the inputs' data (masks, positions): only checkpoints stay stashed, for
     about one more forward per step.
   * ``"cheap"`` (the default): those that at most :data:`MAX_CHEAP_CHAIN` cheap nodes (no GEMM,
     convolution or windowed pooling; a ``MatMul`` of two activations only with a reduction of at most
     :data:`MAX_CHEAP_REDUCTION`) compute from values that stay stashed anyway; nothing computed
     from the inputs' data is newly stashed (a causal mask built from shapes may be). In a transformer: the attention probabilities ``[B, H, T, T]`` (from the stashed
     scaled ``q`` and ``k^T`` and the mask: one batched matmul and a softmax per layer, about 1% of
     a step's work), the GELU output (from its stashed input) and the LayerNorm outputs and
     statistics (from the stashed residual). Eager PyTorch's flash attention keeps no
     probabilities either.
3. **Order.** ORT 1.19.2 runs a graph in one fixed order, and the forward run stops at the
   ``YieldOp``. The copies of a segment read their entry values through a ``Reshape`` whose shape
   depends on the gradient of the segment's exit checkpoint, so they run in the backward, right
   when that segment's backward starts; one segment's recomputed activations are alive at a time.
   The gradient flowing into each segment also waits for the parameter gradients of the segment
   after it (:func:`_order_backward`). Both modes need both: without the second, the weight
   gradients that read the recomputed values run at the very end of ORT's backward and ``"cheap"``
   held more memory than no recompute at all (docs/performance.md, "Memory").

On the native bf16 route (``passes/half_matmul.py``) both modes also stop stashing the bf16
weight copies of the GEMM ops: their backward casts the weight again (:func:`_recast_weight_copies`).
``"cheap"`` treats ortwrap's GEMM and attention ops (``ortwrap_ops::``, ``ortwrap_cpu::``) as heavy,
and recomputes PyTorch's bf16 GELU (``ortwrap_ops::gelu``) from its stashed input; ``"layers"``
recomputes the bf16 GEMMs as well.

Not recomputed (kept stashed): random ops (dropout), PythonOps and ATen nodes other than
ortwrap's own CPU kernels and ops, nodes with subgraphs, and the values the forward returns. ORT's common
subexpression elimination would merge the copies back into the originals: sessions of recomputed
graphs disable it (``runtime.session``).
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

import onnx

from ..graph.names import ATEN_DOMAIN
from ..ops import HEAVY_OPERATORS, NO_WEIGHT_COPY, OPERATORS, WEIGHT_COPY_INPUT, WEIGHT_COPY_OUTPUT, kernel

__all__ = ["RECOMPUTE_MODES", "RecomputeReport", "recompute_segments", "stashed_values"]

#: Values of ``Options.recompute``.
RECOMPUTE_MODES = ("none", "cheap", "layers")

#: Ops whose work per output element grows with an operand's size (GEMMs, convolutions): never
#: recomputed by ``"cheap"``, except :func:`_cheap_chains`' activation-by-activation ``MatMul``.
_HEAVY = frozenset(
    {
        "Gemm",
        "MatMul",
        "FusedMatMul",
        "FusedGemm",
        "MatMulInteger",
        "QLinearMatMul",
        "Einsum",
        "Conv",
        "ConvTranspose",
        "FusedConv",
        "Attention",
        "MultiHeadAttention",
        "LSTM",
        "GRU",
        "RNN",
        # windowed pooling: ORT's MaxPool with indices takes ~0.1 ms on a UNet's 4x16x40x40 activation,
        # to free an output a quarter of its input's size (and the copy's indices go unread)
        "MaxPool",
        "AveragePool",
        "LpPool",
    }
)
#: ``"cheap"`` recomputes a product of two activations (attention scores, ``q @ k^T``) when its
#: reduction dimension is a known size at most this: that many multiply-adds per element it frees.
MAX_CHEAP_REDUCTION = 128
#: ``"cheap"`` copies at most this many forward nodes to recompute one stashed value.
MAX_CHEAP_CHAIN = 8

#: How ORT's gradient builder names the gradient of value X.
_GRAD_NAME = "{}_grad"

#: Suffix of recomputed values and nodes.
SUFFIX = "/ortwrap_recompute"

_FLOATS = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
)
#: Ops whose output does not depend on their input's data.
_SHAPE_OPS = frozenset({"Shape", "Size"})
#: Random or stateful ops: recomputing them would not give the same values.
_NOT_RECOMPUTABLE = frozenset(
    {
        "BatchNormalization",  # training mode: running statistics, written in place into buffers
        "BatchNormInternal",
        "Dropout",
        "BitmaskDropout",
        "BiasDropout",
        "BitmaskBiasDropout",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Bernoulli",
        "Multinomial",
        "PythonOp",
        "PythonOpGrad",
        "YieldOp",
        "If",
        "Loop",
        "Scan",
    }
)


@dataclass(frozen=True)
class RecomputeReport:
    """What :func:`recompute_segments` did to a built graph.

    Attributes:
        mode: the ``recompute`` option it ran with.
        stashed_before: forward values the backward read before (ORT keeps them from forward to backward).
        stashed_after: the same after the rewrite.
        checkpoints: the values kept as segment boundaries.
        recomputed_values: stashed values the backward now recomputes.
        recomputed_nodes: forward nodes copied into the backward.
    """

    mode: str
    stashed_before: tuple[str, ...] = ()
    stashed_after: tuple[str, ...] = ()
    checkpoints: tuple[str, ...] = ()
    recomputed_values: tuple[str, ...] = ()
    recomputed_nodes: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"recompute={self.mode}: {len(self.stashed_before)} stashed forward values before, "
            f"{len(self.stashed_after)} after; {len(self.checkpoints)} checkpoints, "
            f"{len(self.recomputed_values)} values recomputed by {self.recomputed_nodes} nodes"
        )


_HALF_ELEMS = frozenset({onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16})


def _size(src: str, out: str, name: str, elem: dict[str, int]) -> list[onnx.NodeProto]:
    """``Size(src)``; ``ReduceProd(Shape(src))`` for a bf16/fp16 value (the bf16 values between the
    native route's GEMMs, ``passes/half_values.py``) or one of unknown type: ORT 1.19.2's CPU ``Size``
    has no kernel for half-precision values."""
    kind = elem.get(src)
    if kind is not None and kind not in _HALF_ELEMS:
        return [onnx.helper.make_node("Size", [src], [out], name=name)]
    # a half-precision value, or one whose type the graph does not record (an output gradient)
    return [
        onnx.helper.make_node("Shape", [src], [f"{out}/shape"], name=f"{name}/Shape"),
        onnx.helper.make_node("ReduceProd", [f"{out}/shape"], [out], name=name, keepdims=0),
    ]


def _yield_index(nodes: list[onnx.NodeProto]) -> int | None:
    return next((i for i, n in enumerate(nodes) if n.op_type == "YieldOp"), None)


def stashed_values(model: onnx.ModelProto) -> list[str]:
    """Forward values of a built training graph that its backward reads, in order of first use."""
    nodes = list(model.graph.node)
    yi = _yield_index(nodes)
    if yi is None:
        return []
    forward = {o for n in nodes[:yi] for o in n.output if o}
    seen: dict[str, None] = {}
    for n in nodes[yi + 1 :]:
        for x in n.input:
            if x in forward:
                seen.setdefault(x, None)
    return list(seen)


def _aten_operator(node: onnx.NodeProto) -> str:
    return next((a.s.decode() for a in node.attribute if a.name == "operator"), "")


def _recomputable(node: onnx.NodeProto) -> bool:
    if node.op_type in _NOT_RECOMPUTABLE or any(a.type in (5, 10) for a in node.attribute):  # GRAPH(S)
        return False
    if node.domain == ATEN_DOMAIN:
        # ortwrap's CPU kernels and its own PyTorch ops (``ops/``: deterministic, no state)
        return _aten_operator(node) in OPERATORS
    return node.domain in ("", "ai.onnx", "com.microsoft")


def _heavy(node: onnx.NodeProto) -> bool:
    """A GEMM, convolution or attention: ``"cheap"`` does not recompute it (but see :func:`_cheap_chains`)."""
    if node.domain == ATEN_DOMAIN:
        # ortwrap's GEMMs and attention (PyTorch's on the native bf16 and torch-GEMM routes,
        # ``passes/half_matmul.py``; its bf16 attention kernel): their declarations say ``heavy``
        return _aten_operator(node) in HEAVY_OPERATORS
    return node.op_type in _HEAVY


class _Cycle(AssertionError):
    pass


def _topological(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` sorted so that each follows its producers, otherwise in their given order."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    waiting = [0] * len(nodes)
    users: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        deps = {producer[x] for x in n.input if x in producer and producer[x] != i}
        waiting[i] = len(deps)
        for d in deps:
            users[d].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        raise _Cycle("recompute made the graph cyclic")
    return order


def _order_backward(graph, forward, backward, producer, data, cut_positions, cut_values, segment, user_inputs):
    """Make the backward run segment by segment: the gradient flowing into segment ``s - 1`` (that
    of its exit checkpoint) is read through a ``Reshape`` that waits for the gradients of the
    parameters only segment ``s`` uses.

    NOTE: ORT 1.19.2 orders the graph by a depth-first walk from its outputs; a parameter gradient
    that is not on the path to the first output it walks from (most weight and bias gradients) runs
    at the very end of the backward, keeping the output gradient and stashed input of every layer
    alive until then. Returns the new nodes and ``(node, input index, old, new)`` of each rewiring.
    """
    make = onnx.helper.make_node
    elem = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    outputs = {o.name for o in graph.output}
    users: dict[str, set[int]] = {}
    for i, n in enumerate(forward):
        if any(x in data for x in n.input):
            for x in n.input:
                if x not in producer and x not in user_inputs:
                    users.setdefault(x, set()).add(segment(i))
        else:
            for x in n.input:
                if x not in producer:
                    users.setdefault(x, set()).add(-1)
    own: dict[int, list[str]] = {}
    for p, segs in users.items():
        if len(segs) == 1 and _GRAD_NAME.format(p) in outputs:
            own.setdefault(next(iter(segs)), []).append(_GRAD_NAME.format(p))
    ranks = {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in (*graph.value_info, *graph.input, *graph.output)
        if v.type.tensor_type.HasField("shape")
    }
    nodes: list[onnx.NodeProto] = []
    undo = []
    zero = "ortwrap_order_zero"
    produced = {o for n in backward for o in n.output if o}
    for seg in range(1, len(cut_values) + 1):
        grad = _GRAD_NAME.format(cut_values[seg - 1])
        leaves = own.get(seg, [])
        rank = ranks.get(cut_values[seg - 1])
        if grad not in produced or not leaves or not rank:
            continue
        if not nodes:
            nodes.append(
                make(
                    "Constant",
                    [],
                    [zero],
                    name=zero,
                    value=onnx.helper.make_tensor(zero, onnx.TensorProto.INT64, [], [0]),
                )
            )
        tag = f"ortwrap_order_{seg}"
        total = None
        for k, leaf in enumerate(sorted(leaves)):
            nodes += _size(leaf, f"{tag}/size_{k}", f"{tag}/Size_{k}", elem)
            if total is None:
                total = f"{tag}/size_{k}"
            else:
                nodes.append(make("Add", [total, f"{tag}/size_{k}"], [f"{tag}/sum_{k}"], name=f"{tag}/Add_{k}"))
                total = f"{tag}/sum_{k}"
        gated = f"{grad}/ortwrap_after_segment_{seg}"
        nodes.append(make("Mul", [total, zero], [f"{tag}/zero"], name=f"{tag}/Mul"))
        # NOTE: the shape is all zeros ("keep this dimension"), not Shape(grad) + 0: one node fewer,
        # and no Shape that ORT may fold into a constant where a value's type claims static sizes
        # (how the stale traced sizes downstream of a PythonOp showed up first, before
        # export.torchscript.forget_traced_shapes).
        nodes.append(
            make(
                "Constant",
                [],
                [f"{tag}/keep"],
                name=f"{tag}/Keep",
                value=onnx.helper.make_tensor(f"{tag}/keep", onnx.TensorProto.INT64, [rank], [0] * rank),
            )
        )
        nodes.append(make("Add", [f"{tag}/keep", f"{tag}/zero"], [f"{tag}/gated_shape"], name=f"{tag}/Add"))
        nodes.append(make("Reshape", [grad, f"{tag}/gated_shape"], [gated], name=f"{tag}/Reshape"))
        for n in backward:
            for k, x in enumerate(n.input):
                if x == grad:
                    n.input[k] = gated
                    undo.append((n, k, grad, gated))
    return nodes, undo


def recompute_segments(model: onnx.ModelProto, user_inputs: set[str], mode: str = "layers") -> RecomputeReport:
    """Rewrite the built training graph ``model`` in place (see the module docstring).

    Args:
        model: a forward + ``YieldOp`` + backward graph from ``build_graph``.
        user_inputs: graph inputs that are the user's tensors (not parameters or buffers).
        mode: ``"cheap"`` or ``"layers"`` (``"none"`` leaves the graph alone).

    Returns:
        The :class:`RecomputeReport`.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r} is invalid; allowed: {', '.join(RECOMPUTE_MODES)}")
    graph = model.graph
    nodes = list(graph.node)
    yi = _yield_index(nodes)
    stashed_before = tuple(stashed_values(model))
    if yi is None or mode == "none":
        return RecomputeReport(mode, stashed_before, stashed_before)
    forward, yield_node, backward = nodes[:yi], nodes[yi], nodes[yi + 1 :]
    recast = _recast_weight_copies(graph, forward, backward)
    before = tuple(stashed_values(model)) if recast else stashed_before
    producer: dict[str, int] = {o: i for i, n in enumerate(forward) for o in n.output if o}
    elem = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    value_info = {v.name: v for v in graph.value_info}

    # Values computed from the user inputs' data (not only from their shapes).
    data: set[str] = {i.name for i in graph.input if i.name in user_inputs}
    for n in forward:
        if n.op_type not in _SHAPE_OPS and any(x in data for x in n.input):
            data.update(o for o in n.output if o)
    yielded = set(yield_node.input)

    # Checkpoints: positions after which the only floating-point activation still read is one value.
    last_use: dict[str, int] = {}
    for i, n in enumerate(nodes[: yi + 1]):
        for x in n.input:
            if x in producer and x in data and elem.get(x) in _FLOATS:
                last_use[x] = i
    ends: dict[int, int] = {}
    for i in last_use.values():
        ends[i] = ends.get(i, 0) + 1
    live = 0
    cut_positions: list[int] = []
    cut_values: list[str] = []
    for i, n in enumerate(forward):
        live -= ends.get(i, 0)
        outs = [o for o in n.output if o in last_use and last_use[o] > i]
        live += len(outs)
        if live == 1 and len(outs) == 1 and outs[0] not in yielded:
            cut_positions.append(i)
            cut_values.append(outs[0])
    if not cut_positions:
        return RecomputeReport(
            mode, stashed_before, before, recomputed_values=recast, notes=["no checkpoint found: nothing recomputed"]
        )
    checkpoints = set(cut_values)

    def segment(i: int) -> int:
        return bisect.bisect_left(cut_positions, i)

    order_nodes, undo = _order_backward(
        graph, forward, backward, producer, data, cut_positions, cut_values, segment, user_inputs
    )
    gated_grads = {x: g for _, _, x, g in undo}

    def finish(*extra: list[onnx.NodeProto]) -> list[onnx.NodeProto] | None:
        try:
            return _topological([*forward, yield_node, *order_nodes, *[n for e in extra for n in e], *backward])
        except _Cycle:
            return None

    def ordering_only(report: RecomputeReport) -> RecomputeReport:
        ordered = finish()
        if ordered is None:
            for node, k, x, _ in undo:
                node.input[k] = x
            report.notes.append("backward left in ORT's order (segment order made a cycle)")
            return report
        del graph.node[:]
        graph.node.extend(ordered)
        return report

    def in_chain(x: str, seg: int) -> bool:
        i = producer.get(x)
        return (
            i is not None
            and x in data
            and x not in checkpoints
            and x not in yielded
            and segment(i) == seg
            and _recomputable(forward[i])
        )

    # Which forward nodes each segment copies.
    if mode == "layers":
        chains, recomputed = _layers_chains(before, forward, producer, elem, segment, in_chain)
    else:
        chains, recomputed = _cheap_chains(before, forward, producer, elem, data, segment, in_chain, graph)
    if not recomputed:
        return ordering_only(
            RecomputeReport(
                mode, stashed_before, before, tuple(cut_values), recast, notes=["no stashed value is recomputable"]
            )
        )

    produced_backward = {o for n in backward for o in n.output if o}
    ranks = {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in (*graph.value_info, *graph.input, *graph.output)
        if v.type.tensor_type.HasField("shape")
    }
    # Per segment: forward value -> its recomputed copy.
    renamed_in: dict[int, dict[str, str]] = {
        seg: {o: o + SUFFIX for j in chain for o in forward[j].output if o} for seg, chain in chains.items()
    }
    renamed = {o: r for names in renamed_in.values() for o, r in names.items()}
    notes: list[str] = []
    to_recompute = set(recomputed)
    # Per segment: the first output of each backward node that reads one of its recomputed values.
    seg_of = {x: segment(producer[x]) for x in recomputed}
    readers: dict[int, list[str]] = {}
    for n in backward:
        segs = {seg_of[x] for x in n.input if x in to_recompute}
        out = next((o for o in n.output if o), None)
        for sg in segs:
            if out is not None:
                readers.setdefault(sg, []).append(out)

    def copies(wait_for_readers: bool) -> list[onnx.NodeProto]:
        """The gates and the copied nodes of every segment. With ``wait_for_readers``, a segment's
        copies also wait for every backward node that reads the later segment's copies: ORT 1.19.2's
        order otherwise runs some weight gradients (``X^T dY``) at the very end of the backward,
        keeping every segment's recomputed inputs alive until then."""
        make = onnx.helper.make_node
        zero = "ortwrap_recompute_zero"
        nodes = [
            make(
                "Constant", [], [zero], name=zero, value=onnx.helper.make_tensor(zero, onnx.TensorProto.INT64, [], [0])
            )
        ]
        later: int | None = None
        for seg in sorted(chains, reverse=True):
            chain = sorted(chains[seg])
            # The segment's backward starts when the gradient of its exit checkpoint exists.
            sources = [yield_node.output[0]]
            if seg < len(cut_values):
                grad = _GRAD_NAME.format(cut_values[seg])
                if grad in produced_backward:
                    sources = [gated_grads.get(grad, grad)]
                elif wait_for_readers:
                    notes.append(f"segment {seg}: no gradient named {grad}; recomputed after the YieldOp")
            if wait_for_readers and later is not None:
                sources += readers.get(later, [])
            later = seg
            tag = f"ortwrap_recompute_gate_{seg}"
            total = None
            for k, src in enumerate(sources):
                nodes += _size(src, f"{tag}/size_{k}", f"{tag}/Size_{k}", elem)
                if total is None:
                    total = f"{tag}/size_{k}"
                else:
                    nodes.append(make("Add", [total, f"{tag}/size_{k}"], [f"{tag}/sum_{k}"], name=f"{tag}/Add_{k}"))
                    total = f"{tag}/sum_{k}"
            gate = f"{tag}/zero"
            nodes.append(make("Mul", [total, zero], [gate], name=f"{tag}/Mul"))
            gated: dict[str, str] = {}
            local = renamed_in[seg]
            for j in chain:
                src = forward[j]
                inputs = []
                for x in src.input:
                    if x in local:
                        inputs.append(local[x])
                    elif x in data:  # a kept activation: read once the segment's backward starts
                        if x not in gated:
                            g = f"{x}/ortwrap_gate_{seg}"
                            rank = ranks.get(x)
                            if rank:  # all zeros: keep each dimension (see _order_backward's NOTE)
                                keep = onnx.helper.make_tensor(f"{g}/shape", onnx.TensorProto.INT64, [rank], [0] * rank)
                                nodes.append(make("Constant", [], [f"{g}/shape"], name=f"{g}/Keep", value=keep))
                            else:
                                nodes.append(make("Shape", [x], [f"{g}/shape"], name=f"{g}/Shape"))
                            nodes.append(make("Add", [f"{g}/shape", gate], [f"{g}/gated_shape"], name=f"{g}/Add"))
                            nodes.append(make("Reshape", [x, f"{g}/gated_shape"], [g], name=f"{g}/Reshape"))
                            gated[x] = g
                        inputs.append(gated[x])
                    else:
                        inputs.append(x)
                copy = onnx.NodeProto()
                copy.CopyFrom(src)
                copy.name = (src.name or f"node{j}") + SUFFIX
                del copy.input[:]
                copy.input.extend(inputs)
                del copy.output[:]
                copy.output.extend(local.get(o, o) if o else "" for o in src.output)
                nodes.append(copy)
        return nodes

    for o, r in renamed.items():
        if o in value_info:
            vi = onnx.ValueInfoProto()
            vi.CopyFrom(value_info[o])
            vi.name = r
            graph.value_info.append(vi)
    for n in backward:
        for k, x in enumerate(n.input):
            if x in to_recompute:
                n.input[k] = renamed[x]
    ordered = finish(copies(True))
    if ordered is None:
        notes.append("segments wait only for their gradient (waiting for the later segment's readers made a cycle)")
        ordered = finish(copies(False))
    if ordered is None:
        raise _Cycle("recompute made the graph cyclic")
    del graph.node[:]
    graph.node.extend(ordered)
    after = tuple(stashed_values(model))
    return RecomputeReport(
        mode,
        stashed_before,
        after,
        tuple(cut_values),
        (*recast, *recomputed),
        sum(len(c) for c in chains.values()),
        notes,
    )


#: ortwrap's bf16 GEMM ops (``passes/half_matmul.py``) whose forward returns the bf16 copy of its
#: weight (input 1) for the backward: operator -> the index of that output (``Op.weight_copy_output``).
_WEIGHT_COPY_OUTPUT = WEIGHT_COPY_OUTPUT
#: Their backward ops: operator -> the index of the input that reads the weight copy (they cast
#: what they get there to the compute dtype, ``ops/torch_ops.py``'s ``_linear_bf16_backward``).
_WEIGHT_COPY_INPUT = WEIGHT_COPY_INPUT
#: ortwrap's softmax kernel (attention probabilities, as ONNX ``Softmax``)
_SOFTMAX_KERNEL = kernel("softmax").operator


def _recast_weight_copies(graph, forward, backward) -> tuple[str, ...]:
    """Backward GEMMs of the native bf16 route read their weight itself (a graph input: a
    parameter, which the step keeps anyway) instead of the bf16 copy the forward made, and cast it
    again; the forward op is told not to return the copy (``ops.NO_WEIGHT_COPY`` after its
    ``dtypes``). ORT 1.19.2 keeps an output that nothing reads until the end of the run, so the
    copy has to go, not only its readers: half the parameters' size (174 MiB on GPT-2 small) less
    from the forward to the end of the backward, for one cast of the weights per step more than
    eager autocast (which keeps its cast weights for the backward). Returns the copies (in place)."""
    inputs = {i.name for i in graph.input}
    inits = {i.name: i for i in graph.initializer}
    copies: dict[str, onnx.NodeProto] = {}  # weight copy -> the forward node that returns it
    for n in forward:
        k = _WEIGHT_COPY_OUTPUT.get(_aten_operator(n)) if n.domain == ATEN_DOMAIN else None
        if k is not None and len(n.output) > k and n.output[k] and n.input[1] in inputs and n.input[-1] in inits:
            copies[n.output[k]] = n
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in (*forward, *backward):
        for k, x in enumerate(n.input):
            if x in copies:
                readers.setdefault(x, []).append((n, k))
    recast: list[str] = []
    flagged: dict[str, str] = {}  # dtypes initializer -> the same with NO_WEIGHT_COPY appended
    for copy_name, fwd in copies.items():
        uses = readers.get(copy_name, [])
        if not uses or not all(
            n.domain == ATEN_DOMAIN and _WEIGHT_COPY_INPUT.get(_aten_operator(n)) == k for n, k in uses
        ):
            continue
        for n, k in uses:
            n.input[k] = fwd.input[1]
        dtypes = fwd.input[-1]
        if dtypes not in flagged:
            codes = [*onnx.numpy_helper.to_array(inits[dtypes]).tolist(), NO_WEIGHT_COPY]
            flagged[dtypes] = f"{dtypes}/no_weight_copy"
            graph.initializer.append(
                onnx.helper.make_tensor(flagged[dtypes], onnx.TensorProto.INT64, [len(codes)], codes)
            )
        fwd.input[len(fwd.input) - 1] = flagged[dtypes]
        recast.append(copy_name)
    dropped = set(recast)
    for v in graph.value_info:
        if v.name in dropped:  # now empty: the type stays (ORT needs it for an ATen output), not the shape
            v.type.tensor_type.ClearField("shape")
    return tuple(recast)


def _layers_chains(before, forward, producer, elem, segment, in_chain) -> tuple[dict[int, set[int]], list[str]]:
    """``"layers"``: every recomputable stashed activation, from its segment's entry checkpoint.
    Returns the forward nodes each segment copies and the values they recompute."""
    chains: dict[int, set[int]] = {}
    recomputed: list[str] = []
    for x in before:
        i = producer[x]
        seg = segment(i)
        # Only floating-point activations: by the choice of checkpoints, only the backward of
        # their own segment reads them (an integer value, the targets say, may cross segments).
        if elem.get(x) not in _FLOATS or not in_chain(x, seg):
            continue
        recomputed.append(x)
        chain = chains.setdefault(seg, set())
        stack = [i]
        while stack:
            j = stack.pop()
            if j in chain:
                continue
            chain.add(j)
            stack.extend(producer[u] for u in forward[j].input if in_chain(u, seg))
    return chains, recomputed


def _reduction_size(graph: onnx.GraphProto, name: str) -> int | None:
    """The last dimension of value ``name`` when the graph knows it as a number."""
    for v in (*graph.value_info, *graph.input, *graph.output):
        if v.name == name and v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            dims = v.type.tensor_type.shape.dim
            return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None
    return None


def _cheap_chains(
    before, forward, producer, elem, data, segment, in_chain, graph
) -> tuple[dict[int, set[int]], list[str]]:
    """``"cheap"``: a stashed activation is recomputed when at most :data:`MAX_CHEAP_CHAIN` cheap
    forward nodes compute it from values the backward keeps anyway (other stashed values, which
    stay stashed, and values that do not depend on the inputs' data). Cheap: every op but GEMMs
    and convolutions (:data:`_HEAVY`), and a ``MatMul`` of two activations whose reduction
    dimension is at most :data:`MAX_CHEAP_REDUCTION` (attention scores, ``q @ k^T``). So no new
    activation is stashed, and the backward does a few elementwise passes and one batched matmul per
    attention more. In a transformer: the attention probabilities (from the stashed scaled ``q``
    and ``k^T`` and the mask), the GELU output (from its stashed input), the LayerNorm outputs
    (from the stashed residual)."""

    def is_softmax(n: onnx.NodeProto) -> bool:
        return n.op_type == "Softmax" or (n.domain == ATEN_DOMAIN and _aten_operator(n) == _SOFTMAX_KERNEL)

    def cheap(j: int, scores: bool) -> bool:
        """``scores``: node ``j`` feeds a softmax through the chain (attention scores)."""
        n = forward[j]
        if not _heavy(n):
            return True
        if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or not all(x in data for x in n.input):
            return False
        k = _reduction_size(graph, n.input[0])
        # The TorchScript exporter's graphs often lose the head dimension: the scores of a softmax
        # are then taken as a head-sized reduction (the product after a softmax, ``p @ v``, is not).
        return (k is None and scores) or (k is not None and 0 < k <= MAX_CHEAP_REDUCTION)

    stashed = set(before)
    chains: dict[int, set[int]] = {}
    recomputed: list[str] = []
    dropped: set[str] = set()
    pinned: set[str] = set()  # leaves of accepted chains: they stay stashed
    for x in before:
        i = producer.get(x)
        if i is None or x in pinned or elem.get(x) not in _FLOATS or not in_chain(x, segment(i)):
            continue
        seg = segment(i)
        chain: set[int] = set()
        leaves: set[str] = set()
        stack = [(i, False)]
        ok = True
        while stack and ok:
            j, scores = stack.pop()
            if j in chain:
                continue
            if not cheap(j, scores) or len(chain) >= MAX_CHEAP_CHAIN:
                ok = False
                break
            chain.add(j)
            scores = scores or is_softmax(forward[j])
            for u in forward[j].input:
                if not u or u not in data:
                    continue
                if u in stashed and u not in dropped:
                    leaves.add(u)
                elif in_chain(u, seg):
                    stack.append((producer[u], scores))
                else:
                    ok = False
                    break
        if not ok:
            continue
        dropped.add(x)
        pinned |= leaves
        chains.setdefault(seg, set()).update(chain)
        recomputed.append(x)
    return chains, recomputed
