"""Float64 graphs on the CPU: the ops ORT cannot run or differentiate in float64 run as PyTorch ops.

ONNX Runtime 1.19.2's CPU provider lacks float64 kernels for some forward ops (``Erf``, ``Cos``,
``Conv``) and for some gradient ops its builder writes (``ReluGrad``, ``SoftmaxGrad_13``,
``LeakyReluGrad``), and the float64 ``LayerNormalizationGrad`` inlines a function body that is
invalid at opset 18. A ``model.double()`` would fail when its session is created. This pass asks
ORT, node by node, whether it can (``grad/probe.py``: the node built alone, its gradient built,
a CPU session created; cached per op signature), and replaces each node it cannot by one ATen
node calling the PyTorch op ``registry.DOUBLE_PRECISION`` names for it, whose gradient is
PyTorch's autograd (``bridge/aten.py``), as ``TorchGradientsPass`` does for ops without a gradient.
Float attributes the replacement reads are taken as written (``registry.written``: ``1e-5``, not
its float32 ``9.99999974e-06``), so results match eager's float64 ones to rounding.

What a one-node probe cannot see:

- ORT's fusions of node pairs, whatever the dtype: ``x * Sigmoid(x)`` becomes ``QuickGelu`` (in
  the gradient builder) and a ``MatMul`` of a ``Transpose`` becomes ``FusedMatMul`` (at session
  creation). The fused op is probed instead; where ORT lacks it, PyTorch's ``silu``/``matmul`` run.
- ``Concat``'s float64 gradient (``SplitTraining``) is registered for every type and fails when
  it runs: float64 ``Concat`` is joined by ``torch.cat``, two inputs at a time.
- ``BatchNormalization`` in training mode becomes ``BatchNormInternal`` at session creation,
  which has no float64 kernel: refused with a :class:`~ortwrap.errors.PassError` (eval-mode
  BatchNorm is decomposed and trains).
- A float attribute float32 cannot hold (``LeakyReLU(0.3)``): ORT would compute with its float32
  rounding, so an op with a registry entry runs as PyTorch's with the written value.

A node ORT cannot run in float64, that runs in float32 and that has no registry entry raises
:class:`~ortwrap.errors.PassError` naming the op and what ORT lacks, before any session is built.
Graphs without a float64 value are not touched (the pass returns after one scan).
"""

from __future__ import annotations

import onnx_ir as ir

from ..errors import PassError
from ..grad.probe import UNKNOWN, probe_node
from ..graph.names import ATEN_DOMAIN
from ..ops import DOUBLE_PRECISION, constant_array, written
from ._build import NodeBuilder, constant_value
from .torch_gradients import replace_with_torch

_DOUBLE = ir.DataType.DOUBLE
#: Domains whose ops the probe can build alone (ATen and PythonOp nodes run PyTorch already).
_DOMAINS = {"": "", "ai.onnx": "", "com.microsoft": "com.microsoft"}


def _is_double(value: ir.Value | None) -> bool:
    return value is not None and value.dtype == _DOUBLE


def _rounded_float_attribute(node: ir.Node) -> bool:
    """Whether a float attribute of ``node`` is not the value its author wrote (``LeakyReLU(0.3)``
    reads back 0.30000001192...): ORT's float64 kernel would compute with the float32."""
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.FLOAT and written(attr.as_float()) != attr.as_float():
            return True
    return False


def _infer_dtypes(graph: ir.Graph, opsets: dict[str, int]) -> None:
    """Give outputs whose type inference left them untyped (after a ``Reshape`` to a computed
    shape, ONNX's inference stops) the dtype their op's schema ties them to: an output whose type
    variable is an input's takes that input's dtype."""
    import onnx

    for node in graph:
        if all(o.dtype is not None for o in node.outputs):
            continue
        domain = "" if node.domain == "ai.onnx" else node.domain
        try:
            schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
        except Exception:  # no schema (ATen, PythonOp, an unknown op)
            continue
        if not schema.inputs or not schema.outputs:
            continue
        known: dict[str, ir.DataType] = {}
        for i, value in enumerate(node.inputs):
            formal = schema.inputs[min(i, len(schema.inputs) - 1)]
            if value is not None and value.dtype is not None:
                known.setdefault(formal.type_str, value.dtype)
        for k, out in enumerate(node.outputs):
            if out.dtype is None:
                dtype = known.get(schema.outputs[min(k, len(schema.outputs) - 1)].type_str)
                if dtype is not None:
                    out.dtype = dtype


