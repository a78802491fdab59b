"""Run the ONNX ops ORT 1.19.2 cannot differentiate as PyTorch ops, differentiated by PyTorch.

Each ONNX node whose op has an entry in ``ortwrap.ops.GRADIENTS`` (HardSwish, HardSigmoid,
Mish, Elu, Selu, Celu, Softplus, PRelu, Shrink, ReduceMax/ReduceMin, ConvTranspose on CPU, ...) is
replaced by one ``org.pytorch.aten::ATen`` node calling the entry's PyTorch op, with the arguments
its ``args`` maps from the node's inputs and attributes (constants as the ATen bridge encodes them).
The general rule covers the others: a node without attributes whose ORT gradient build fails
(``grad/probe.py``, asked once per op type, input types, ranks and constant inputs) runs as the
PyTorch op of the same name that takes the same tensors (``Acosh`` -> ``acosh``), if there is one
and it is not random.
ORT then runs the op through the ATen bridge, and its gradient is the bridge's vjp: PyTorch's
autograd of the same op (``bridge/aten.py``). An entry whose ``args`` returns None leaves the node
to ORT. Training graphs only (an inference graph keeps ORT's kernels); the output keeps the
replaced value's inferred type and shape.

Each rewrite is checked once on PyTorch's meta device: the op must return the element types the
graph declares for the replaced outputs (ORT reads an ATen node's result as the declared type, so
an int64 result where the graph says int32 gives wrong numbers, not an error).
"""

from __future__ import annotations

import functools
import re

import onnx_ir as ir
import torch

from .._compat import torch as compat
from ..bridge.aten import ATEN_DOMAIN, TORCH_DTYPES
from ..errors import PassError
from ..export.type_inference import meta_outputs
from ..grad.probe import UNKNOWN, probe_node
from ..ops import GRADIENTS, OnnxViaTorch, constant_array
from ._build import NodeBuilder, constant_value

_ONNX = ("", "ai.onnx")


def _torch_op(name: str, node: ir.Node, args: list) -> str:
    """The op for this node: Resize and AveragePool pick theirs by mode and rank."""
    if name == "upsample":
        from ..ops.mappers import _resize_op

        return _resize_op(node)[0]
    if name == "avg_pool":
        return f"avg_pool{len(args[1])}d"
    if name == "layer_norm" and len(node.outputs) > 1:
        return "native_layer_norm"
    if name == "max_pool":
        return f"max_pool{len(args[1])}d"
    return name


#: Ops whose result has their first input's element type (for values the passes made, not yet inferred).
_SAME_TYPE = frozenset(
    ("Add", "Sub", "Mul", "Div", "Neg", "Abs", "Gather", "Slice", "Concat", "Reshape", "Unsqueeze", "Squeeze",
     "Identity", "Transpose", "Expand", "ReduceProd", "ReduceSum", "ReduceMax", "ReduceMin", "CumSum")
)  # fmt: skip


def _dtype(value: ir.Value | None, depth: int = 0) -> ir.DataType | None:
    """``value``'s element type, inferred or read off its producers (a pass's new ``Shape`` ->
    ``ReduceProd``, such as BatchNormRunningStatsPass's element count, has none yet)."""
    if value is None or value.dtype is not None or depth > 16:
        return None if value is None else value.dtype
    node = value.producer()
    if node is None:
        return None
    if node.op_type in ("Shape", "Size"):
        return ir.DataType.INT64
    if node.op_type == "Cast" and "to" in node.attributes:
        return ir.DataType(node.attributes["to"].as_int())
    if node.op_type == "Constant" and "value" in node.attributes:
        return node.attributes["value"].as_tensor().dtype
    if node.op_type in _SAME_TYPE and node.inputs and value is node.outputs[0]:
        return _dtype(node.inputs[0], depth + 1)
    return None


def _float_outputs(node: ir.Node) -> bool:
    return any(t is not None and t.is_floating_point() for t in (_dtype(o) for o in node.outputs))


