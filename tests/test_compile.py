"""torch.compile composes with ORTWrap: ``torch.compile(ORTWrap(model))`` and a compiled parent that
holds an ORTWrap train on ONNX Runtime like eager (ORTWrap runs outside the compiled graph);
``ORTWrap(torch.compile(model))`` is refused at wrap time."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import assert_close
from torch import nn

from ortwrap import ORTWrap


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


class Parent(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.pre = nn.Linear(5, 6)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.tanh(self.pre(x))) * 2


def train_like_eager(eager: nn.Module, ours: nn.Module, params: list, in_features: int) -> None:
    g = torch.Generator().manual_seed(0)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_o = torch.optim.SGD(params, lr=0.1)
    for b in (4, 7, 3):
        x = torch.randn(b, in_features, generator=g)
        out_e, out_o = eager(x), ours(x)
        assert_close(out_o.detach(), out_e.detach(), f"output, batch {b}")
        out_e.square().sum().backward()
        out_o.square().sum().backward()
        for (n, p), q in zip(eager.named_parameters(), params):
            assert_close(q.grad, p.grad, f"{n}.grad, batch {b}")
        opt_e.step()
        opt_o.step()
        opt_e.zero_grad()
        opt_o.zero_grad()


def test_compiled_wrapper_trains_on_ort_like_eager():
    eager = mlp()
    w = ORTWrap(copy.deepcopy(eager), fallback=False)
    compiled = torch.compile(w)
    train_like_eager(eager, compiled, list(w.parameters()), 6)
    assert w.fallback_reason is None and len(w.programs()) == 1


def test_compiled_parent_holding_a_wrapper_trains_on_ort_like_eager():
    eager = Parent(mlp())
    ours = Parent(ORTWrap(mlp(), fallback=False))
    compiled = torch.compile(ours, backend="eager")
    train_like_eager(eager, compiled, list(ours.parameters()), 5)
    assert ours.body.fallback_reason is None and len(ours.body.programs()) == 1


def test_wrapping_a_compiled_module_is_refused_at_wrap_time():
    with pytest.raises(TypeError, match=r"torch.compile\(ORTWrap\(model\)\)"):
        ORTWrap(torch.compile(mlp()))
    m = mlp()
    m.compile()
    with pytest.raises(TypeError, match=r"compiled with torch\.compile"):
        ORTWrap(m)
