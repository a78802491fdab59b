"""bfloat16 GEMMs on CPUs with native bfloat16: MatMul/Gemm become PyTorch's bf16 GEMMs (ATen nodes).

ONNX Runtime 1.19.2's CPU provider has no bfloat16 MatMul or Gemm, so ``HalfPrecisionOnCPUPass``
computes a bf16 graph in float32. Where the CPU has bf16 instructions (AVX512-BF16, AMX), PyTorch's
oneDNN bf16 GEMMs run several times faster than float32 ones. This pass, which runs just before
``HalfPrecisionOnCPUPass``, rewrites every MatMul and Gemm whose inputs and output are bfloat16
into an ``org.pytorch.aten::ATen`` node of ortwrap's own ops (``ops/torch_ops.py``):

- ``MatMul(a, Transpose(W, perm=[1, 0]))`` (a ``Linear``; also through a ``Cast`` to bf16 of the
  Transpose, a tied LM head), with the following ``Add`` of a bias when there is one, and
  ``Gemm(A, B, C, transB=1)``: ``ortwrap_ops::linear(a, W, bias)``, no transposed copy of W;
- ``MatMul(Softmax(MatMul(q * c1, k^T * c2) + mask), v)``, the dynamo exporter's decomposed
  ``scaled_dot_product_attention`` (with an ``attn_mask`` the exporters write ``Where(IsNaN(p), 0, p)``
  after the Softmax, zero for rows masked everywhere, as flash attention's output is there), all bf16
  of rank 4: ``ortwrap_ops::attention(q, k^T, v, mask, scale)``, PyTorch's CPU flash attention in bf16 (as eager autocast's SDPA), which keeps no
  T x T tensor for the backward (its scale is SDPA's own ``1/sqrt(head dim)`` when ``c1 * c2`` is
  that up to bf16 rounding);
- any other MatMul of two bf16 tensors of rank >= 2, and ``Gemm(transB=0)`` without a bias:
  ``ortwrap_ops::matmul(a, b)``.

Each op's last input, ``dtypes``, names its compute dtype (bfloat16), its result's dtype and each
float input's (float32 here: ``HalfPrecisionOnCPUPass`` then makes its inputs and first output
float32 like everything else's; ``HalfValuesOnCPUPass``, later, makes those bf16 again where eager
has bf16 values between bf16 ops, ``passes/half_values.py``).
The op casts its inputs to bf16 inside PyTorch (vectorized, faster than ORT's ``Cast``), runs the
bf16 GEMM and returns the result rounded to bf16, as eager autocast's is, widened to float32 for
the elementwise ops, LayerNorm and softmax that follow (ORT kernels, float32). In a training graph
it also returns its bf16 copies of both operands, which only the backward op reads: ORT keeps those
for the backward, as eager autocast keeps its bf16 operands, and can free the float32 ones. (With
``recompute`` "cheap" or "layers" the weight's copy is not returned: its backward casts the weight
again, ``grad/recompute.py``.)

Each op's gradient is one explicit backward op (its declaration's ``gradient``: ``dX = dY W`` and
``dW = dY^T X`` as bf16 GEMMs on the saved copies, the output gradient rounded to bf16 first, as
eager's is), not the ATen bridge's vjp, which would recompute the forward GEMM.

The same pass (``TorchGemmOnCPUPass``) with ``dtype=FLOAT`` (``Options.gemm="torch"``, for CPUs where PyTorch's MKL/oneDNN
float32 GEMMs beat ORT's MLAS: Intel) writes the ``*_f32`` ops on float32 MatMul/Gemm/attention:
no dtype argument, no copies (the backward op reads the forward's inputs); only in graphs without
bfloat16/float16 values (mixed-precision graphs follow ``Options.half_compute``); attention returns only
the output, k and the log-sum-exp, so no T x T probabilities are kept for the backward.

Why not bf16 values in the graph, with ``Cast`` nodes around the GEMM: a bf16 value read by two
nodes (q, k and v projections of one input; ORT's common-subexpression elimination merges the
Casts) gets its gradients summed in bf16, and ORT 1.19.2's CPU ``Sum`` has no bf16 kernel.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ..bridge.aten import ATEN_DOMAIN
from ..ops import Op, op
from ._build import constant_value

_ONNX = ("", "ai.onnx")
_BF16 = ir.DataType.BFLOAT16
_FLOATS = (ir.DataType.FLOAT, ir.DataType.BFLOAT16, ir.DataType.FLOAT16, ir.DataType.DOUBLE)
#: torch's ScalarType code of bfloat16 (``bridge/aten.py`` ``_SCALAR_TYPES``)
_TORCH_BFLOAT16 = 15
_TORCH_FLOAT = 6
#: the ops it writes (their declarations: the dtype argument, outputs and float32 form come from there)
LINEAR, MATMUL, ATTENTION = op("linear"), op("matmul"), op("attention")
#: float32 only: SDPA whose mask is the causal one, as flash attention's ``is_causal``
CAUSAL_ATTENTION = op("attention_causal_f32")
#: float32 only: SDPA on q, k, v and output in the projections' [B, T, H, D] layout
HEADS_ATTENTION = op("attention_bthd_f32")


def _bf16(value: ir.Value | None) -> bool:
    return value is not None and value.dtype == _BF16


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def _producer(value: ir.Value, op_type: str) -> ir.Node | None:
    node = value.producer()
    return node if node is not None and node.op_type == op_type and node.domain in _ONNX else None


def _int_attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else attr.as_int()


def _float_attr(node: ir.Node, name: str, default: float) -> float:
    attr = node.attributes.get(name)
    return default if attr is None else attr.as_float()


class TorchGemmOnCPUPass(ir.passes.InPlacePass):
    """Run the MatMul/Gemm/attention of ``dtype`` as PyTorch's GEMMs (see the module docstring):
    bfloat16 (``Options.half_compute`` native), or float32 (``dtype=FLOAT``, ``Options.gemm="torch"``).

    ``rewritten`` counts the nodes written, by op (``linear``, ``matmul``, ``attention``).
    """

    def __init__(self, with_backward: bool = True, dtype: ir.DataType = _BF16) -> None:
        super().__init__()
        self.with_backward = with_backward
        self.dtype = dtype
        self.rewritten: dict[str, int] = {}
        self._dropped: list[ir.Node] = []

    def _is(self, value: ir.Value | None) -> bool:
        return value is not None and value.dtype == self.dtype

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.rewritten = {"linear": 0, "matmul": 0, "attention": 0}
        graph = model.graph
        if self.dtype != _BF16 and _has_half_values(graph):
            # a mixed-precision graph (autocast, a half model): its GEMMs follow ``half_compute``
            return ir.passes.PassResult(model, modified=False)
        for node in list(graph):
            if node.op_type == "Softmax" and node.domain in _ONNX and node.graph is graph:
                self._attention(graph, node)
        for node in list(graph):
            if node.graph is not graph:  # removed by the attention rewrite
                continue
            if node.domain not in _ONNX or node.op_type not in ("MatMul", "Gemm"):
                continue
            if not (self._is(node.outputs[0]) and all(self._is(v) for v in node.inputs[:2])):
                continue
            if node.op_type == "MatMul":
                self._matmul(graph, node)
            else:
                self._gemm(graph, node)
        # the Transposes (and Casts) of W that the linears read directly
        for node in reversed(list(dict.fromkeys(self._dropped))):
            if not node.outputs[0].uses() and not node.outputs[0].is_graph_output():
                graph.remove(node, safe=True)
        self._dropped = []
        return ir.passes.PassResult(model, modified=any(self.rewritten.values()))

    def _matmul(self, graph: ir.Graph, node: ir.Node) -> None:
        a, b = node.inputs[0], node.inputs[1]
        if _rank(a) is None or _rank(b) is None or _rank(a) < 2 or _rank(b) < 2:
            return  # 1-D operands: left to float32
        weight = self._transposed_weight(graph, node, b)
        if weight is None:
            self._replace(graph, node, MATMUL, [a, b], node.outputs[0])
            return
        out, bias, add = node.outputs[0], None, None
        users = list(out.uses())
        if len(users) == 1 and not out.is_graph_output():
            user = users[0][0]
            if user.op_type == "Add" and user.domain in _ONNX and self._is(user.outputs[0]):
                other = user.inputs[1] if user.inputs[0] is out else user.inputs[0]
                n = b.shape[-1] if b.shape is not None else None
                if self._is(other) and other.shape is not None and len(other.shape) == 1 and other.shape[0] == n:
                    bias, add = other, user
        self._replace(graph, node, LINEAR, [a, weight, bias], out if add is None else add.outputs[0], add)

    def _attention(self, graph: ir.Graph, softmax: ir.Node) -> None:
        """``MatMul(Softmax(MatMul(q * c1, k^T * c2) + mask), v)`` (the dynamo exporter's SDPA), all
        bf16 and of rank 4 -> ``ortwrap_ops::attention(q, k^T, v, mask, scale)``."""
        p = softmax.outputs[0]
        if not self._is(p) or _rank(p) != 4 or _int_attr(softmax, "axis", -1) not in (-1, 3):
            return
        isnan, where = _nan_guard(p)  # (SDPA with a mask: fully masked rows give 0, as flash attention's do)
        probs = p if where is None else where.outputs[0]
        pv = _single_user(probs)
        if pv is None or pv.op_type != "MatMul" or pv.domain not in _ONNX or pv.inputs[0] is not probs:
            return
        v, scores, mask, add = pv.inputs[1], softmax.inputs[0], None, None
        producer = scores.producer()
        if producer is not None and producer.op_type == "Add" and _single_user(scores) is softmax:
            add = producer
            for i in (0, 1):
                mm = add.inputs[i].producer()
                if mm is not None and mm.op_type == "MatMul" and mm.domain in _ONNX:
                    scores, mask = add.inputs[i], add.inputs[1 - i]
                    break
            else:
                return
        qk = scores.producer()
        if qk is None or qk.op_type != "MatMul" or qk.domain not in _ONNX:
            return
        if _single_user(scores) not in (softmax, add):
            return
        if mask is not None and (_rank(mask) not in (2, 3, 4) or not _without_gradient(graph, mask)):
            return  # (a learned bias, T5's relative positions: its gradient goes through the scores)
        (q, c1, mul_q), (kt, c2, mul_k) = _scaled(qk.inputs[0]), _scaled(qk.inputs[1])
        operands = (q, kt, v, pv.outputs[0])
        if not all(self._is(x) and _rank(x) == 4 for x in operands):
            return
        scale = c1 * c2
        head = q.shape[-1]
        if isinstance(head, int) and abs(scale * math.sqrt(head) - 1) < 1e-2:
            scale = 1 / math.sqrt(head)  # SDPA's default scale, split in two half-rounded factors
        b = _Builder(graph, pv, self.with_backward, self.dtype)
        scale_value = b.constant(np.array(scale, dtype=np.float32), "scale")
        causal = _causal_mask(mask, scores) if mask is not None and self.dtype != _BF16 else None
        heads = _heads_layout(q, kt, v, pv.outputs[0]) if self.dtype != _BF16 else None
        if heads is not None:  # q, k, v and the output in the projections' [B, T, H, D]: no Transposes
            q4, k4, v4, out4, _ = heads
            flag = b.constant(np.array(causal is not None), "causal")
            inputs = [q4, k4, v4, None if causal is not None else mask, scale_value, flag]
            node = b.aten(HEADS_ATTENTION, inputs, out4)
            if self.with_backward:
                node.outputs[1].dtype, node.outputs[1].shape = ir.DataType.FLOAT, None  # the log-sum-exp
        elif causal is not None:  # flash attention's own causal mode: it skips the masked blocks
            node = b.aten(CAUSAL_ATTENTION, [q, kt, v, scale_value], pv.outputs[0])
        else:
            node = b.aten(ATTENTION, [q, kt, v, mask, scale_value], pv.outputs[0])
        if heads is None and self.with_backward and self.dtype != _BF16:  # (out, k, lse)
            node.outputs[1].shape = None
            node.outputs[2].dtype, node.outputs[2].shape = ir.DataType.FLOAT, None
        elif heads is None and self.with_backward:  # (out, q, k, v, lse)
            node.outputs[4].dtype, node.outputs[4].shape = ir.DataType.FLOAT, None  # the log-sum-exp
            node.outputs[2].shape = None  # k, not k^T
        moved = heads[4] if heads is not None else []
        for move in moved[1:]:  # the moves' Shape readers (sizes for reshapes and masks) read the sources'
            if move is not None and move.op_type == "Transpose" and move.graph is graph:
                _shapes_from_source(graph, move)
        for dead in (*moved[:1], pv, where, isnan, softmax, add, qk, mul_q, mul_k, *moved[1:], *(causal or ())):
            if dead is not None and not any(o.uses() or o.is_graph_output() for o in dead.outputs):
                graph.remove(dead, safe=True)
        self.rewritten["attention"] += 1

    def _gemm(self, graph: ir.Graph, node: ir.Node) -> None:
        if _int_attr(node, "transA", 0) or _float_attr(node, "alpha", 1.0) != 1.0:
            return
        a, b = node.inputs[0], node.inputs[1]
        c = node.inputs[2] if len(node.inputs) > 2 else None
        if c is not None and (_float_attr(node, "beta", 1.0) != 1.0 or not self._is(c) or _rank(c) != 1):
            return
        if _int_attr(node, "transB", 0):
            self._replace(graph, node, LINEAR, [a, b, c], node.outputs[0])
        elif c is None:
            self._replace(graph, node, MATMUL, [a, b], node.outputs[0])

    def _transposed_weight(self, graph: ir.Graph, node: ir.Node, b: ir.Value) -> ir.Value | None:
        """W where ``b`` is ``W^T`` of a rank-2 W (through a Cast to the pass's dtype), else None."""
        cast = _producer(b, "Cast")
        transpose = _producer(cast.inputs[0] if cast is not None else b, "Transpose")
        if transpose is None or _rank(b) != 2:
            return None
        perm = transpose.attributes.get("perm")
        if perm is None or list(perm.as_ints()) != [1, 0]:
            return None
        self._dropped.append(transpose)
        weight = transpose.inputs[0]
        if cast is None:
            return weight
        self._dropped.append(cast)
        to_bf16 = ir.node("Cast", [weight], {"to": int(self.dtype)}, name=f"{node.name}/ortwrap_weight_cast")
        to_bf16.outputs[0].dtype = self.dtype
        to_bf16.outputs[0].shape = weight.shape
        graph.insert_before(node, to_bf16)
        return to_bf16.outputs[0]

    def _replace(
        self,
        graph: ir.Graph,
        node: ir.Node,
        gemm: Op,
        inputs: list[ir.Value | None],
        out: ir.Value,
        add: ir.Node | None = None,
    ) -> None:
        # (A linear without bias keeps an empty third input: the dtype is its fourth.)
        _Builder(graph, node, self.with_backward, self.dtype).aten(gemm, inputs, out)
        if add is not None:
            graph.remove(add, safe=True)
        graph.remove(node, safe=True)
        self.rewritten["linear" if gemm is LINEAR else "matmul"] += 1


def _has_half_values(graph: ir.Graph) -> bool:
    half = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16)
    values = [*graph.inputs, *graph.initializers.values(), *(o for n in graph for o in n.outputs)]
    return any(v.dtype in half for v in values)


def _single_user(value: ir.Value) -> ir.Node | None:
    users = list(value.uses())
    return users[0][0] if len(users) == 1 and not value.is_graph_output() else None


def _nan_guard(p: ir.Value) -> tuple[ir.Node | None, ir.Node | None]:
    """``(IsNaN, Where)`` where ``p`` (softmax probabilities) is read only by ``Where(IsNaN(p), 0, p)``
    (the dynamo exporter's SDPA with ``attn_mask``: the rows masked everywhere become 0), else Nones."""
    users = {n.op_type: n for n, _ in p.uses()}
    isnan, where = users.get("IsNaN"), users.get("Where")
    if len(users) != 2 or len(list(p.uses())) != 2 or p.is_graph_output() or isnan is None or where is None:
        return None, None
    if isnan.domain not in _ONNX or where.domain not in _ONNX or _single_user(isnan.outputs[0]) is not where:
        return None, None
    zero = constant_value(where.inputs[1])
    if where.inputs[0] is not isnan.outputs[0] or where.inputs[2] is not p or zero is None or zero.size != 1:
        return None, None
    return (isnan, where) if float(zero.reshape(())) == 0.0 else (None, None)


def _causal_mask(mask: ir.Value, scores: ir.Value) -> list[ir.Node] | None:
    """The nodes computing ``mask`` where it is SDPA's ``is_causal`` mask of ``scores`` [..., L, S], as
    both exporters write it: ``Where(Equal(Trilu(Expand(1.0, [L, S]), upper=0), 0.0), -inf, 0.0)`` (dynamo:
    float32's lowest for -inf; top-left
    aligned, as flash attention's causal mode), its shape ``scores``'s last two dims; else None."""
    where = _producer(mask, "Where")
    equal = _producer(where.inputs[0], "Equal") if where is not None else None
    lowest = _const(where.inputs[1]) if equal is not None else None  # -inf, or float32's lowest (dynamo)
    if lowest is None or lowest > np.finfo(np.float32).min or _const(where.inputs[2]) != 0.0:
        return None
    tril_value, zero = equal.inputs
    if _const(zero) != 0.0:
        tril_value, zero = zero, tril_value
    trilu = _producer(tril_value, "Trilu")
    if trilu is None or _const(zero) != 0.0 or _int_attr(trilu, "upper", 1) != 0 or len(trilu.inputs) > 1:
        return None
    expand = _producer(trilu.inputs[0], "Expand")
    if expand is None or _const(expand.inputs[0]) != 1.0:
        return None
    if mask.shape is None or scores.shape is None or len(mask.shape) != 2 or len(scores.shape) < 2:
        return None
    if any(not _same_dim(a, b) for a, b in zip(mask.shape, list(scores.shape)[-2:])):
        return None
    return [where, equal, trilu, expand]


def _heads_layout(
    q: ir.Value, kt: ir.Value, v: ir.Value, out: ir.Value
) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value, list[ir.Node]] | None:
    """``(q4, k4, v4, out4, nodes)`` where q, k^T and v are [B, T, H, D] tensors moved into heads by
    Transposes (k^T: ``Transpose(k4, [0, 2, 3, 1])``, TorchScript, or dynamo's ``Reshape(Transpose(
    Reshape(Transpose(k4, [0, 2, 1, 3]), [BH, T, D]), [0, 2, 1]), [B, H, D, T])``) and the output's
    only reader moves it back (``out4 = Transpose(out, [0, 2, 1, 3])``): flash attention reads the
    strided views and writes that layout, so these copies (and their gradients' copies) go. ``nodes``:
    the output's Transpose first, then the moves that may become dead."""
    q4, v4 = _from_heads(q), _from_heads(v)
    back = _single_user(out)
    if q4 is None or v4 is None or back is None or not _is_transpose(back, [0, 2, 1, 3]):
        return None
    moves = [back, q.producer(), v.producer()]
    transpose = _producer(kt, "Transpose")
    if transpose is not None and _is_transpose(transpose, [0, 2, 3, 1]) and _rank(transpose.inputs[0]) == 4:
        k4 = transpose.inputs[0]
        moves.append(transpose)
    else:  # dynamo: through rank 3
        outer = _producer(kt, "Reshape")
        mid = _producer(outer.inputs[0], "Transpose") if outer is not None else None
        inner = _producer(mid.inputs[0], "Reshape") if mid is not None and _is_transpose(mid, [0, 2, 1]) else None
        k = inner.inputs[0] if inner is not None else None
        k4 = _from_heads(k) if k is not None else None
        if k4 is None or k.shape is None or kt.shape is None or len(k.shape) != 4 or len(kt.shape) != 4:
            return None
        expected = [k.shape[0], k.shape[1], k.shape[3], k.shape[2]]
        if not all(_same_dim(a, b) for a, b in zip(kt.shape, expected)):
            return None
        moves += [outer, mid, inner, k.producer()]
    for x4 in (q4, k4, v4):  # (TorchScript moves k into heads once more, read for its shape only)
        moves += [n for n, _ in x4.uses() if n not in moves and _is_transpose(n, [0, 2, 1, 3])]
    return q4, k4, v4, back.outputs[0], moves


