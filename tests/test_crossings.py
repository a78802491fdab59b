"""Every tensor crossing into ORT is dense or copied: user inputs, output gradients, autograd.Function
(PythonOp) arguments and results, ATen-bridge arguments and results. Each crossing is fed transposed,
expanded (stride 0), sliced (storage offset) and channels-last tensors, compared with eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import check_parity
from torch import nn

pytestmark = pytest.mark.usefixtures("exporter")


def layouts(b: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The same kind of [b, 3, 4, 4] input in four memory layouts."""
    return {
        "transposed": torch.randn(b, 3, 4, 4, generator=g).transpose(2, 3),
        "expanded": torch.randn(b, 3, 4, 1, generator=g).expand(b, 3, 4, 4),
        "sliced": torch.randn(b + 1, 3, 4, 6, generator=g)[1:, :, :, 1:5],
        "channels_last": torch.randn(b, 3, 4, 4, generator=g).contiguous(memory_format=torch.channels_last),
    }


LAYOUTS = ["transposed", "expanded", "sliced", "channels_last"]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.lin = nn.Linear(4, 5)

    def forward(self, x):
        return self.lin(F.relu(self.conv(x)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_user_inputs(layout):
    check_parity(ConvNet, lambda b, g: ((layouts(b, g)[layout],), {}))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_inputs_that_require_grad(layout):
    def inputs(b, g):
        x = layouts(b, g)[layout]
        return (x.detach().requires_grad_() if layout != "expanded" else x.clone().requires_grad_(),), {}

    check_parity(ConvNet, inputs)


@pytest.mark.parametrize("kind", ["transposed", "expanded", "channels_last"])
def test_output_gradients(kind):
    """The loss makes the output's gradient non-dense: transposed, stride 0, channels-last."""

    def loss(out):
        if kind == "transposed":  # the gradient of a transpose is a transposed view
            weight = torch.arange(out[0].numel(), dtype=out.dtype).reshape(out.shape[1:]) / 50
            return (out.transpose(-1, -2) * weight).sum()
        if kind == "expanded":  # the gradient of sum() is an expanded scalar
            return out.sum()
        return (out * out.detach().contiguous(memory_format=torch.channels_last)).sum()

    class Square(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            return self.conv(x)

    check_parity(Square, lambda b, g: ((torch.randn(b, 3, 4, 4, generator=g),), {}), loss_fn=loss)


class Strided(torch.autograd.Function):
    """Returns a non-dense result and a non-dense gradient; asserts nothing about its inputs."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return (x * y).transpose(-1, -2)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        g = g.transpose(-1, -2)
        return (g * y).transpose(-1, -2).transpose(-1, -2), (g * x).expand_as(x)


class WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return Strided.apply(h.transpose(-1, -2).transpose(-1, -2), h[..., :1].expand_as(h))


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_function_arguments_and_results(layout):
    check_parity(WithFunction, lambda b, g: ((layouts(b, g)[layout],), {}))


class WithAtenViews(nn.Module):
    """ATen-bridge ops whose results are views of their inputs (diagonal) or reorder them (flip)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        d = torch.diagonal(h, 0, -2, -1)
        return h * d.unsqueeze(-1) + F.hardswish(h.transpose(-1, -2))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_aten_arguments_and_results(layout):
    check_parity(WithAtenViews, lambda b, g: ((layouts(b, g)[layout],), {}))


class Lookups(nn.Module):
    """Embedding lookups of every shape eager takes: 1-D, 2-D and 3-D ids, a padding index, a
    position table broadcast over the batch ([1, T, D] + [B, T, D]), and a tied output weight."""

    def __init__(self, ids_rank: int, padding_idx: int | None) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 6, padding_idx=padding_idx)
        self.pos = nn.Embedding(16, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.tok.weight  # tied
        self.ids_rank = ids_rank

    def forward(self, ids):
        h = self.tok(ids)
        if self.ids_rank >= 2:
            t = ids.shape[-1]
            h = h + self.pos(torch.arange(t).unsqueeze(0))
        return self.out(h)


def _ids(rank: int):
    def make(b, g):
        shape = {1: (b * 3,), 2: (b, 3 + b % 3), 3: (b, 2, 3 + b % 3)}[rank]
        return (torch.randint(0, 11, shape, generator=g),), {}

    return make


@pytest.mark.parametrize("rank", [1, pytest.param(2, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("padding_idx", [None, 0], ids=["no_padding", "padding"])
def test_embedding_lookups(rank, padding_idx):
    check_parity(lambda: Lookups(rank, padding_idx), _ids(rank))
