"""bf16 attention on ortwrap's CPU kernel in place of PyTorch's flash attention (``ortwrap_ops::attention*``).

On CPUs with native bf16, ``passes/half_matmul.py`` turns the exporters' decomposed
``scaled_dot_product_attention`` into ``ortwrap_ops::attention`` (PyTorch's CPU flash attention, as
eager autocast runs it), and ``passes/half_values.py`` makes it ``attention_keep_inputs`` where q,
k^T and v arrive in bf16. This pass (CPU training graphs, after those two) replaces each such node
whose mask, if any, is float32 with one ``org.pytorch.aten::ATen`` node of ortwrap's kernel
(``kernels/_cpu.c``, declared in ``ops.KERNELS`` with its gradient):

- ``attention_bthd_bf16(q4, k4, v4, mask, scale) -> (out4, lse)`` where q, k^T and v are bf16
  [B, T, H, D] tensors moved into heads by Transposes and the output's only reader moves it back
  (the dynamo exporter's GPT blocks): the kernel reads and writes that layout, and the Transposes
  (bf16 copies in ORT) and their gradients' copies go;
- else ``attention_bf16(q, k^T, v, mask, scale) -> (out, lse)``; operands the graph keeps in float32
  (``ortwrap_ops::attention``, which rounds them itself: HF GPT-2) get a Cast to bf16 (ORT's rounds
  to nearest even, as PyTorch's), and a float32 result a Cast back.

The kernel computes what flash attention computes, with the same roundings (float32 scores,
softmax and score gradients; P and dS rounded to bf16 for their GEMMs), from whole rows of scores
per block of 128 queries (64 past 256 keys): bf16 GEMMs with float32 results (MKL's, bundled with
PyTorch: AMX on Intel; on other CPUs with AVX512-BF16 ``_cpu.c``'s own, ``kernels.choose_attention_gemm``)
and one vectorized pass per row between them, the keys above a causal mask's
diagonal skipped. GPT-2 small's attention (4 x 12 heads, 256 tokens, causal) takes ~8-10 ms
forward and backward on one thread against ~22 ms for flash attention (``docs/performance.md``,
"bf16 attention"). Like flash attention it keeps only q, k^T, v, the output and the log-sum-exp
for the backward, which recomputes the scores; the flash op's copies of its operands go.

Nothing changes where ``kernels.attention_available()`` is false (no MKL bf16 GEMM in the PyTorch
build and no AVX512-BF16 for the own one): PyTorch's flash attention stays.
"""

from __future__ import annotations

import onnx_ir as ir

from ..graph.names import ATEN_DOMAIN, NATIVE_PREFIX
from ..ops import KERNELS
from .half_matmul import _heads_layout, _shapes_from_source

_BF16, _FLOAT = ir.DataType.BFLOAT16, ir.DataType.FLOAT
#: ortwrap_ops op -> the kernel that takes its place (``Kernel.replaces_ops``)
_REPLACED = {op: k for k in KERNELS for op in k.replaces_ops}
#: the variant reading q, k, v and writing the output in the projections' [B, T, H, D] layout
_HEADS = {k.variant_of: k for k in KERNELS if k.variant_of in {r.name for r in _REPLACED.values()}}


def _operator(node: ir.Node) -> str | None:
    if node.domain != ATEN_DOMAIN or node.op_type != "ATen":
        return None
    attr = node.attributes.get("operator")
    return None if attr is None else attr.as_string()