def _shapes_from_source(graph: ir.Graph, transpose: ir.Node) -> None:
    """Every ``Shape(Transpose(x, perm), start, end)`` becomes ``Slice(Gather(Shape(x), perm), start,
    end)``, so that the Transpose, read for its shape only, can go."""
    perm = list(transpose.attributes["perm"].as_ints())
    for user, _ in list(transpose.outputs[0].uses()):
        if user.op_type != "Shape" or user.domain not in _ONNX:
            continue
        name = user.name or "shape"
        indices = ir.node("Constant", [], {"value": ir.tensor(np.array(perm, dtype=np.int64))}, name=f"{name}/perm")
        shape = ir.node("Shape", [transpose.inputs[0]], name=f"{name}/source")
        gather = ir.node("Gather", [shape.outputs[0], indices.outputs[0]], {"axis": 0}, name=f"{name}/permuted")
        new = [indices, shape, gather]
        start, end = _int_attr(user, "start", 0), user.attributes.get("end")
        if start != 0 or end is not None:
            bounds = [start, end.as_int() if end is not None else len(perm)]
            starts, ends = (
                ir.node("Constant", [], {"value": ir.tensor(np.array([b], dtype=np.int64))}, name=f"{name}/{w}")
                for b, w in zip(bounds, ("start", "end"))
            )
            new += [starts, ends, ir.node("Slice", [gather.outputs[0], starts.outputs[0], ends.outputs[0]], name=name)]
        result = new[-1].outputs[0]
        result.dtype, result.shape = ir.DataType.INT64, user.outputs[0].shape
        for n in new:
            graph.insert_before(user, n)
        name, old = user.outputs[0].name, user.outputs[0]
        old.replace_all_uses_with(result, replace_graph_outputs=True)
        old.name, result.name = None, name
        graph.remove(user, safe=True)


