"""Inputs and outputs: structures, keyword arguments, constants, inputs requiring grad.

Runs on whichever engine the venv resolves (``ORT_EXTRA=ort make test`` runs it on ``"onnxruntime"``):
outputs and every gradient are compared with eager on both; on that engine each int argument stays a
constant of its own build (int promotion is the training engine's: docs/engines.md)."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch
from parity import check_parity, signature_builds
from torch import nn

from ortwrap.engines import is_training_available

#: The engine ORTWrap resolves here is "onnxruntime" (the venv has no training build).
ON_ENGINE = not is_training_available()
pytestmark = pytest.mark.usefixtures("exporter", "one_exporter_on_the_engine")
#: On the onnxruntime engine, three of the int-argument tests (which there only repeat the first's
#: point: no int promotion) are slow: `.venv-ort/bin/python -m pytest -m slow tests/test_io.py`.
ENGINE_SLOW = pytest.mark.slow if ON_ENGINE else (lambda f: f)


class DictTupleKwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, batch, pair, *, scale: float = 1.0, bias=None, use_b: bool = True):
        h = torch.tanh(self.a(batch["x"]) + pair[0] * pair[1][0]) * scale
        if bias is not None:
            h = h + bias
        out = {"h": h, "aux": [h.sum(dim=-1), (h * 2,)]}
        if use_b:
            out["y"] = self.b(h)
        return out


def test_dict_tuple_and_kwargs_io():
    def inputs(b, g):
        batch = {"x": torch.randn(b, 6, generator=g), "unused": torch.randn(2, generator=g)}
        pair = (torch.randn(b, 6, generator=g), [torch.randn(6, generator=g)])
        return (batch, pair), {"scale": 0.5, "bias": torch.randn(6, generator=g), "use_b": True}

    w = check_parity(DictTupleKwargs, inputs)
    builds, most = signature_builds(w)
    assert 1 <= builds <= most, "only the batch size changes: no new build beyond the engine's allowance"


Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass
class Output:
    """Shaped like transformers' ModelOutput: optional fields, some left None."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    hidden: Pair | None = None
    attentions: torch.Tensor | None = None


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, 8)
        self.l2 = nn.Linear(8, 4)

    def forward(self, x, labels=None):
        h = torch.relu(self.l1(x))
        logits = self.l2(h)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return Output(logits=logits, loss=loss, hidden=Pair(h, h * 3))


def test_dataclass_and_namedtuple_output():
    def inputs(b, g):
        return (torch.randn(b, 5, generator=g),), {"labels": torch.randint(0, 4, (b,), generator=g)}

    check_parity(DataclassOut, inputs, loss_fn=lambda out: out.loss + out.hidden.right.sum() * 0.01)


def test_model_output_from_transformers_is_rebuilt():
    from transformers.modeling_outputs import CausalLMOutput

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            y = self.l(x)
            return CausalLMOutput(loss=y.square().mean(), logits=y)

    w = check_parity(M, lambda b, g: ((torch.randn(b, 4, generator=g),), {}), loss_fn=lambda out: out.loss)
    out = w(torch.randn(2, 4))
    assert isinstance(out, CausalLMOutput) and out.attentions is None and out["logits"].shape == (2, 4)


class IntOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 3)

    def forward(self, x):
        y = self.l(x)
        return y, y.argmax(dim=-1), y > 0


def test_integer_and_bool_outputs_have_no_grad():
    w = check_parity(IntOutputs, lambda b, g: ((torch.randn(b, 4, generator=g),), {}))
    y, idx, pos = w(torch.randn(3, 4))
    assert y.requires_grad
    assert idx.dtype == torch.int64 and not idx.requires_grad
    assert pos.dtype == torch.bool and not pos.requires_grad


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.l(x) * y + x.exp()


def test_inputs_requiring_grad_get_grad():
    def inputs(b, g):
        return (torch.randn(b, 4, generator=g).requires_grad_(), torch.randn(b, 4, generator=g).requires_grad_()), {}

    check_parity(TwoInputs, inputs)


