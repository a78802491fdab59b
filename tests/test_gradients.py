"""Gradients ORT 1.19.2 lacks, defined through ortwrap's gradient registry (``ortwrap/registry.py``).

Each op runs as PyTorch's op inside the graph and is differentiated by PyTorch's autograd. Every
case trains with parameters before and after the op and compares outputs and every gradient with
eager, under both exporters, with a changing batch size.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import check_parity
from torch import nn

pytestmark = pytest.mark.usefixtures("exporter")


class Pre(nn.Module):
    """Linear -> op -> Linear."""

    def __init__(self, op, d: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.op = op
        self.b = nn.Linear(d, 3)

    def forward(self, x):
        return self.b(self.op(self.a(x) * 2))


class Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class ConvThen(nn.Module):
    """Conv -> op -> Conv: parameters on both sides of an op on an image."""

    def __init__(self, op, dims: int = 2, c: int = 4) -> None:
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        self.a = conv(3, c, 3, padding=1)
        self.op = op
        self.b = conv(c, 2, 1)

    def forward(self, x):
        return self.b(self.op(self.a(x)))


def seq(b, g):
    return (torch.randn(b, 5, 8, generator=g),), {}


def img(dims: int, hw: int = 6, c: int = 3):
    return lambda b, g: ((torch.randn(b, c, *([hw] * dims), generator=g),), {})


ACTIVATIONS = {
    "hardswish": nn.Hardswish,
    "hardsigmoid": nn.Hardsigmoid,
    "mish": nn.Mish,
    "elu": lambda: nn.ELU(0.7),
    "selu": nn.SELU,
    "celu": lambda: nn.CELU(0.5),
    "softplus": nn.Softplus,
    "softplus_beta_threshold": lambda: nn.Softplus(beta=2.0, threshold=1.0),
    "prelu": nn.PReLU,
    "softshrink": lambda: nn.Softshrink(0.3),
    "hardshrink": lambda: nn.Hardshrink(0.3),
    "threshold": lambda: nn.Threshold(0.1, 2.0),
    "silu": nn.SiLU,
    "logsigmoid": nn.LogSigmoid,
    "softsign": nn.Softsign,
    "tanhshrink": nn.Tanhshrink,
    "relu6": nn.ReLU6,
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation(name):
    check_parity(lambda: Pre(ACTIVATIONS[name]()), seq)


def test_prelu_per_channel():
    check_parity(lambda: ConvThen(nn.PReLU(4)), img(2))


REDUCTIONS = {
    "amax": lambda x: x.amax(-1, keepdim=True) + x,
    "amin_two_dims": lambda x: x.amin((1, 2)).unsqueeze(1).unsqueeze(2) * x,
    "max_all": lambda x: x.max() + x,
    "min_all": lambda x: x.min() * x,
    "max_dim": lambda x: x.max(1).values.unsqueeze(1) + x,
    "min_dim_indices": lambda x: x + x.min(-1).values.unsqueeze(-1) * x.min(-1).indices.unsqueeze(-1).float(),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_max_min(name):
    check_parity(lambda: Pre(Fn(REDUCTIONS[name])), seq)


def test_max_min_ties():
    """Ties (ReLU zeros, repeated values) share the gradient as in eager."""
    check_parity(lambda: Pre(Fn(lambda x: F.relu(x - 3).amax(-1, keepdim=True) + x.round().amin(1, keepdim=True))), seq)


CONV_TRANSPOSE = {
    "1d_groups_dilation": (lambda: nn.ConvTranspose1d(4, 4, 3, stride=2, groups=2, dilation=2), 1, 4),
    "2d_stride_padding_output_padding": (
        lambda: nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1),
        2,
        4,
    ),
    "3d_no_bias": (lambda: nn.ConvTranspose3d(4, 2, 2, stride=2, bias=False), 3, 4),
}


@pytest.mark.parametrize("name", list(CONV_TRANSPOSE))
def test_conv_transpose(name):
    make, dims, c = CONV_TRANSPOSE[name]
    check_parity(lambda: ConvThen(make(), dims=dims, c=c), img(dims, hw=4))


def test_diagonal():
    check_parity(
        lambda: Pre(Fn(lambda x: torch.diagonal(x.reshape(x.shape[0], 5, 2, 4), 0, -2, -1).repeat(1, 1, 4))), seq
    )
