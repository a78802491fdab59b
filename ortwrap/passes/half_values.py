"""bfloat16 values between PyTorch's bf16 ops: no widening and narrowing around every GEMM.

After ``TorchGemmOnCPUPass`` and ``HalfPrecisionOnCPUPass``, every value of a bf16 graph is
float32 and each of ortwrap's bf16 GEMMs (``ortwrap_ops::linear``/``matmul``/``attention``) widens
its result to float32 and narrows its inputs again: the head reshapes between a projection and
attention, and GELU between the two MLP projections, run on float32 copies of bf16 numbers. Eager
autocast keeps those values in bf16. This pass (CPU graphs, before the gradient build) gives the
graph eager's dtypes back on such chains:

- a GEMM's result is bf16-exact (rounded to bf16, then widened); it becomes bf16 where every node
  that reads it can take bf16: another GEMM (which narrows its inputs anyway), the layout ops that
  ORT runs on any dtype (``Reshape``, ``Transpose``, ``Split``, ``Squeeze``, ``Unsqueeze``,
  ``Identity``, ``Flatten``, ``Concat``: their results are bf16 too, under the same condition), or
  ``Shape``;
- ortwrap's GELU kernel (float32) on such a value, whose result only GEMMs read (through layout
  ops), becomes PyTorch's bf16 GELU (``ortwrap_ops::gelu``, as eager's), with
  ``aten::gelu_backward`` as its gradient;
- ortwrap's LayerNorm kernel whose result only GEMMs read becomes ``layer_norm_bf16``: the same
  float32 computation, its result written rounded to bf16 (the GEMM rounded it so before), and
  its backward reads the incoming gradient in bf16 (``ops.KERNELS``);
- each GEMM's ``dtypes`` argument then names the dtypes of its result and inputs, so that it
  returns its result in bf16 where the graph keeps it, and its backward each input's gradient in
  that input's dtype; a linear whose x (an attention whose q, k^T, v) is now bf16 becomes the
  variant whose backward reads that input itself (``linear_keep_input``, ``attention_keep_inputs``)
  instead of a bf16 copy, which would be the input and which the ATen bridge would copy.

Numerics are unchanged: a bf16-exact value is stored exactly in bf16, the GEMMs narrowed their
inputs to bf16 before, and gradients flow through the same roundings (a GEMM's backward rounds its
incoming gradient to bf16 first). Only GELU's result is rounded where the next GEMM rounded it
before, with PyTorch's kernel in place of ortwrap's (eager's own).

A value read by two nodes that take its gradient stays float32: ORT would sum its gradients in
bf16, and ORT 1.19.2's CPU ``Sum`` has no bf16 kernel.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..bridge.aten import ATEN_DOMAIN
from ..ops import DTYPE_ARGUMENT_OPS, DTYPE_OPERANDS, KERNELS, kernel, op

_ONNX = ("", "ai.onnx")
_BF16 = ir.DataType.BFLOAT16
#: torch's ScalarType code of bfloat16 (``bridge/aten.py`` ``_SCALAR_TYPES``)
_TORCH_BFLOAT16 = 15
#: layout ops ORT 1.19.2 runs (and differentiates) on any dtype -> their data inputs (None: all)
_LAYOUT = {
    "Reshape": (0,),
    "Transpose": (0,),
    "Split": (0,),
    "Squeeze": (0,),
    "Unsqueeze": (0,),
    "Identity": (0,),
    "Flatten": (0,),
    "Concat": None,
}
#: GEMM op -> how many of its first inputs are float operands (the rest: mask, scale, dtypes)
_OPERANDS = DTYPE_OPERANDS
#: ortwrap's float32 GELU kernels -> ``ortwrap_ops::gelu``'s ``approximate`` (0: erf, 1: tanh)
_GELU = {kernel("gelu").operator: 0, kernel("gelu_tanh").operator: 1}
_BF16_GELU = op("gelu").operator
#: ortwrap's LayerNorm kernel, and its variant whose y is bf16
_LAYER_NORM = kernel("layer_norm").operator
(_LAYER_NORM_BF16,) = (k.operator for k in KERNELS if k.variant_of == "layer_norm" and "bfloat16" in k.dtypes)
_LINEAR, _ATTENTION = op("linear").operator, op("attention").operator
#: the variants whose backward reads input x (q, k^T and v) itself, and that returning the result in both dtypes
_LINEAR_KEEP_INPUT, _ATTENTION_KEEP_INPUTS = op("linear_keep_input"), op("attention_keep_inputs")
_LINEAR_KEEP_INPUT_HALF = op("linear_keep_input_half")


def _operator(node: ir.Node) -> str | None:
    if node.domain != ATEN_DOMAIN or node.op_type != "ATen":
        return None
    attr = node.attributes.get("operator")
    return None if attr is None else attr.as_string()


def _gemm(node: ir.Node) -> bool:
    return _operator(node) in DTYPE_ARGUMENT_OPS


def _layout_inputs(node: ir.Node) -> list[ir.Value] | None:
    """The data inputs of a layout op (``_LAYOUT``), else None."""
    if node.domain not in _ONNX or node.op_type not in _LAYOUT:
        return None
    positions = _LAYOUT[node.op_type]
    inputs = list(node.inputs) if positions is None else [node.inputs[i] for i in positions if i < len(node.inputs)]
    return [v for v in inputs if v is not None]


class HalfValuesOnCPUPass(ir.passes.InPlacePass):
    """Keep bf16 the values between ortwrap's bf16 GEMMs (see the module docstring).

    ``narrowed`` counts the values made bf16, ``gelus`` the GELUs moved to PyTorch's bf16 kernel,
    ``layer_norms`` the LayerNorms whose result is written in bf16, ``casts`` the Casts to bf16
    of values now bf16 (removed), ``half_results`` the linears that return their float32 result in
    bf16 too, in place of a ``Cast``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.narrowed = self.gelus = self.layer_norms = self.half_results = self.casts = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.narrowed = self.gelus = self.layer_norms = self.half_results = self.casts = 0
        graph = model.graph
        if not any(_gemm(n) for n in graph):
            return ir.passes.PassResult(model, modified=False)
        exact = self._candidates(graph)
        keep = self._valid(graph, exact)
        if not keep:
            return ir.passes.PassResult(model, modified=False)
        for value in keep:
            value.dtype = _BF16
        self.narrowed = len(keep)
        for node in list(graph):
            if _gemm(node):
                self._retype(graph, node, keep)
                self._keep_inputs(graph, node, keep)
        for node in list(graph):
            if _narrowing_cast(node) and node.inputs[0] in keep:  # bf16 already: the Cast goes
                cast, value = node.outputs[0], node.inputs[0]
                graph.remove(node, safe=False)
                _take_over(value, cast)
                self.casts += 1
            elif _gemm(node):
                self._half_result(graph, node)
        for node in list(graph):
            if _operator(node) in _GELU and node.outputs[0] in keep:
                self._gelu(graph, node)
            elif _operator(node) == _LAYER_NORM and node.outputs[0] in keep:
                node.attributes["operator"] = ir.AttrString("operator", _LAYER_NORM_BF16)
                self.layer_norms += 1
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _candidates(graph: ir.Graph) -> dict[ir.Value, bool]:
        """Values that could be bf16 (GEMM results, layout ops of such, GELU of an exact one) ->
        whether they are bf16-exact; in graph (topological) order."""
        exact: dict[ir.Value, bool] = {}
        for node in graph:
            if _gemm(node):
                if node.outputs[0].dtype == ir.DataType.FLOAT:
                    exact[node.outputs[0]] = True
                continue
            inputs = _layout_inputs(node)
            if inputs is not None:
                if inputs and all(v in exact for v in inputs):
                    for out in node.outputs:
                        exact[out] = all(exact[v] for v in inputs)
                continue
            if _operator(node) in _GELU and exact.get(node.inputs[0]) is True:
                exact[node.outputs[0]] = False
            elif _operator(node) == _LAYER_NORM and node.outputs[0].dtype == ir.DataType.FLOAT:
                exact[node.outputs[0]] = False
        return exact

    @staticmethod
    def _valid(graph: ir.Graph, exact: dict[ir.Value, bool]) -> set[ir.Value]:
        """The candidates that can be bf16: whole groups (a layout op's data inputs and outputs, a
        GELU's input and output change dtype together), every member read only by nodes that take
        bf16 there, and by at most one that takes its gradient."""
        group = {v: v for v in exact}

        def find(v: ir.Value) -> ir.Value:
            while group[v] is not v:
                group[v] = group[group[v]]
                v = group[v]
            return v

        def union(a: ir.Value, b: ir.Value) -> None:
            group[find(a)] = find(b)

        for node in graph:
            inputs = _layout_inputs(node)
            if inputs is not None and node.outputs[0] in exact:
                for v in [*inputs, *node.outputs]:
                    union(v, node.outputs[0])
            elif _operator(node) in _GELU and node.outputs[0] in exact:
                union(node.inputs[0], node.outputs[0])
        bad = set()
        for v, is_exact in exact.items():
            if not _member_ok(v, is_exact, exact):
                bad.add(find(v))
        return {v for v in exact if find(v) not in bad}

    @staticmethod
    def _retype(graph: ir.Graph, node: ir.Node, keep: set[ir.Value]) -> None:
        """A new ``dtypes`` argument naming the node's result and operand dtypes."""
        dtypes = node.inputs[-1]
        codes = np.array(dtypes.const_value.numpy() if dtypes.const_value is not None else _constant(dtypes))
        n = _OPERANDS[_operator(node)]
        new = codes.copy()
        if node.outputs[0] in keep:
            new[1] = _TORCH_BFLOAT16
        for i, v in enumerate(node.inputs[:n]):
            if v is not None and v in keep:
                new[2 + i] = _TORCH_BFLOAT16
        if (new == codes).all():
            return
        const = ir.node("Constant", [], {"value": ir.tensor(new.astype(np.int64))}, name=f"{node.name}/dtypes_bf16")
        graph.insert_before(node, const)
        node.replace_input_with(len(node.inputs) - 1, const.outputs[0])

    @staticmethod
    def _keep_inputs(graph: ir.Graph, node: ir.Node, keep: set[ir.Value]) -> None:
        """A training graph's linear whose x, or attention whose q, k^T and v, are now bf16: the
        variant whose backward reads those inputs themselves, not copies (a copy of an input in
        the compute dtype would be the input, which the ATen bridge copies)."""
        operator = _operator(node)
        if operator == _LINEAR and len(node.outputs) == 3 and node.inputs[0] in keep:
            variant, drop = _LINEAR_KEEP_INPUT, {1}
        elif operator == _ATTENTION and len(node.outputs) == 5 and all(v in keep for v in node.inputs[:3]):
            variant, drop = _ATTENTION_KEEP_INPUTS, {1, 3}
        else:
            return
        new = ir.node(
            "ATen",
            list(node.inputs),
            attributes={"operator": variant.operator, "overload_name": ""},
            domain=ATEN_DOMAIN,
            num_outputs=len(node.outputs) - len(drop),
            name=node.name,
        )
        graph.insert_before(node, new)
        kept = [o for i, o in enumerate(node.outputs) if i not in drop]
        for old, value in zip(kept, new.outputs):
            _take_over(value, old)
        graph.remove(node, safe=True)

    def _half_result(self, graph: ir.Graph, node: ir.Node) -> None:
        """A linear whose float32 result the graph reads in float32 (the loss reads an LM head's
        logits) and narrows to bf16 (one ``Cast``: eager returns the logits in bf16) returns it in
        both dtypes (``linear_keep_input_half``: the bf16 one is the GEMM's own result), and the
        Cast goes; its backward sums the two gradients in bf16, as eager autocast sums them,
        instead of ORT's Cast of the bf16 one and a float32 ``Sum``. (A result that only the Cast
        reads is bf16 already: ``_member_ok``.)"""
        result = node.outputs[0]
        if _operator(node) != _LINEAR_KEEP_INPUT.operator or len(node.outputs) != 2:
            return
        if result.dtype != ir.DataType.FLOAT or result.is_graph_output():
            return
        casts = [user for user, _ in result.uses() if _narrowing_cast(user)]
        if len(casts) != 1:
            return
        (cast,) = casts
        new = ir.node(
            "ATen",
            list(node.inputs),
            attributes={"operator": _LINEAR_KEEP_INPUT_HALF.operator, "overload_name": ""},
            domain=ATEN_DOMAIN,
            num_outputs=_LINEAR_KEEP_INPUT_HALF.n_outputs,
            name=node.name,
        )
        graph.insert_before(node, new)
        for old, value in zip([*node.outputs, cast.outputs[0]], new.outputs):
            _take_over(value, old)
        graph.remove(cast, safe=True)
        graph.remove(node, safe=True)
        self.half_results += 1

    def _gelu(self, graph: ir.Graph, node: ir.Node) -> None:
        approximate = _GELU[_operator(node)]
        const = ir.node(
            "Constant", [], {"value": ir.tensor(np.array(approximate, dtype=np.int64))}, name=f"{node.name}/approximate"
        )
        gelu = ir.node(
            "ATen",
            [node.inputs[0], const.outputs[0]],
            attributes={"operator": _BF16_GELU, "overload_name": ""},
            domain=ATEN_DOMAIN,
            name=f"{node.name}/bf16",
        )
        graph.insert_before(node, const)
        graph.insert_before(node, gelu)
        out = node.outputs[0]
        gelu.outputs[0].dtype, gelu.outputs[0].shape = _BF16, out.shape
        name = out.name
        out.replace_all_uses_with(gelu.outputs[0])
        graph.remove(node, safe=True)
        gelu.outputs[0].name = name
        self.gelus += 1