def test_only_some_inputs_require_grad():
    def inputs(b, g):
        return (torch.randn(b, 4, generator=g), torch.randn(b, 4, generator=g).requires_grad_()), {}

    check_parity(TwoInputs, inputs)


def test_same_tensor_returned_twice_and_input_returned():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(3, 3)

        def forward(self, x, passthrough):
            y = self.l(x)
            return y, y, passthrough

    check_parity(M, lambda b, g: ((torch.randn(b, 3, generator=g), torch.arange(b)), {}))


class StepScaled(nn.Module):
    """``step`` feeds arithmetic (a value); ``n`` is a loop count (it decides the graph's structure)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, step: int, n: int = 2):
        y = self.lin(x) * (step + 1) - step / 10
        for _ in range(n):
            y = torch.tanh(y) * 1.5
        return y


def _steps(calls):
    import copy

    from parity import assert_close

    from ortwrap import ORTWrap

    torch.manual_seed(0)
    eager = StepScaled()
    ours = copy.deepcopy(eager)
    w = ORTWrap(ours, fallback=False, exporter=__import__("parity").EXPORTER)
    for i, (step, n) in enumerate(calls):
        x = torch.randn(3 + i % 2, 4)
        y, expected = w(x, step, n=n), eager(x, step, n=n)
        assert_close(y.detach(), expected.detach(), f"call {i} (step={step}, n={n})")
        y.sum().backward()
        expected.sum().backward()
        for (name, p), (_, q) in zip(ours.named_parameters(), eager.named_parameters()):
            assert_close(p.grad, q.grad, f"call {i} grad of {name}")
    return w


def _builds_per_int_values(w, calls) -> bool:
    """On the onnxruntime engine (no int promotion: docs/engines.md), each distinct int argument set is
    a constant of its own build family: the engine's builds are keyed by exactly those."""
    families = {key[2] for key in w._engine._compiled}  # (the key's input structure, constants included)
    return len(families) == len(set(calls))


def test_an_int_that_changes_every_call_is_a_graph_input():
    """The second value of ``step`` builds a graph that takes it as a 0-d int64 input (checked
    against eager at both values); later values reuse it."""
    calls = [(1, 2), (2, 2), (3, 2), (10, 2), (7, 2)]
    w = _steps(calls)
    if ON_ENGINE:  # (int promotion and programs() are the training engine's: each value set its own build)
        assert _builds_per_int_values(w, calls)
        return
    assert len(w.programs()) == 2  # step=1 as a constant, then step as an input


@ENGINE_SLOW
def test_an_int_that_decides_a_loop_count_stays_a_constant():
    """``range(n)`` cannot read a graph input: each ``n`` is its own export, and each is right."""
    calls = [(1, 2), (1, 3), (1, 2), (1, 4), (1, 3)]
    w = _steps(calls)
    if ON_ENGINE:  # (int promotion and programs() are the training engine's: each value set its own build)
        assert _builds_per_int_values(w, calls)
        return
    assert len(w.programs()) == 3  # n = 2, 3, 4 (the attempt to feed n was dropped)


@ENGINE_SLOW
def test_ints_fed_and_ints_kept_constant_mix():
    """``step`` becomes an input; a new ``n`` then builds a graph of its own that still takes ``step``."""
    calls = [(1, 2), (2, 2), (3, 3), (4, 3), (5, 2)]
    w = _steps(calls)
    if ON_ENGINE:  # (int promotion and programs() are the training engine's: each value set its own build)
        assert _builds_per_int_values(w, calls)
        return
    assert len(w.programs()) == 3  # step=1 constant; step fed with n=2; step fed with n=3


@ENGINE_SLOW
def test_a_value_int_is_fed_even_when_it_first_changed_with_a_loop_count():
    """``step`` and ``n`` change together on the second call (no promotion: ``n`` cannot be fed);
    when ``step`` then changes alone it becomes an input."""
    calls = [(1, 2), (2, 3), (3, 3), (4, 3), (5, 3)]
    w = _steps(calls)
    if ON_ENGINE:  # (int promotion and programs() are the training engine's: each value set its own build)
        assert _builds_per_int_values(w, calls)
        return
    assert len(w.programs()) == 3  # (1, 2) and (2, 3) as constants; step fed with n=3
