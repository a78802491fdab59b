"""ConvTranspose with kernel == stride (a UNet's 2x2 up-convolution) trains as a MatMul and a pixel
shuffle that ORT differentiates (``passes/conv_transpose_matmul.py``), not as PyTorch's transposed
convolution: outputs and every parameter gradient against eager, float32 and bf16 autocast, 1-D to 3-D,
batch sizes that change between steps, and the ConvTransposes the rewrite must leave alone."""

from __future__ import annotations

import onnx_ir as ir
import pytest
import torch
from parity import check_parity
from test_aten import aten_ops_in
from torch import nn

from ortwrap.engines import resolve
from ortwrap.passes.conv_transpose_matmul import ConvTransposeToMatMulPass, matmul_form

TRAINING_ENGINE = resolve("auto") == "training"
needs_training_engine = pytest.mark.skipif(not TRAINING_ENGINE, reason="the rewrite is the training engine's")


class UpThen(nn.Module):
    """Conv -> ConvTranspose -> Conv: parameters on both sides of the up-convolution."""

    def __init__(self, up: nn.Module, dims: int, c: int = 4) -> None:
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        self.a = conv(3, c, 3, padding=1)
        self.up = up
        self.b = conv(up.out_channels, 2, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.up(self.a(x))))


def _img(dims: int, hw: int):
    return lambda b, g: ((torch.randn(b, 3, *([hw] * dims), generator=g),), {})


def _ops(wrapped) -> list[str]:
    """The built graph's op types and its ATen nodes' operators."""
    return [n.op_type for n in wrapped.last_artifacts.graph.model().graph.node] + aten_ops_in(wrapped)


REWRITTEN = {
    "1d_k2": (lambda: nn.ConvTranspose1d(4, 5, 2, stride=2), 1, 6),
    "2d_k2": (lambda: nn.ConvTranspose2d(4, 6, 2, stride=2), 2, 5),
    "2d_k3x2_no_bias": (lambda: nn.ConvTranspose2d(4, 3, (3, 2), stride=(3, 2), bias=False), 2, 4),
    "3d_k2": (lambda: nn.ConvTranspose3d(4, 3, 2, stride=2), 3, 3),
}


@needs_training_engine
@pytest.mark.parametrize("name", list(REWRITTEN))
def test_kernel_equal_to_stride_trains_as_a_matmul(name):
    make, dims, hw = REWRITTEN[name]
    w = check_parity(lambda: UpThen(make(), dims), _img(dims, hw), wrap_options={"build_cache": False})
    ops = _ops(w)
    assert "ConvTranspose" not in ops and "ortwrap_ops::conv_transpose" not in ops, ops
    assert "MatMul" in ops or "Gemm" in ops, ops


@needs_training_engine
@pytest.mark.parametrize("route", ["native", "float32"])
def test_bf16_autocast_up_convolution_matches_eager(route):
    """Under bf16 autocast the rewrite's MatMul is a bf16 GEMM (PyTorch's on the native route), as
    eager's transposed convolution is; bf16's rounding is the tolerance (test_mixed_precision.BF16)."""
    w = check_parity(
        lambda: UpThen(nn.ConvTranspose2d(4, 6, 2, stride=2), 2),
        _img(2, 6),
        autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        lr=0.01,
        atol=3e-2,
        rtol=3e-2,
        wrap_options={"build_cache": False, "half_compute": route},
    )
    ops = _ops(w)
    assert "ConvTranspose" not in ops and "ortwrap_ops::conv_transpose" not in ops, ops


LEFT_ALONE = {
    "padding_output_padding": lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1),
    "kernel_larger_than_stride": lambda: nn.ConvTranspose2d(4, 4, 4, stride=2),
    "groups": lambda: nn.ConvTranspose2d(4, 4, 2, stride=2, groups=2),
    "dilation": lambda: nn.ConvTranspose2d(4, 4, 2, stride=2, dilation=2),
}


@needs_training_engine
@pytest.mark.parametrize("name", list(LEFT_ALONE))
def test_other_transposed_convolutions_stay_pytorchs(name):
    # (atol: the bias gradient sums ~400 terms that cancel to ~0.03; float32 rounding shows at 1e-5)
    w = check_parity(lambda: UpThen(LEFT_ALONE[name](), 2), _img(2, 5), atol=1e-4, wrap_options={"build_cache": False})
    assert "ortwrap_ops::conv_transpose" in _ops(w)


