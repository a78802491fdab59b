"""ortwrap's max_pool CPU kernel (ONNX MaxPool over 2 spatial dimensions, floor mode, without the int64 indices
ORT's gradient adds): parity with eager through both exporters over kernel sizes, strides, paddings and
dilations, the graph holds the kernel and not MaxPool/MaxPoolGrad; the kernel and its backward against PyTorch's
max_pool2d bit for bit on inputs full of ties, NaNs and -inf (which of equal maxima gets the gradient); the
MaxPools it leaves to ORT (indices read, ceil mode, 1-D) still train like eager; a clear error for bad params."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity import check_parity
from test_native_kernels import F32, aten_session, native_ops, run_raising
from torch import nn


class PoolNet(nn.Module):
    """Conv -> ReLU -> MaxPool -> conv: the pool's input and output gradients both matter, and ReLU's zeros
    make ties in the windows."""

    def __init__(self, pool: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, 5, 3, padding=1)
        self.pool = pool
        self.out = nn.Conv2d(5, 2, 1)

    def forward(self, x):
        return self.out(self.pool(torch.relu(self.inp(x))))


# name: (pool, input spatial size); every one becomes max_pool (floor mode, indices unread)
CASES = {
    "k2": (lambda: nn.MaxPool2d(2), (8, 10)),
    "k2_odd_size": (lambda: nn.MaxPool2d(2), (9, 7)),
    "k3_s2_p1": (lambda: nn.MaxPool2d(3, stride=2, padding=1), (11, 9)),  # ResNet's stem pool
    "k3_s1_overlap": (lambda: nn.MaxPool2d(3, stride=1), (6, 7)),
    "k3_dilation2": (lambda: nn.MaxPool2d(3, stride=1, dilation=2), (9, 8)),
    "k2x3_s1x2_p1x0": (lambda: nn.MaxPool2d((2, 3), stride=(1, 2), padding=(1, 0)), (7, 9)),
}


@pytest.mark.usefixtures("exporter")
@pytest.mark.parametrize("name", list(CASES))
def test_max_pool_parity_on_the_kernel(name):
    make_pool, size = CASES[name]

    def inputs(b, g):
        return (torch.randn(b, 3, *size, generator=g).requires_grad_(),), {}

    wrapped = check_parity(lambda: PoolNet(make_pool()), inputs, batch_sizes=(4, 3, 1), lr=0.01)
    ops = native_ops(wrapped.last_artifacts.graph.model())
    assert ops["max_pool"] == 1 and ops["max_pool_backward"] == 1, ops
    assert ops["MaxPool"] == 0 and ops["MaxPoolGrad"] == 0, ops


class Pool1d(nn.Module):
    """A 1-D max pool of a flattened feature map: under TorchScript the flattened length is not known
    statically, where ORT 1.19.2's MaxPoolGrad wrote past its result (a segfault)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool1d(3, stride=2, padding=1)
        self.out = nn.Conv1d(4, 2, 1)

    def forward(self, x):
        return self.out(self.pool(torch.relu(self.inp(x)).flatten(2)))


@pytest.mark.usefixtures("exporter")
def test_max_pool_1d_of_an_unsized_input_on_the_kernel():
    def inputs(b, g):
        return (torch.randn(b, 3, 7, 9, generator=g).requires_grad_(),), {}

    wrapped = check_parity(Pool1d, inputs, batch_sizes=(2, 3), lr=0.01)
    ops = native_ops(wrapped.last_artifacts.graph.model())
    assert ops["max_pool"] == 1 and ops["max_pool_backward"] == 1 and ops["MaxPoolGrad"] == 0, ops


class LeftToORT(nn.Module):
    """MaxPools the kernel leaves alone: indices read (a gather by them), ceil mode in 2-D, and in 1-D on a
    flattened input (under TorchScript its length is unknown: PyTorch's max_pool1d, not ORT's MaxPoolGrad)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.ceil = nn.MaxPool2d(2, ceil_mode=True)
        self.pool1d = nn.MaxPool1d(3, stride=2, ceil_mode=True)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        p, i = self.pool(h)
        picked = h.flatten(2).gather(2, i.flatten(2)) * 2  # [B, C, 12]
        c = self.pool1d(self.ceil(h).flatten(2))  # 7x9 -> 4x5 -> 10
        return self.out(p.mean((2, 3)) + picked.mean(2) + c.mean(2))


def test_max_pools_the_kernel_does_not_cover_train_like_eager(exporter):
    def inputs(b, g):
        return (torch.randn(b, 3, 7, 9, generator=g).requires_grad_(),), {}

    wrapped = check_parity(LeftToORT, inputs, batch_sizes=(2, 3), lr=0.01)
    ops = native_ops(wrapped.last_artifacts.graph.model())
    assert ops["max_pool"] == 0 and ops["MaxPool"] >= 2, ops
    assert ops["max_pool1d"] == (1 if exporter == "torchscript" else 0), ops


def _kernels(x: torch.Tensor, dy: torch.Tensor, params: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, dx) of max_pool and max_pool_backward in ORT sessions (x of rank 3 or 4)."""
    dims = ["n", "c", "h", "w"][-x.dim() :]
    fwd = aten_session("max_pool", [("x", F32, dims)], [("y", F32, dims)], consts=[("params", params)])
    bwd = aten_session(
        "max_pool_backward", [("dy", F32, dims), ("x", F32, dims)], [("dx", F32, dims)], consts=[("params", params)]
    )
    (y,) = run_raising(fwd, {"x": x.numpy()})
    (dx,) = run_raising(bwd, {"dy": dy.numpy(), "x": x.numpy()})
    return torch.from_numpy(y), torch.from_numpy(dx)


