"""Convolutions as PyTorch's (oneDNN) where that measured faster than ORT's Conv + ConvGrad.

``gemm_choice`` times each 2-D convolution shape of a CPU training graph through ORT (``Conv`` and
the ``ConvGrad`` of its gradient) and through PyTorch (``convolution`` and ``convolution_backward``,
in the graph's dtype: bf16 under autocast, as eager's), once per machine, and names the Conv
nodes where PyTorch's route wins by more than what its two ATen calls cost. This pass replaces
those nodes by ``ortwrap_ops::conv`` ATen nodes, whose gradient is the explicit
``ortwrap_ops::conv_backward`` (``convolution_backward``, no recompute of the forward).

It runs before ``HalfPrecisionOnCPUPass``: a bf16 Conv's ATen node keeps its bf16 inputs and output
(that pass leaves ATen nodes in their dtypes, with Casts around them), so it computes in bf16 as
eager autocast's convolution does, where ORT would compute it in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import onnx_ir as ir

from ..ops import OnnxViaTorch
from ..ops.mappers import _attr
from .torch_gradients import replace_with_torch

_ONNX = ("", "ai.onnx")
_BF16 = ir.DataType.BFLOAT16


def conv_args(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """``ortwrap_ops::conv``'s arguments for an ONNX Conv, or None (left to ORT) where PyTorch's op
    has no form of it: not 2-D, ``auto_pad``, asymmetric pads, unknown rank."""
    x = node.inputs[0]
    if x is None or x.shape is None or len(x.shape) != 4 or _attr(node, "auto_pad", "NOTSET") != "NOTSET":
        return None
    rank = 2
    pads = list(_attr(node, "pads", [0] * (2 * rank)))
    if pads[:rank] != pads[rank:]:
        return None
    return [
        value(0),
        value(1),
        value(2) if len(node.inputs) > 2 else None,
        list(_attr(node, "strides", [1] * rank)),
        pads[:rank],
        list(_attr(node, "dilations", [1] * rank)),
        int(_attr(node, "group", 1)),
        False,
    ]


def _conv_half_args(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    args = conv_args(node, value, b)
    return None if args is None else [*args[:-1], True]


def conv_transpose_args(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """``ortwrap_ops::conv_transpose``'s arguments for a 2-D ConvTranspose, or None (left to
    ``TorchGradientsPass``, which runs it in float32 or says why it cannot)."""
    from ..errors import PassError
    from ..ops.mappers import _conv_transpose

    x = node.inputs[0]
    if x is None or x.shape is None or len(x.shape) != 4:
        return None
    try:
        return _conv_transpose(node, value, b)
    except PassError:
        return None


#: Conv as ``ortwrap_ops::conv`` (not in ``ops.GRADIENTS``: ORT differentiates Conv; only chosen nodes)
CONV_VIA_TORCH = OnnxViaTorch(
    "Conv", "ortwrap_ops::conv", conv_args, devices=("cpu",), why="PyTorch's convolution measured faster"
)


#: a bf16 Conv as ``ortwrap_ops::conv`` computing in bf16 from float32 inputs
CONV_HALF_VIA_TORCH = OnnxViaTorch(
    "Conv", "ortwrap_ops::conv", _conv_half_args, devices=("cpu",), why="PyTorch's bf16 convolution measured faster"
)

#: a bf16 ConvTranspose as ``ortwrap_ops::conv_transpose`` before ``HalfPrecisionOnCPUPass`` (in bf16)
CONV_TRANSPOSE_VIA_TORCH = OnnxViaTorch(
    "ConvTranspose", "ortwrap_ops::conv_transpose", conv_transpose_args, devices=("cpu",),
    why="PyTorch's bf16 transposed convolution measured faster than its float32 one",
)  # fmt: skip


_ENTRIES = {"Conv": CONV_VIA_TORCH, "ConvTranspose": CONV_TRANSPOSE_VIA_TORCH}


class TorchConvOnCPUPass(ir.passes.InPlacePass):
    """Replace the Conv (and bf16 ConvTranspose) nodes that ``gemm_choice`` (the build's choice, a
    ``GemmChoice``) names in its ``torch_convs``, or ``names``, by PyTorch's convolution;
    ``rewritten``: how many."""

    def __init__(self, gemm_choice: Any = None, *, names: Iterable[str] | None = None) -> None:
        super().__init__()
        self.names = frozenset(getattr(gemm_choice, "torch_convs", ()) if names is None else names)
        self.rewritten = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.rewritten = 0
        for node in list(model.graph):
            if node.op_type not in _ENTRIES or node.domain not in _ONNX or node.name not in self.names:
                continue
            if node.op_type == "Conv" and node.outputs[0].dtype == _BF16:
                done = _half_conv(model.graph, node) is not None
            else:
                done = replace_with_torch(model.graph, node, _ENTRIES[node.op_type]) is not None
            self.rewritten += done
        return ir.passes.PassResult(model, modified=self.rewritten > 0)


def _half_conv(graph: ir.Graph, node: ir.Node) -> ir.Node | None:
    """A bf16 Conv as ``ortwrap_ops::conv(..., half=True)`` on float32 values: Casts to float32 before
    it and one to bf16 after it, which ``HalfPrecisionOnCPUPass`` then removes as no-ops (the graph is
    float32 there), so no ORT Cast runs (ORT's bf16 Casts are scalar loops; the op casts inside PyTorch)."""
    if conv_args(node, lambda i: None) is None:
        return None
    for i, v in enumerate(node.inputs[:3]):
        if v is not None and v.dtype == _BF16:
            cast = ir.node("Cast", [v], {"to": ir.DataType.FLOAT}, name=f"{node.name}/float_{i}")
            cast.outputs[0].dtype, cast.outputs[0].shape = ir.DataType.FLOAT, v.shape
            graph.insert_before(node, cast)
            node.replace_input_with(i, cast.outputs[0])
    y = node.outputs[0]
    uses = list(y.uses())
    cast = ir.node("Cast", [y], {"to": _BF16}, name=f"{node.name}/bf16")
    graph.insert_after(node, cast)
    result = cast.outputs[0]
    result.dtype, result.shape = _BF16, y.shape
    for user, index in uses:
        user.replace_input_with(index, result)
    for i, o in enumerate(graph.outputs):
        if o is y:
            graph.outputs[i] = result
    name = y.name
    y.name, y.dtype = f"{name}/float", ir.DataType.FLOAT
    result.name = name
    return replace_with_torch(graph, node, CONV_HALF_VIA_TORCH)