def _node(**attrs) -> ir.Node:
    x = ir.Value(name="x", shape=ir.Shape(["n", 4, 5, 5]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", shape=ir.Shape([4, 6, 2, 2]), type=ir.TensorType(ir.DataType.FLOAT))
    return ir.node("ConvTranspose", [x, w], attributes={"kernel_shape": [2, 2], **attrs})


def test_matmul_form_reads_the_attributes():
    assert matmul_form(_node(strides=[2, 2])) == (4, 6, [2, 2])
    assert matmul_form(_node(strides=[2, 2], pads=[0, 0, 0, 0], dilations=[1, 1], group=1)) == (4, 6, [2, 2])
    assert matmul_form(_node(strides=[2, 1])) is None
    assert matmul_form(_node()) is None  # stride 1 with a 2x2 kernel: windows overlap
    assert matmul_form(_node(strides=[2, 2], pads=[1, 1, 1, 1])) is None
    assert matmul_form(_node(strides=[2, 2], output_padding=[1, 1])) is None
    assert matmul_form(_node(strides=[2, 2], output_shape=[10, 10])) is None
    assert matmul_form(_node(strides=[2, 2], auto_pad="SAME_UPPER")) is None


def test_the_pass_leaves_no_conv_transpose_and_keeps_the_output_name():
    node = _node(strides=[2, 2])
    graph = ir.Graph(node.inputs, node.outputs, nodes=[node], opset_imports={"": 18})
    node.outputs[0].name = "y"
    result = ConvTransposeToMatMulPass()(ir.Model(graph, ir_version=9))
    assert result.modified
    ops = [n.op_type for n in result.model.graph]
    assert "ConvTranspose" not in ops and ops.count("MatMul") == 1 and ops.count("Transpose") == 4, ops
    assert result.model.graph.outputs[0].name == "y"


@pytest.mark.parametrize(
    "kernel, x_shape",
    [
        ((2,), ["n", 4, "l"]),
        ((2, 2), ["n", 4, "h", "w"]),
        ((3, 2), ["n", 4, 5, "w"]),
        ((2, 3, 2), ["n", 4, "d", "h", "w"]),
    ],
)
def test_the_rewritten_graph_computes_the_transposed_convolution_at_any_size(kernel, x_shape):
    """The rewritten forward, run by ORT with sizes the graph leaves symbolic, equals PyTorch's
    ``conv_transpose{1,2,3}d`` at different sizes (the reshapes read them from ``Shape(x)``), an
    empty batch included."""
    import numpy as np
    import onnxruntime as ort
    import torch.nn.functional as F

    r = len(kernel)
    f32 = ir.TensorType(ir.DataType.FLOAT)
    x = ir.Value(name="x", shape=ir.Shape(x_shape), type=f32)
    w = ir.Value(name="w", shape=ir.Shape([4, 3, *kernel]), type=f32)
    bias = ir.Value(name="b", shape=ir.Shape([3]), type=f32)
    node = ir.node("ConvTranspose", [x, w, bias], attributes={"kernel_shape": list(kernel), "strides": list(kernel)})
    node.outputs[0].name = "y"
    graph = ir.Graph([x, w, bias], node.outputs, nodes=[node], opset_imports={"": 18})
    model = ConvTransposeToMatMulPass()(ir.Model(graph, ir_version=9)).model
    assert "ConvTranspose" not in [n.op_type for n in model.graph]
    session = ort.InferenceSession(
        ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    g = torch.Generator().manual_seed(0)
    wt, bt = torch.randn(4, 3, *kernel, generator=g), torch.randn(3, generator=g)
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[r - 1]
    for batch, sizes in ((2, [2, 5, 3, 4][:r]), (3, [3, 4, 6, 2][:r]), (0, [2, 3, 4, 5][:r])):  # and an empty batch
        sizes = [d if isinstance(d, int) else s for d, s in zip(x_shape[2:], sizes)]
        xt = torch.randn(batch, 4, *sizes, generator=g)
        (y,) = session.run(None, {"x": xt.numpy(), "w": wt.numpy(), "b": bt.numpy()})
        expected = conv(xt, wt, bt, stride=kernel).numpy()
        assert y.shape == expected.shape
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