def _pool_pair(x: torch.Tensor, dy: torch.Tensor, kernel, stride, padding, dilation):
    """(y, dx) of the kernels (:func:`_kernels`), and of PyTorch's max_pool2d."""
    params = np.array([*kernel, *stride, padding[0], padding[1], padding[0], padding[1], *dilation], dtype=np.int64)
    y, dx = _kernels(x, dy, params)
    xr = x.clone().requires_grad_()
    ref = nn.functional.max_pool2d(xr, kernel, stride, padding, dilation)
    ref.backward(dy)
    return y, dx, ref.detach(), xr.grad


@pytest.mark.parametrize(
    "kernel,stride,padding,dilation",
    [((2, 2), (2, 2), (0, 0), (1, 1)), ((3, 3), (2, 2), (1, 1), (1, 1)), ((3, 2), (1, 1), (1, 0), (2, 1))],
    ids=str,
)
def test_max_pool_kernels_match_pytorch_on_ties_nans_and_infinities(kernel, stride, padding, dilation):
    """Bit for bit: y, and dx (which of equal maxima, which NaN, which all -inf window element gets the
    gradient; overlapping windows add theirs in PyTorch's order)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (3, 4, 13, 12), generator=g).float()  # five values: ties in most windows
    x[0, 0, :4, :4] = -torch.inf  # whole windows of -inf
    x[1, 1].view(-1)[::7] = torch.nan
    x[2, 2].view(-1)[::5] = torch.inf
    dy_shape = nn.functional.max_pool2d(x, kernel, stride, padding, dilation).shape
    dy = torch.randn(dy_shape, generator=g)
    y, dx, ref, ref_dx = _pool_pair(x, dy, kernel, stride, padding, dilation)
    torch.testing.assert_close(y, ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(dx, ref_dx, atol=0, rtol=0)


def test_max_pool_1d_kernels_match_pytorch_on_ties_and_nans():
    """A 1-D pool (x [N, C, W]; params of a 2-D pool over H = 1) against max_pool1d, bit for bit."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-1, 2, (2, 3, 41), generator=g).float()
    x[1, 2, ::6] = torch.nan
    kernel, stride, pad = 4, 3, 2
    params = np.array([1, kernel, 1, stride, 0, pad, 0, pad, 1, 1], dtype=np.int64)
    ref = nn.functional.max_pool1d(x.clone().requires_grad_(), kernel, stride, pad)
    dy = torch.randn(ref.shape, generator=g)
    xr = x.clone().requires_grad_()
    nn.functional.max_pool1d(xr, kernel, stride, pad).backward(dy)
    y, dx = _kernels(x, dy, params)
    torch.testing.assert_close(y, ref.detach(), atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(dx, xr.grad, atol=0, rtol=0)


def test_max_pool_kernels_match_pytorch_on_a_large_input():
    """Many planes in several chunks, a plane larger than a chunk."""
    g = torch.Generator().manual_seed(1)
    for shape in ((2, 37, 24, 20), (1, 1, 301, 257)):
        x = torch.randn(shape, generator=g)
        dy = torch.randn(shape[0], shape[1], shape[2] // 2, shape[3] // 2, generator=g)
        y, dx, ref, ref_dx = _pool_pair(x, dy, (2, 2), (2, 2), (0, 0), (1, 1))
        torch.testing.assert_close(y, ref, atol=0, rtol=0)
        torch.testing.assert_close(dx, ref_dx, atol=0, rtol=0)


@pytest.mark.parametrize(
    "x_shape,params,message",
    [
        ((1, 2, 4, 4), [0, 2, 2, 2, 0, 0, 0, 0, 1, 1], "must be positive"),
        ((1, 2, 4, 4), [2, 2, 2, 2], "params must hold 10 values"),
        ((1, 2, 2, 2), [3, 3, 1, 1, 0, 0, 0, 0, 1, 1], "larger than the padded"),
        ((2, 4, 4), [2, 2, 2, 2, 0, 0, 0, 0, 1, 1], "a 1-D pool .x of rank 3. takes kernel, stride and dilation 1"),
        ((1, 2, 4, 4, 4), [2, 2, 2, 2, 0, 0, 0, 0, 1, 1], "rank 4 .N, C, H, W. or 3"),
    ],
)
def test_max_pool_kernel_rejects_bad_params(x_shape, params, message):
    dims = [f"d{i}" for i in range(len(x_shape))]
    sess = aten_session(
        "max_pool", [("x", F32, dims)], [("y", F32, dims)], consts=[("params", np.array(params, dtype=np.int64))]
    )
    with pytest.raises(RuntimeError, match="max_pool: .*" + message):
        run_raising(sess, {"x": np.zeros(x_shape, dtype=np.float32)})
