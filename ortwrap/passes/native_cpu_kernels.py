"""Run the erf GELU, LayerNorm, cross-entropy and embedding lookups on ortwrap's CPU kernels (``ortwrap.kernels``).

Rewrites, float32 only, each into one ``org.pytorch.aten::ATen`` node (``operator="ortwrap_cpu::*"``)
whose gradient definition pairs it with its backward kernel:

* ``0.5 * x * (1 + Erf(x * 1/sqrt(2)))`` (both exporters' ``F.gelu``; also with ``Div(x,
  sqrt(2))``, the form before ``UnfuseErfGeluPass``), the 0.5 on either side -> ``gelu(x)``. The
  intermediate values must have no other consumer.
* The tanh GELU, ``0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))`` (``F.gelu(x,
  approximate="tanh")`` from either exporter, transformers' ``gelu_new`` with ``Pow``), the 0.5
  on either side -> ``gelu_tanh(x)``.
* ``LayerNormalization(X, Scale, B)`` with all three outputs (``RestoreOptionalOutputsPass`` adds
  them), a bias and ``stash_type=1`` -> ``layer_norm(X, Scale, B, epsilon, axis)``: the same three
  outputs, mean and inverse standard deviation in the same shapes.
* ``SoftmaxCrossEntropyLoss(scores, labels)`` on 2-D float scores without class weights, whose
  ``log_prob`` output nothing else reads -> ``cross_entropy(scores, labels, ignore_index,
  reduction)``, same two outputs.
* ``Softmax`` over the last dimension (opset 13 and later; float) -> ``softmax(x)``.
* ``Gather(table, indices, axis=0)`` with a graph-input table (a parameter) and int64 indices not
  produced by ``Range`` (ORT makes those a ``Slice``) -> ``embedding(table, indices)``; negative
  indices count from the end, as in ``Gather``.

Values keep their inferred types and shapes. Where inference left an input's type unknown (after
an op ONNX cannot infer), the op's type constraint gives it: ``Mul``'s and ``LayerNormalization``'s
inputs share one type with the constant or the scale. CPU training graphs only: ORT's CUDA kernels for
these ops are fast, and an inference graph gets ORT's own fusions.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ..bridge.aten import ATEN_DOMAIN, NATIVE_PREFIX
from ..ops import KERNELS, kernel
from ._build import NodeBuilder, constant_value
from .gather_to_gathernd import parameter_lookup

_ONNX = ("", "ai.onnx")


def _scalar(value: ir.Value | None) -> float | None:
    v = constant_value(value)
    if v is None or v.size != 1 or v.dtype.kind != "f":
        return None
    return float(v.reshape(-1)[0])


def _half_rounded(value: float) -> tuple[float, float]:
    """``value`` rounded to bfloat16 (to nearest even) and to float16."""
    bits = int(np.array(value, dtype=np.float32).view(np.uint32))
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return float(np.array(bits, dtype=np.uint32).view(np.float32)), float(np.float16(value))


def _is_constant(k: float | None, want: float, tol: float) -> bool:
    """``k`` is ``want``, or ``want`` rounded to half precision: a graph exported under autocast, or
    from a bf16/fp16 model, holds its GELU's constants in half precision, and
    ``HalfPrecisionOnCPUPass`` makes them float32 as they are (eager's GELU kernel computes with
    the exact constants, as ortwrap's does)."""
    return k is not None and (abs(k - want) < tol or k in _half_rounded(want))


def _const_dtype(value: ir.Value | None) -> ir.DataType | None:
    v = constant_value(value)
    return None if v is None else ir.DataType.from_numpy(v.dtype)


def _const_operand(node: ir.Node) -> tuple[ir.Value | None, float | None]:
    """For a two-input node with one scalar-constant input: (the other input, the constant)."""
    a, b = node.inputs
    for value, const in ((a, b), (b, a)):
        k = _scalar(const)
        if k is not None and _scalar(value) is None:
            return value, k
    return None, None


def _cube_of(value: ir.Value | None, x: ir.Value | None) -> list[ir.Node] | None:
    """The nodes computing ``value = x ** 3`` (``Pow(x, 3)`` or ``x * (x * x)``), consumers first;
    None if it is not that or an intermediate has another consumer."""
    node = value.producer() if value is not None else None
    if node is None or _only_use(value) is None or x is None:
        return None
    if node.op_type == "Pow" and node.domain in _ONNX and node.inputs[0] is x:
        e = constant_value(node.inputs[1])
        return [node] if e is not None and e.size == 1 and float(e.reshape(-1)[0]) == 3.0 else None
    if not _is(node, "Mul") or x not in node.inputs:
        return None
    sq = _other(node, x)
    sq_node = sq.producer() if sq is not None else None
    if sq is x or not _is(sq_node, "Mul") or list(sq_node.inputs) != [x, x] or _only_use(sq) is not node:
        return None
    return [node, sq_node]


def _only_use(value: ir.Value) -> ir.Node | None:
    """The single consumer of ``value`` (None if it has several, or is a graph output)."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    return uses[0][0]


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The other input of a two-input node that takes ``value``."""
    a, b = node.inputs
    return b if a is value else a


def _is(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in _ONNX and len(node.inputs) == 2


_OUTPUT_TYPES = {
    "f": ir.DataType.FLOAT,
    "h": ir.DataType.BFLOAT16,
    "F": ir.DataType.FLOAT,
    "i": ir.DataType.INT64,
    "I": ir.DataType.INT64,
}


def _aten(b: NodeBuilder, name: str, inputs: list[ir.Value | None], outputs: int) -> ir.Node:
    declared = kernel(name)
    if outputs != len(declared.outputs) or len(inputs) != len(declared.inputs):
        raise AssertionError(f"ortwrap_cpu::{name} is declared as {declared.signature!r}")
    node = b.node("ATen", inputs, domain=ATEN_DOMAIN, outputs=outputs, operator=NATIVE_PREFIX + name, overload_name="")
    for v, t in zip(node.outputs, declared.outputs):  # ORT cannot infer the outputs of ATen nodes
        v.dtype = _OUTPUT_TYPES[t]
    return node


class NativeCPUKernelsPass(ir.passes.InPlacePass):
    """Replace erf GELUs, LayerNormalizations, cross-entropies and parameter lookups with ortwrap's CPU kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.rewritten: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.rewritten = {k.name: 0 for k in KERNELS if k.gradient is not None and k.replaces}  # per rewrite
        for node in list(graph):
            if node.graph is None or node.domain not in _ONNX:
                continue  # removed by an earlier rewrite
            for method in _REWRITES.get(node.op_type, ()):
                if node.graph is None:
                    break
                getattr(self, method)(graph, node)
        return ir.passes.PassResult(model, modified=any(self.rewritten.values()))

    def _gelu(self, graph: ir.Graph, erf: ir.Node) -> None:
        scale = erf.inputs[0].producer()
        if not (_is(scale, "Mul") or _is(scale, "Div")) or _only_use(scale.outputs[0]) is not erf:
            return
        for x, c in ((scale.inputs[0], scale.inputs[1]), (scale.inputs[1], scale.inputs[0])):
            k = _scalar(c)
            want = 1 / math.sqrt(2) if scale.op_type == "Mul" else math.sqrt(2)
            if _is_constant(k, want, 1e-6) and (scale.op_type == "Mul" or x is scale.inputs[0]):
                break
        else:
            return
        # Mul and Div take one type T: x has the constant's type when inference left it unknown.
        if x is None or (x.dtype or _const_dtype(c)) != ir.DataType.FLOAT:
            return
        self._gelu_tail(graph, "gelu", x, erf, [scale])

    def _gelu_tanh(self, graph: ir.Graph, tanh: ir.Node) -> None:
        # u = sqrt(2/pi) * (x + 0.044715 * cube(x)), cube = Pow(x, 3) | x * (x * x)
        scale = tanh.inputs[0].producer()
        if not _is(scale, "Mul") or _only_use(scale.outputs[0]) is not tanh:
            return
        s, beta = _const_operand(scale)
        if s is None or not _is_constant(beta, math.sqrt(2 / math.pi), 1e-6):
            return
        add = s.producer()
        if not _is(add, "Add") or _only_use(s) is not scale:
            return
        for x, k in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            kmul = k.producer() if k is not None else None
            if not _is(kmul, "Mul") or _only_use(k) is not add:
                continue
            cube, kappa = _const_operand(kmul)
            if cube is None or not _is_constant(kappa, 0.044715, 1e-7):
                continue
            cube_nodes = _cube_of(cube, x)
            if cube_nodes is not None:
                break
        else:
            return
        if (
            x is None
            or (x.dtype or _const_dtype(scale.inputs[0]) or _const_dtype(scale.inputs[1])) != ir.DataType.FLOAT
        ):
            return
        self._gelu_tail(graph, "gelu_tanh", x, tanh, [scale, add, kmul, *cube_nodes])

    def _gelu_tail(self, graph: ir.Graph, kernel: str, x: ir.Value, core: ir.Node, inner: list[ir.Node]) -> None:
        """Both GELUs end ``0.5 * (x * (1 + core))`` or ``(0.5 * x) * (1 + core)``, operands in any
        order (``core``: the Erf or Tanh node; ``inner``: the nodes before it, consumers first). If
        this one does, replace it all with ``kernel(x)``."""
        one = _only_use(core.outputs[0])
        if not _is(one, "Add") or _scalar(_other(one, core.outputs[0])) != 1.0:
            return
        mul = _only_use(one.outputs[0])
        if not _is(mul, "Mul"):
            return
        other = _other(mul, one.outputs[0])
        if other is x:
            final = _only_use(mul.outputs[0])
            if not _is(final, "Mul") or _scalar(_other(final, mul.outputs[0])) != 0.5:
                return
            dead = [mul]
        else:
            half_x = other.producer() if other is not None else None
            if not _is(half_x, "Mul") or _only_use(other) is not mul:
                return
            hx, half = _const_operand(half_x)
            if hx is not x or half != 0.5:
                return
            final, dead = mul, [half_x]
        b = NodeBuilder(final.name or f"{kernel}_{id(final):x}")
        gelu = _aten(b, kernel, [x], 1)
        b.replace(graph, final, list(gelu.outputs))
        for node in (*dead, one, core, *inner):
            graph.remove(node, safe=True)
        self.rewritten[kernel] += 1

    def _layer_norm(self, graph: ir.Graph, node: ir.Node) -> None:
        if len(node.inputs) != 3 or len(node.outputs) != 3 or any(v is None for v in node.inputs):
            return
        # X, Scale and B share one type T: X has the scale's when inference left it unknown.
        if any((v.dtype or node.inputs[1].dtype) != ir.DataType.FLOAT for v in node.inputs):
            return
        stash = node.attributes.get("stash_type")
        if stash is not None and stash.as_int() != 1:
            return
        axis = node.attributes.get("axis")
        eps = node.attributes.get("epsilon")
        b = NodeBuilder(node.name or f"layer_norm_{id(node):x}")
        eps_value = b.const(np.array(eps.as_float() if eps is not None else 1e-5, dtype=np.float32))
        axis_value = b.const(np.array(axis.as_int() if axis is not None else -1, dtype=np.int64))
        ln = _aten(b, "layer_norm", [*node.inputs, eps_value, axis_value], 3)
        x = node.inputs[0]
        for stat in ln.outputs[1:]:  # mean and rstd: shape[:axis] + 1s
            if x.shape is not None:
                k = axis.as_int() if axis is not None else -1
                k = k + len(x.shape) if k < 0 else k
                stat.shape = ir.Shape([d if i < k else 1 for i, d in enumerate(x.shape)])
        b.replace(graph, node, list(ln.outputs))
        self.rewritten["layer_norm"] += 1

    def _embedding(self, graph: ir.Graph, node: ir.Node) -> None:
        lookup = parameter_lookup(node, {ir.DataType.FLOAT})
        if lookup is None:
            return
        table, indices = lookup
        b = NodeBuilder(node.name or f"embedding_{id(node):x}")
        lookup = _aten(b, "embedding", [table, indices], 1)
        if table.shape is not None and indices.shape is not None:
            lookup.outputs[0].shape = ir.Shape([*indices.shape, *table.shape[1:]])
        b.replace(graph, node, list(lookup.outputs))
        self.rewritten["embedding"] += 1

    def _cross_entropy(self, graph: ir.Graph, node: ir.Node) -> None:
        if len(node.inputs) != 2 or len(node.outputs) != 2:
            return  # class weights: ORT's kernel
        scores, labels = node.inputs
        if scores is None or labels is None or scores.dtype != ir.DataType.FLOAT or labels.dtype != ir.DataType.INT64:
            return
        if scores.shape is None or len(scores.shape) != 2:
            return
        log_prob = node.outputs[1]
        if log_prob.uses() or log_prob.is_graph_output():
            return  # the backward kernel takes no log_prob gradient
        reduction = node.attributes.get("reduction")
        mode = {"none": 0, "mean": 1, "sum": 2}.get(reduction.as_string() if reduction is not None else "mean")
        if mode is None:
            return
        ignore = node.attributes.get("ignore_index")
        b = NodeBuilder(node.name or f"cross_entropy_{id(node):x}")
        ignore_value = b.const(np.array(ignore.as_int() if ignore is not None else np.iinfo(np.int64).min))
        mode_value = b.const(np.array(mode, dtype=np.int64))
        ce = _aten(b, "cross_entropy", [scores, labels, ignore_value, mode_value], 2)
        ce.outputs[1].shape = scores.shape
        b.replace(graph, node, list(ce.outputs))
        self.rewritten["cross_entropy"] += 1

    def _softmax(self, graph: ir.Graph, node: ir.Node) -> None:
        x = node.inputs[0]
        if x is None or x.dtype != ir.DataType.FLOAT or x.shape is None or len(x.shape) == 0:
            return
        axis = node.attributes.get("axis")
        k = axis.as_int() if axis is not None else -1
        opset = node.version or graph.opset_imports.get("", 13)
        if opset < 13 and len(x.shape) > 1:
            return  # before opset 13, Softmax flattens from axis: not a last-dimension softmax
        if k not in (-1, len(x.shape) - 1):
            return
        b = NodeBuilder(node.name or f"softmax_{id(node):x}")
        sm = _aten(b, "softmax", [x], 1)
        b.replace(graph, node, list(sm.outputs))
        self.rewritten["softmax"] += 1


#: ONNX op type -> the rewrites that start there (``Kernel.replaces``, ``Kernel.rewrite``).
_REWRITES: dict[str, tuple[str, ...]] = {}
for _k in KERNELS:
    for _op in _k.replaces:
        _REWRITES[_op] = (*_REWRITES.get(_op, ()), _k.rewrite)