def _from_heads(x: ir.Value) -> ir.Value | None:
    """``x4`` where ``x`` is ``Transpose(x4, [0, 2, 1, 3])`` ([B, T, H, D] -> [B, H, T, D]), else None."""
    transpose = _producer(x, "Transpose")
    if transpose is None or not _is_transpose(transpose, [0, 2, 1, 3]) or _rank(transpose.inputs[0]) != 4:
        return None
    return transpose.inputs[0]


def _is_transpose(node: ir.Node, perm: list[int]) -> bool:
    attr = node.attributes.get("perm")
    return node.op_type == "Transpose" and node.domain in _ONNX and attr is not None and list(attr.as_ints()) == perm


def _const(value: ir.Value | None) -> float | None:
    """The float of a one-element constant, else None."""
    c = constant_value(value) if value is not None else None
    return float(c.reshape(())) if c is not None and c.size == 1 else None


def _same_dim(a: object, b: object) -> bool:
    """Whether two dims are the same: equal ints, or symbolic dims of the same name."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return getattr(a, "value", None) is not None and getattr(a, "value", None) == getattr(b, "value", None)


def _without_gradient(graph: ir.Graph, value: ir.Value, limit: int = 256) -> bool:
    """Whether no float graph input reaches ``value`` through float values (a causal or padding
    mask: constants, shapes, integer inputs), so nothing takes a gradient through it; False past
    ``limit`` values."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if id(v) in seen or (v.dtype is not None and v.dtype not in _FLOATS):  # (no gradient through ints)
            continue
        seen.add(id(v))
        if len(seen) > limit:
            return False
        node = v.producer()
        if node is None:
            if v in graph.inputs:
                return False
            continue
        stack.extend(i for i in node.inputs if i is not None)
    return True