def _check_output_types(node: ir.Node, op: str, overload: str, values: list[ir.Value | None]) -> None:
    """Raise PassError if the PyTorch op returns other element types than ``node``'s outputs have.

    Best effort: skipped where an input's type or rank is unknown, a constant is bfloat16 or the op
    refuses the stand-in sizes (2 for every symbolic dim)."""
    inputs: list = []
    for v in values:
        producer = v.producer() if v is not None else None
        if v is None:
            inputs.append(None)
        elif v.const_value is not None or (producer is not None and producer.op_type == "Constant"):
            array = constant_value(v)
            if array is None or array.dtype.name == "bfloat16":  # (ml_dtypes' bfloat16: not for from_numpy)
                return
            inputs.append(torch.from_numpy(array))
        elif v.dtype is None or v.shape is None or int(v.dtype) not in TORCH_DTYPES:
            return
        else:
            dims = [d if isinstance(d, int) else 2 for d in v.shape]
            inputs.append(torch.empty(dims, dtype=TORCH_DTYPES[int(v.dtype)], device="meta"))
    try:
        results = meta_outputs(op, overload, inputs)
    except Exception:
        return
    for out, r in zip(node.outputs, results):
        if out.dtype is None or not isinstance(r, torch.Tensor) or int(out.dtype) not in TORCH_DTYPES:
            continue
        if r.dtype != TORCH_DTYPES[int(out.dtype)]:
            raise PassError(
                f"node {node.name!r} ({node.op_type}): {op} returns {r.dtype} where the graph has "
                f"{TORCH_DTYPES[int(out.dtype)]}; its entry (ortwrap/ops/mappers.py, GRADIENTS) must keep the type"
            )


def replace_with_torch(graph: ir.Graph, node: ir.Node, entry: OnnxViaTorch) -> ir.Node | None:
    """Replace ``node`` by one ATen node calling ``entry``'s PyTorch op and return it; None where
    the entry's ``args`` leaves the node as it is.

    Raises:
        PassError: the entry refuses the node, or an argument cannot be encoded.
    """
    inputs = list(node.inputs)
    b = NodeBuilder(node.name or f"{node.op_type}_{id(node):x}")
    args = entry.args(node, lambda i, inputs=inputs: inputs[i] if i < len(inputs) else None, b)
    if args is None:
        return None
    values: list[ir.Value | None] = []
    for a in args:
        if a is None or isinstance(a, ir.Value):
            values.append(a)
        else:
            try:
                values.append(b.const(constant_array(a)))
            except TypeError as e:
                raise PassError(f"node {node.name!r} ({node.op_type}): {e}") from e
    # NOTE: every argument, absent ones included: ORT keeps one gradient definition per
    # op and overload per process, which reads the inputs by position.
    op, _, overload = _torch_op(entry.torch_op, node, args).partition(".")
    aten = b.node("ATen", values, domain=ATEN_DOMAIN, outputs=len(node.outputs), operator=op, overload_name=overload)
    _check_output_types(node, op, overload, values)
    b.replace(graph, node, list(aten.outputs))
    return aten