def _member_ok(v: ir.Value, is_exact: bool, candidates: dict[ir.Value, bool]) -> bool:
    """Whether every reader of ``v`` takes it in bf16 (a non-exact value only where it is narrowed
    to bf16 anyway: a GEMM, through layout ops), and at most one takes its gradient."""
    if v.is_graph_output():
        return False
    differentiable = 0
    for user, index in v.uses():
        if user.domain in _ONNX and user.op_type == "Shape":
            continue
        differentiable += 1
        operator = _operator(user)
        if operator in _OPERANDS:
            if index >= _OPERANDS[operator]:
                return False
        elif _layout_inputs(user) is not None:
            if index not in (
                [i for i, _ in enumerate(user.inputs)] if _LAYOUT[user.op_type] is None else _LAYOUT[user.op_type]
            ):
                return False
            if any(o not in candidates for o in user.outputs):
                return False
        elif operator in _GELU:
            if not is_exact or user.outputs[0] not in candidates:
                return False
        elif not _narrowing_cast(user):
            return False
    return differentiable <= 1


def _narrowing_cast(node: ir.Node) -> bool:
    """A ``Cast`` to bf16 (what ``HalfPrecisionOnCPUPass`` writes where eager's value is bf16)."""
    to = node.attributes.get("to") if node.domain in _ONNX and node.op_type == "Cast" else None
    return to is not None and to.as_int() == _BF16.value


def _take_over(value: ir.Value, old: ir.Value) -> None:
    """``value`` replaces ``old`` everywhere, graph outputs included, under ``old``'s name and type."""
    value.dtype, value.shape = old.dtype, old.shape
    name = old.name
    old.replace_all_uses_with(value, replace_graph_outputs=True)
    old.name = None
    value.name = name


def _constant(value: ir.Value) -> np.ndarray:
    node = value.producer()
    if node is None or node.op_type != "Constant":
        raise ValueError(f"{value.name}: the dtypes argument of a bf16 GEMM is not a constant")
    return node.attributes["value"].as_tensor().numpy()