def _scaled(value: ir.Value) -> tuple[ir.Value, float, ir.Node | None]:
    """``(x, c, Mul)`` where ``value`` is ``Mul(x, c)`` (read only there) of a scalar constant c (or
    the Sqrt of one), else ``(value, 1.0, None)``."""
    mul = value.producer()
    if mul is not None and mul.op_type == "Mul" and mul.domain in _ONNX and _single_user(value) is not None:
        for i in (0, 1):
            c = constant_value(mul.inputs[1 - i])
            root = _producer(mul.inputs[1 - i], "Sqrt")  # (TorchScript: q * sqrt(scale), k^T * sqrt(scale))
            if c is None and root is not None and (c := constant_value(root.inputs[0])) is not None:
                c = np.sqrt(c)
            if c is not None and c.size == 1:
                return mul.inputs[i], float(c.reshape(())), mul
    return value, 1.0, None


class _Builder:
    """Writes one of ortwrap's ATen GEMM nodes in place of ``node`` (inserted before it)."""

    def __init__(self, graph: ir.Graph, node: ir.Node, with_backward: bool, dtype: ir.DataType = _BF16) -> None:
        self.graph, self.node, self.with_backward, self.dtype = graph, node, with_backward, dtype

    def constant(self, value: np.ndarray, what: str) -> ir.Value:
        const = ir.node("Constant", [], {"value": ir.tensor(value)}, name=f"{self.node.name}/{what}")
        self.graph.insert_before(self.node, const)
        return const.outputs[0]

    def aten(self, gemm: Op, inputs: list[ir.Value | None], out: ir.Value) -> ir.Node:
        """The node computing ``gemm`` on ``inputs`` in bf16 (its last input, ``dtypes``, holds torch's
        ScalarType codes: compute, result, each float input), or its float32 form on the torch-GEMM
        route; its first output replaces ``out``. In a training graph it has the op's outputs: the
        rest are what its backward reads (the operands' bf16 copies first), which ORT keeps for the
        backward instead of casting again."""
        name = out.name
        if self.dtype == _BF16:
            # [compute, result, each float input]: float32 but the compute dtype, as
            # ``HalfPrecisionOnCPUPass`` leaves them (``HalfValuesOnCPUPass`` may make some bf16)
            codes = [_TORCH_BFLOAT16, _TORCH_FLOAT] + [_TORCH_FLOAT] * gemm.dtype_operands
            args = [*inputs, self.constant(np.array(codes, dtype=np.int64), "dtypes")]
        else:  # the float32 ops: no dtype argument; nothing beyond the result in a linear or matmul
            # (the backward reads the inputs)
            gemm, args = op(gemm.float32_form) if gemm.float32_form else gemm, inputs
        n_outputs = gemm.n_outputs
        aten = ir.node(
            "ATen",
            args,
            attributes={"operator": gemm.operator, "overload_name": ""},
            domain=ATEN_DOMAIN,
            num_outputs=n_outputs if self.with_backward else 1,
            name=f"{self.node.name}/ortwrap_{'bf16' if self.dtype == _BF16 else 'torch'}",
        )
        self.graph.insert_before(self.node, aten)
        result = aten.outputs[0]
        result.dtype, result.shape = out.dtype, out.shape
        for i, copy in enumerate(aten.outputs[1:] if self.dtype == _BF16 else ()):
            operand = inputs[i] if i < len(inputs) and inputs[i] is not None else None
            copy.dtype, copy.shape = _BF16, operand.shape if operand is not None else None
            copy.name = f"{name}/ortwrap_saved_{i}"
        out.replace_all_uses_with(result, replace_graph_outputs=True)
        out.name = None
        result.name = name
        return aten