def _snake(op_type: str) -> str:
    """``Acosh`` -> ``acosh``, ``GlobalAveragePool`` -> ``global_average_pool``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", op_type).lower()


def _is_tensor_argument(a) -> bool:
    """A ``Tensor`` or ``Tensor?`` argument (``clip.Tensor``'s bounds)."""
    kind = a.type.kind()
    return kind == "TensorType" or (kind == "OptionalType" and a.type.getElementType().kind() == "TensorType")


@functools.cache
def _same_named_op(op_type: str, n_inputs: int, n_outputs: int) -> str | None:
    """The PyTorch op (``name.overload``) named like the ONNX op that takes exactly its ``n_inputs``
    tensors (every other argument defaulted) and returns ``n_outputs`` tensors: ``Acosh`` ->
    ``acosh.default``, ``Pow`` -> ``pow.Tensor_Tensor``. None where there is none, or several."""
    packet = getattr(torch.ops.aten, _snake(op_type), None)
    if packet is None:
        return None
    found = []
    for overload in packet.overloads():
        if torch.Tag.nondeterministic_seeded in getattr(packet, overload).tags:
            return None  # a random op: the vjp recomputes it, with another draw than the forward's
        schema = compat.op_schema(getattr(packet, overload))
        args = list(schema.arguments)
        if any(a.kwarg_only or a.alias_info is not None for a in args):
            continue  # out= and in-place overloads
        tensors = [a for a in args[:n_inputs] if _is_tensor_argument(a)]
        rest = args[n_inputs:]
        if len(tensors) != n_inputs or not all(a.has_default_value() for a in rest):
            continue
        if len(schema.returns) != n_outputs or any(r.type.kind() != "TensorType" for r in schema.returns):
            continue
        found.append(overload)
    return f"{_snake(op_type)}.{found[0]}" if len(found) == 1 else None


#: (op type, input types and ranks) -> whether ORT can build the node's gradient (one probe each)
_ORT_GRADIENT: dict[tuple, bool] = {}


def _ort_lacks_gradient(node: ir.Node, opsets: dict[str, int]) -> bool:
    """Whether ORT's gradient builder fails on ``node`` alone (``grad/probe.py``); False where that
    cannot be asked (an input of unknown type or rank)."""
    key = (
        node.op_type,
        tuple((None, None) if v is None else (v.dtype, None if v.shape is None else len(v.shape)) for v in node.inputs),
        tuple(constant_value(v) is not None for v in node.inputs),
    )
    if key not in _ORT_GRADIENT:
        why = probe_node(node, opsets, with_backward=True, constant_value=constant_value, every_gradient=True)
        _ORT_GRADIENT[key] = why is None or why == UNKNOWN
    return not _ORT_GRADIENT[key]


def same_named_entry(node: ir.Node, opsets: dict[str, int]) -> OnnxViaTorch | None:
    """The general rule for an ONNX op ORT cannot differentiate (``Acosh``, ``Cosh``, ``Pow`` of an
    exponent that needs a gradient, ...) and that no registry entry covers: the PyTorch op of the same
    name and the same tensor arguments (no attributes), differentiated by PyTorch. None where there
    is no such op or ORT can build the gradient."""
    if node.attributes or not node.outputs:
        return None
    op = _same_named_op(node.op_type, len(node.inputs), len(node.outputs))
    if op is None or node.inputs[0] is None or not _ort_lacks_gradient(node, opsets):
        return None
    schema_args = compat.op_schema(getattr(getattr(torch.ops.aten, op.split(".")[0]), op.split(".")[1])).arguments
    if any(v is None and schema_args[i].type.kind() != "OptionalType" for i, v in enumerate(node.inputs)):
        return None

    def args(n, value, b):
        first = n.inputs[0].dtype
        # ONNX ops such as Pow keep the first input's type; PyTorch's promote it with the others'.
        # (an absent optional input, Clip's max, stays absent)
        return [
            v if v is None or v.dtype is None or v.dtype == first or first is None else b.op("Cast", v, to=int(first))
            for v in n.inputs
        ]

    return OnnxViaTorch(node.op_type, op, args, why="ORT 1.19.2 cannot build this node's gradient")


class TorchGradientsPass(ir.passes.InPlacePass):
    """Replace ONNX ops without an ORT gradient by ATen nodes of the matching PyTorch op."""

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        #: ONNX op type -> nodes rewritten in the last call
        self.rewritten: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.rewritten = {}
        for node in list(graph):
            entry = GRADIENTS.get(node.op_type) if node.domain in _ONNX else None
            if entry is None and node.domain in _ONNX and _float_outputs(node):
                entry = same_named_entry(node, dict(model.opset_imports))
                if entry is not None:
                    try:
                        replace_with_torch(graph, node, entry)
                    except PassError:
                        continue  # PyTorch's op gives other element types: ORT's error stands
                    self.rewritten[node.op_type] = self.rewritten.get(node.op_type, 0) + 1
                    continue
            if entry is None or self.device_type not in entry.devices:
                continue
            dtypes = [_dtype(o) for o in node.outputs]
            if all(t is not None and not t.is_floating_point() for t in dtypes):
                # Integer results (position ids from a CumSum, a ReduceProd of shape values):
                # nothing to differentiate, and ORT's kernel keeps the type. NOTE: also what keeps
                # register_gradients' one definition per op right: it leaves out the output
                # gradients of the node it first sees whose outputs are integers.
                continue
            if replace_with_torch(graph, node, entry) is not None:
                self.rewritten[node.op_type] = self.rewritten.get(node.op_type, 0) + 1
        return ir.passes.PassResult(model, modified=bool(self.rewritten))
