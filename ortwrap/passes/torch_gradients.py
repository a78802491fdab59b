"""Run the ONNX ops ORT 1.19.2 cannot differentiate as PyTorch ops, differentiated by PyTorch.

Each ONNX node whose op has an entry in ``ortwrap.registry.GRADIENTS`` (HardSwish, HardSigmoid,
Mish, Elu, Selu, Celu, Softplus, PRelu, Shrink, ReduceMax/ReduceMin, ConvTranspose on CPU, ...) is
replaced by one ``org.pytorch.aten::ATen`` node calling the entry's PyTorch op, with the arguments
its ``args`` maps from the node's inputs and attributes (constants as the ATen bridge encodes them).
ORT then runs the op through the ATen bridge, and its gradient is the bridge's vjp: PyTorch's
autograd of the same op (``bridge/aten.py``). An entry whose ``args`` returns None leaves the node
to ORT. Training graphs only (an inference graph keeps ORT's kernels); the output keeps the
replaced value's inferred type and shape.
"""

from __future__ import annotations

import onnx_ir as ir

from ..bridge.aten import ATEN_DOMAIN
from ..errors import PassError
from ..registry import GRADIENTS, OnnxViaTorch, constant_array
from ._build import NodeBuilder

_ONNX = ("", "ai.onnx")


def _torch_op(name: str, node: ir.Node, args: list) -> str:
    """The op for this node: Resize and AveragePool pick theirs by mode and rank."""
    if name == "upsample":
        from ..registry import _resize_op

        return _resize_op(node)[0]
    if name == "avg_pool":
        return f"avg_pool{len(args[1])}d"
    if name == "layer_norm" and len(node.outputs) > 1:
        return "native_layer_norm"
    if name == "max_pool":
        return f"max_pool{len(args[1])}d"
    return name


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
    b.replace(graph, node, list(aten.outputs))
    return aten


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
            if entry is None or self.device_type not in entry.devices:
                continue
            if replace_with_torch(graph, node, entry) is not None:
                self.rewritten[node.op_type] = self.rewritten.get(node.op_type, 0) + 1
        return ir.passes.PassResult(model, modified=bool(self.rewritten))