def _same(a: object, b: object) -> bool:
    """Two dims known equal (the same int, or the same symbolic name)."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a is not None and b is not None and str(a) == str(b)


def _shapes_fit(q: ir.Value, kt: ir.Value, v: ir.Value) -> bool:
    """q [..., T, D], k^T [..., D, S], v [..., S, E] with the same leading dims (no broadcast)."""
    if q.shape is None or kt.shape is None or v.shape is None:
        return False
    qs, ks, vs = list(q.shape), list(kt.shape), list(v.shape)
    if len(qs) < 2 or len(ks) != len(qs) or len(vs) != len(qs):
        return False
    lead = all(_same(a, b) and _same(a, c) for a, b, c in zip(qs[:-2], ks[:-2], vs[:-2]))
    return lead and _same(ks[-2], qs[-1]) and _same(vs[-2], ks[-1])


class NativeAttentionPass(ir.passes.InPlacePass):
    """Replace bf16 ``attention_keep_inputs`` nodes with ortwrap's ``attention_bf16`` kernel.

    ``rewritten`` counts the nodes replaced.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rewritten = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from .. import kernels

        self.rewritten = 0
        graph = model.graph
        candidates = [n for n in graph if _operator(n) in _REPLACED]
        if not candidates or not kernels.attention_available():
            return ir.passes.PassResult(model, modified=False)
        for node in candidates:
            self._replace(graph, node, _REPLACED[_operator(node)].name)
        return ir.passes.PassResult(model, modified=self.rewritten > 0)

    def _replace(self, graph: ir.Graph, node: ir.Node, name: str) -> None:
        q, kt, v, mask, scale = node.inputs[:5]
        out = node.outputs[0]
        if any(x is None or x.dtype not in (_BF16, _FLOAT) for x in (q, kt, v, out)):
            return
        if (mask is not None and mask.dtype != _FLOAT) or not _shapes_fit(q, kt, v):
            return
        if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return
        if out.dtype == _BF16 and self._heads(graph, node, _HEADS[name].name):
            return
        operands = [self._cast(graph, node, x, _BF16) for x in (q, kt, v)]  # (``attention`` rounds them so)
        new = ir.node(
            "ATen",
            [*operands, mask, scale],
            attributes={"operator": NATIVE_PREFIX + name, "overload_name": ""},
            domain=ATEN_DOMAIN,
            num_outputs=2,
            name=f"{node.name}/native",
        )
        graph.insert_before(node, new)
        new.outputs[0].dtype, new.outputs[0].shape = _BF16, out.shape
        new.outputs[1].dtype = _FLOAT  # the log-sum-exp, [..., T]
        result = new.outputs[0]
        if out.dtype == _FLOAT:  # (``attention`` returns its bf16-rounded result widened)
            widen = ir.node("Cast", [result], {"to": int(_FLOAT)}, name=f"{node.name}/native_widen")
            graph.insert_before(node, widen)
            result = widen.outputs[0]
            result.dtype, result.shape = _FLOAT, out.shape
        value_name = out.name
        out.replace_all_uses_with(result, replace_graph_outputs=True)
        out.name = None
        result.name = value_name
        graph.remove(node, safe=True)
        self.rewritten += 1

    def _heads(self, graph: ir.Graph, node: ir.Node, name: str) -> bool:
        """The heads-layout kernel where q, k^T and v are bf16 [B, T, H, D] tensors moved into heads by
        Transposes and the output's only reader moves it back: the kernel reads and writes that layout
        in place, so those copies (and their gradients' copies) go. Whether it was written."""
        q, kt, v, mask, scale = node.inputs[:5]
        heads = _heads_layout(q, kt, v, node.outputs[0])
        if heads is None:
            return False
        q4, k4, v4, out4, moves = heads
        if any(x.dtype != _BF16 for x in (q4, k4, v4, out4)):
            return False
        new = ir.node(
            "ATen",
            [q4, k4, v4, mask, scale],
            attributes={"operator": NATIVE_PREFIX + name, "overload_name": ""},
            domain=ATEN_DOMAIN,
            num_outputs=2,
            name=f"{node.name}/native",
        )
        graph.insert_before(node, new)
        new.outputs[0].dtype, new.outputs[0].shape = _BF16, out4.shape
        new.outputs[1].dtype = _FLOAT  # the log-sum-exp, [B, H, T]
        value_name = out4.name
        out4.replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
        out4.name = None
        new.outputs[0].name = value_name
        for move in moves[1:]:  # the moves' Shape readers (sizes for reshapes and masks) read the sources'
            if move is not None and move.op_type == "Transpose" and move.graph is graph:
                _shapes_from_source(graph, move)
        for dead in (moves[0], node, *moves[1:]):
            if (
                dead is not None
                and dead.graph is graph
                and not any(o.uses() or o.is_graph_output() for o in dead.outputs)
            ):
                graph.remove(dead, safe=True)
        self.rewritten += 1
        return True

    @staticmethod
    def _cast(graph: ir.Graph, before: ir.Node, value: ir.Value, dtype: ir.DataType) -> ir.Value:
        """``value`` in ``dtype``: itself, or a Cast (ORT's, rounding to nearest even, as PyTorch's)."""
        if value.dtype == dtype:
            return value
        cast = ir.node("Cast", [value], {"to": int(dtype)}, name=f"{before.name}/native_{value.name}_bf16")
        graph.insert_before(before, cast)
        cast.outputs[0].dtype, cast.outputs[0].shape = dtype, value.shape
        return cast.outputs[0]