class DoublePrecisionOnCPUPass(ir.passes.InPlacePass):
    """Run the float64 nodes ORT's CPU provider cannot run or differentiate as PyTorch ops."""

    def __init__(self, with_backward: bool) -> None:
        super().__init__()
        self.with_backward = with_backward
        #: ONNX op type -> nodes rewritten in the last call
        self.rewritten: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.rewritten = {}
        if not self._has_double(graph):
            return ir.passes.PassResult(model, modified=False)
        opsets = dict(model.opset_imports)
        _infer_dtypes(graph, opsets)
        self._silu(graph, opsets)
        self._transposed_matmul(graph, opsets)
        for node in list(graph):
            if node.op_type == "Concat" and node.domain in ("", "ai.onnx") and _is_double(node.outputs[0]):
                self._concat(graph, node)
                continue
            if (
                node.op_type == "BatchNormalization"
                and node.domain in ("", "ai.onnx")
                and "training_mode" in node.attributes
                and node.attributes["training_mode"].as_int() == 1
                and _is_double(node.inputs[0])
            ):
                # ORT swaps it for BatchNormInternal when it creates the session: no probe sees it.
                raise PassError(
                    f"node {node.name!r}: BatchNorm in training mode cannot be trained in float64 on ONNX Runtime's "
                    "CPU provider (no float64 BatchNormInternal kernel). Train the model in float32, or put its "
                    "BatchNorm layers in eval() (running statistics: that form trains in float64)"
                )
            domain = _DOMAINS.get(node.domain)
            if domain is None or not (any(map(_is_double, node.inputs)) or any(map(_is_double, node.outputs))):
                continue
            entry = DOUBLE_PRECISION.get((domain, node.op_type))
            why = probe_node(node, opsets, with_backward=self.with_backward, constant_value=constant_value)
            if why is None and not (entry is not None and _rounded_float_attribute(node)):
                continue
            if entry is not None:
                self._drop_unused_outputs(node)
            aten = replace_with_torch(graph, node, entry) if entry is not None else None
            if aten is not None:
                # PyTorch computes every output in the input's dtype (native_layer_norm's statistics
                # too, which ONNX's LayerNormalization stashes in float32).
                for out in aten.outputs:
                    if out.dtype is None or out.dtype.is_floating_point():
                        out.dtype = _DOUBLE
                self.rewritten[node.op_type] = self.rewritten.get(node.op_type, 0) + 1
                continue
            if why == UNKNOWN or probe_node(
                node, opsets, with_backward=self.with_backward, constant_value=constant_value, as_float=True
            ):
                continue  # not a float64 matter (or not known to be): ORT's own error deals with it
            raise PassError(
                f"node {node.name!r} ({domain + '::' if domain else ''}{node.op_type}) cannot be "
                f"{'trained' if self.with_backward else 'run'} in float64 on ONNX Runtime's CPU provider ({why}), "
                "and ortwrap has no PyTorch equivalent for it (ortwrap/ops/mappers.py, DOUBLE_PRECISION). "
                "Train the model in float32, or report the op"
            )
        return ir.passes.PassResult(model, modified=bool(self.rewritten))

    def _concat(self, graph: ir.Graph, node: ir.Node) -> None:
        """``Concat``: ORT's gradient for it (``SplitTraining``) has no float64 implementation and
        fails only when it runs (its kernel is registered for every type, so no probe sees it). The
        inputs are joined two at a time by ``ortwrap_ops::cat2`` (``torch.cat``) instead."""
        inputs = [v for v in node.inputs if v is not None]
        b = NodeBuilder(node.name or f"Concat_{id(node):x}")
        if len(inputs) == 1:  # a copy
            b.replace(graph, node, [b.op("Identity", inputs[0])])
            self.rewritten["Concat"] = self.rewritten.get("Concat", 0) + 1
            return
        axis = int(node.attributes["axis"].as_int())
        dim = b.const(constant_array(axis))
        out = inputs[0]
        for value in inputs[1:]:
            aten = b.node("ATen", [out, value, dim], domain=ATEN_DOMAIN, operator="ortwrap_ops::cat2", overload_name="")
            out = aten.outputs[0]
            out.dtype = _DOUBLE
        b.replace(graph, node, [out])
        self.rewritten["Concat"] = self.rewritten.get("Concat", 0) + 1

    def _transposed_matmul(self, graph: ir.Graph, opsets: dict[str, int]) -> None:
        """``MatMul`` of a ``Transpose``'s output: ORT fuses the pair into ``FusedMatMul`` when it
        creates the session, which has no float64 kernel: probed as that fused op, and where ORT
        cannot run it, PyTorch's ``matmul``."""
        entry = DOUBLE_PRECISION[("", "MatMul")]
        for node in list(graph):
            if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or not _is_double(node.outputs[0]):
                continue
            producers = [v.producer() for v in node.inputs if v is not None]
            if not any(p is not None and p.op_type == "Transpose" for p in producers):
                continue
            fused = ir.node("FusedMatMul", list(node.inputs), domain="com.microsoft", name=f"{node.name}/probe")
            fused.outputs[0].dtype, fused.outputs[0].shape = node.outputs[0].dtype, node.outputs[0].shape
            probe_opsets = {**opsets, "com.microsoft": 1}
            why = probe_node(fused, probe_opsets, with_backward=False, constant_value=constant_value)
            if why is None:
                continue
            aten = replace_with_torch(graph, node, entry)
            if aten is not None:
                aten.outputs[0].dtype = _DOUBLE
                self.rewritten["MatMul"] = self.rewritten.get("MatMul", 0) + 1

    def _silu(self, graph: ir.Graph, opsets: dict[str, int]) -> None:
        """``x * Sigmoid(x)``: ORT's gradient builder fuses it into ``QuickGelu`` (whatever the
        dtype), whose float64 gradient kernel is missing: probed as that fused op, and where ORT
        cannot train it, one ATen ``silu`` node."""
        for sig in list(graph):
            if sig.op_type != "Sigmoid" or sig.domain not in ("", "ai.onnx") or not _is_double(sig.inputs[0]):
                continue
            x = sig.inputs[0]
            for mul, _ in list(sig.outputs[0].uses()):
                if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or x not in mul.inputs:
                    continue
                fused = ir.node("QuickGelu", [x], {"alpha": 1.0}, domain="com.microsoft", name=f"{mul.name}/probe")
                fused.outputs[0].dtype, fused.outputs[0].shape = mul.outputs[0].dtype, mul.outputs[0].shape
                probe_opsets = {**opsets, "com.microsoft": 1}
                if (
                    probe_node(fused, probe_opsets, with_backward=self.with_backward, constant_value=constant_value)
                    is None
                ):
                    continue
                b = NodeBuilder(mul.name or f"silu_{id(mul):x}")
                aten = b.node("ATen", [x], domain=ATEN_DOMAIN, operator="silu", overload_name="")
                aten.outputs[0].dtype = _DOUBLE
                b.replace(graph, mul, list(aten.outputs))
                self.rewritten["Sigmoid*Mul"] = self.rewritten.get("Sigmoid*Mul", 0) + 1
            if not sig.outputs[0].uses() and not sig.outputs[0].is_graph_output():
                graph.remove(sig, safe=True)

    @staticmethod
    def _drop_unused_outputs(node: ir.Node) -> None:
        """Trailing outputs nothing reads (LayerNormalization's statistics, which
        ``RestoreOptionalOutputsPass`` added for ORT's gradient): the PyTorch op's gradient would
        wait for their gradients, which nothing computes."""
        count = len(node.outputs)
        while count > 1 and not node.outputs[count - 1].uses() and not node.outputs[count - 1].is_graph_output():
            count -= 1
        if count < len(node.outputs):
            node.resize_outputs(count)

    @staticmethod
    def _has_double(graph: ir.Graph) -> bool:
        if any(map(_is_double, graph.inputs)) or any(_is_double(v) for v in graph.initializers.values()):
            return True
        return any(_is_double(o) for node in graph for o in node.outputs)
