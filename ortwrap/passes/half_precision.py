"""Half-precision graphs on the CPU: compute in float32 between the half-precision boundaries.

ONNX Runtime 1.19.2's CPU execution provider has no bfloat16 compute kernels (only ``Cast``), and
runs float16 through Casts it inserts around float32 kernels. A graph exported under
``torch.autocast`` or from a ``model.to(torch.bfloat16)`` would not load (``Could not find an
implementation for Gemm(13)``). This pass makes every bfloat16 and float16 value of such a graph
float32, keeping the boundaries eager PyTorch has:

- ``Cast(to=half)`` becomes ``Cast(to=float)`` (and then a no-op, removed);
- half-precision constants and initializers become float32 once, when the graph is built (not a
  Cast on every run: the idea of ORT PR 24175, "fuse initializers");
- a half-precision graph input (a bfloat16 parameter or buffer, a float16 batch) is cast to float32
  where it enters; its gradient comes back through that Cast, so it arrives in the input's dtype,
  as eager's does;
- a half-precision graph output is cast back to half where it leaves, so outputs have eager's dtypes;
- attributes that name a dtype (``ConstantOfShape``'s value, ``RandomNormal``'s ``dtype``, ...)
  name float32;
- nodes whose semantics are the dtype (autograd.Functions as ``PythonOp``, PyTorch kernels as
  ``ATen`` nodes) keep their half-precision inputs and outputs, with Casts around them.

Numerics: eager rounds every half-precision result to half precision; here intermediate results
keep float32, so results agree with eager within half-precision tolerance and are closer to a
float32 run. (On CPUs with native bfloat16, ``TorchGemmOnCPUPass`` then runs the bfloat16 GEMMs
in bfloat16: see docs/performance.md.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ..bridge.aten import ATEN_DOMAIN
from ..ops import DTYPE_ARGUMENT_OPS
from .result import PassResult

_HALF = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16)
_ONNX = ("", "ai.onnx")
#: Nodes that keep their own dtypes (casts around them instead).
_OPAQUE = {("com.microsoft", "PythonOp"), ("org.pytorch.aten", "ATen")}
#: (op type, attribute) pairs whose integer attribute names an output dtype.
_DTYPE_ATTRS = {
    ("Cast", "to"),
    ("RandomNormal", "dtype"),
    ("RandomUniform", "dtype"),
    ("RandomNormalLike", "dtype"),
    ("RandomUniformLike", "dtype"),
    ("EyeLike", "dtype"),
    ("Multinomial", "dtype"),
    ("Bernoulli", "dtype"),
}


def _opaque(node: ir.Node) -> bool:
    """Whether ``node`` must see its inputs and outputs in their own dtypes (not ortwrap's GEMMs
    of ``passes/half_matmul.py``, which take float32 and compute in the dtype they name)."""
    if (node.domain, node.op_type) not in _OPAQUE:
        return False
    operator = node.attributes.get("operator")
    return operator is None or operator.as_string() not in DTYPE_ARGUMENT_OPS


def _is_half(value: ir.Value | None) -> bool:
    return value is not None and value.dtype in _HALF


def _float_tensor(tensor: ir.TensorProtocol, name: str | None = None) -> ir.Tensor:
    return ir.tensor(np.asarray(tensor.numpy(), dtype=np.float32), name=name)


class HalfPrecisionOnCPUPass(ir.passes.InPlacePass):
    """Make every bfloat16/float16 value of a CPU graph float32, keeping its boundaries (see the module docstring)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if not self._has_half(graph):
            return ir.passes.PassResult(model, modified=False)
        #: id of an opaque node's half-precision output -> its float32 Cast (``_keep_dtypes``)
        self._to_float: dict[int, ir.Value] = {}
        original = {id(v): v.dtype for v in graph.inputs}
        original.update((id(o), o.dtype) for node in graph for o in node.outputs)
        outputs = list(graph.outputs)
        half_outputs = {id(v): v.dtype for v in outputs if _is_half(v)}
        # 1. Initializers and constants: converted once.
        for value in list(graph.initializers.values()):
            if _is_half(value) and value.const_value is not None and value not in graph.inputs:
                value.const_value = _float_tensor(value.const_value, value.name)
                value.dtype = ir.DataType.FLOAT
        # 2. Half graph inputs: a Cast to float32 where they enter.
        for value in list(graph.inputs):
            if _is_half(value) and value.uses():
                cast = ir.node("Cast", [value], {"to": int(ir.DataType.FLOAT)}, name=f"{value.name}/ortwrap_to_float")
                cast.outputs[0].dtype = ir.DataType.FLOAT
                cast.outputs[0].shape = value.shape
                for user, index in list(value.uses()):
                    if user is not cast:
                        user.replace_input_with(index, cast.outputs[0])
                graph.insert_before(next(iter(graph)), cast) if len(graph) else graph.append(cast)
        # 3. Nodes.
        for node in list(graph):
            if _opaque(node):
                self._keep_dtypes(graph, node, original)
                continue
            if node.domain == ATEN_DOMAIN:  # one of ortwrap's GEMMs: float32 in and out
                if _is_half(node.outputs[0]):  # (its other outputs are its bf16 operands)
                    node.outputs[0].dtype = ir.DataType.FLOAT
                continue
            if node.domain not in _ONNX:
                continue
            for op, attr in _DTYPE_ATTRS:
                if node.op_type == op and attr in node.attributes:
                    if ir.DataType(node.attributes[attr].as_int()) in _HALF:
                        node.attributes[attr] = ir.AttrInt64(attr, int(ir.DataType.FLOAT))
            if node.op_type == "Constant" and "value" in node.attributes:
                t = node.attributes["value"].as_tensor()
                if t.dtype in _HALF:
                    node.attributes["value"] = ir.AttrTensor("value", _float_tensor(t))
            if node.op_type == "ConstantOfShape" and "value" in node.attributes:
                t = node.attributes["value"].as_tensor()
                if t.dtype in _HALF:
                    node.attributes["value"] = ir.AttrTensor("value", _float_tensor(t))
            for out in node.outputs:
                if _is_half(out):
                    out.dtype = ir.DataType.FLOAT
        # 4. Half graph outputs: cast back where they leave.
        for i, value in enumerate(outputs):
            dtype = half_outputs.get(id(value))
            if dtype is None:
                continue
            source = value
            if _is_half(value):  # an opaque node's output, still in half precision
                source = self._to_float.get(id(value))
                if source is None:
                    continue  # read by nothing else: the output as it is
                # NOTE: the output is cast back from the float32 copy the graph reads, so that the
                # output's gradient and the graph's are summed in float32 (ORT has no half Sum).
            name = value.name
            cast = ir.node("Cast", [source], {"to": int(dtype)}, name=f"{name}/ortwrap_to_half")
            graph.append(cast)
            value.name = f"{name}/{'half' if source is not value else 'float'}"
            cast.outputs[0].name = name
            cast.outputs[0].dtype = dtype
            cast.outputs[0].shape = value.shape
            graph.outputs[i] = cast.outputs[0]
        self._remove_float_to_float_casts(graph)
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _has_half(graph: ir.Graph) -> bool:
        if any(_is_half(v) for v in graph.inputs) or any(_is_half(v) for v in graph.outputs):
            return True
        for node in graph:
            if node.op_type == "Cast" and ir.DataType(node.attributes["to"].as_int()) in _HALF:
                return True
            if any(_is_half(o) for o in node.outputs):
                return True
        return False

    def _keep_dtypes(self, graph: ir.Graph, node: ir.Node, original: dict[int, ir.DataType | None]) -> None:
        """Casts around a node that must see its half-precision inputs and outputs as they are."""
        for i, value in enumerate(list(node.inputs)):
            if value is None or _is_half(value):
                continue
            # The input was half before this pass made it float32 (or it is the float Cast of a
            # graph input or of another opaque node's output): give the node its half value back.
            dtype = original.get(id(value))
            producer = value.producer()
            if dtype not in _HALF and producer is not None and producer.name.endswith("_to_float"):
                dtype = original.get(id(producer.inputs[0]))
            if dtype in _HALF:
                # NOTE: one Cast per reading node, even of one value: a half value read twice would
                # get its gradients summed in half precision, which ORT's CPU Sum cannot.
                cast = ir.node("Cast", [value], {"to": int(dtype)}, name=f"{node.name}/in{i}_to_half")
                cast.outputs[0].dtype = dtype
                cast.outputs[0].shape = value.shape
                graph.insert_before(node, cast)
                node.replace_input_with(i, cast.outputs[0])
        for j, out in enumerate(node.outputs):
            if not _is_half(out) or not out.uses():
                continue
            cast = ir.node("Cast", [out], {"to": int(ir.DataType.FLOAT)}, name=f"{node.name}/out{j}_to_float")
            cast.outputs[0].dtype = ir.DataType.FLOAT
            cast.outputs[0].shape = out.shape
            self._to_float[id(out)] = cast.outputs[0]
            for user, index in list(out.uses()):
                if user is not cast:
                    user.replace_input_with(index, cast.outputs[0])
            graph.insert_after(node, cast)

    @staticmethod
    def _remove_float_to_float_casts(graph: ir.Graph) -> None:
        for node in list(graph):
            if node.op_type != "Cast" or node.domain not in _ONNX:
                continue
            src = node.inputs[0]
            if (
                src is None
                or src.dtype != ir.DataType.FLOAT
                or node.attributes["to"].as_int() != int(ir.DataType.FLOAT)
            ):
                continue
            out = node.outputs[0]
            if out.is_graph_output():
                continue
            out.replace_all_uses_with(src)
            graph.remove(node, safe=True)


@dataclass
class FusedInitializersResult(PassResult):
    """:class:`FuseHalfInitializersPass`'s result: the graph inputs it took as float32."""

    converted: frozenset[str] = frozenset()


class FuseHalfInitializersPass(ir.passes.InPlacePass):
    """Take the named half-precision graph inputs as float32 (ORT PR 24175, "fuse initializers").

    The inputs are frozen parameters and buffers: the runtime feeds them as float32 copies that it
    makes once and remakes only when the tensor changes (``Program.bind``), so the graph needs no
    ``Cast`` of them on every step. ``HalfPrecisionOnCPUPass``, which runs next, makes the rest of
    the graph float32 around them. Inputs read by nodes that keep their own dtypes (PythonOps, ATen
    nodes) stay as they are. Its result (:class:`FusedInitializersResult`) lists the inputs it changed.
    """

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names

    def call(self, model: ir.Model) -> FusedInitializersResult:
        converted = []
        for value in model.graph.inputs:
            if value.name not in self.names or not _is_half(value):
                continue
            if any(_opaque(user) for user, _ in value.uses()):
                continue
            value.dtype = ir.DataType.FLOAT
            converted.append(value.name)
        return FusedInitializersResult(model, modified=bool(converted), converted=frozenset(converted))
