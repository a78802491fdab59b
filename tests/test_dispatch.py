"""dispatch.py and the integration seam: a call's GraphKey names its parts, and an integration that
takes calls over learns from the step's outcome whether the call fell back to PyTorch (the public
``integrations.Step``/``StepOutcome`` protocol, instead of reading the wrapper's private state)."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import assert_close
from test_fallback_per_signature import EvalPathUnbuildable
from torch import nn

import ortwrap.integrations as integrations
from ortwrap import FallbackWarning, ORTWrap
from ortwrap.dispatch import GraphKey
from ortwrap.errors import ExportError


class _Recorder(integrations.Integration):
    """Takes over every call of a wrapper marked with ``_recorded_by_test`` and records its outcome."""

    name = "test-recorder"

    def __init__(self, refuse: bool = False) -> None:
        self.outcomes: list[tuple[bool, bool]] = []  # (fell_back_before, fell_back)
        self.refuse = refuse

    def applies(self, wrapper: integrations.Wrapper) -> bool:
        return "_recorded_by_test" in wrapper.__dict__

    def step(self, wrapper: integrations.Wrapper, step: integrations.Step) -> object:
        if self.refuse:
            return step.fall_back(ExportError("the test integration cannot take this call over"))
        before = step.fell_back_before
        outcome = step.run()
        self.outcomes.append((before, outcome.fell_back))
        return outcome.output


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(integrations, "_STEPPING", (rec, *integrations._STEPPING))
    return rec


def test_step_outcome_says_which_calls_fell_back(recorder, exporter):
    torch.manual_seed(0)
    eager = EvalPathUnbuildable()
    ours = ORTWrap(copy.deepcopy(eager), exporter=exporter)
    ours.__dict__["_recorded_by_test"] = True
    x = torch.randn(5, 6)

    out = ours(x)  # training: built and run on ORT
    assert_close(out, eager(x), "training output")
    assert ours.export_count >= 1 and ours.programs()[0].runs == 1
    ours.eval()
    eager.eval()
    with torch.no_grad(), pytest.warns(FallbackWarning):
        out = ours(x)  # the eval path cannot be built: this call falls back
    assert_close(out, eager(x), "fallen-back output")
    with torch.no_grad():
        # A signature that fell back runs in PyTorch before the integration is asked.
        assert_close(ours(x), eager(x), "second fallen-back output")
    ours.train()
    eager.train()
    assert_close(ours(x), eager(x), "training output after the fallback")
    assert recorder.outcomes == [(False, False), (False, True), (True, False)]


def test_step_fall_back_makes_the_signature_fall_back(monkeypatch):
    rec = _Recorder(refuse=True)
    monkeypatch.setattr(integrations, "_STEPPING", (rec,))
    torch.manual_seed(0)
    eager = nn.Linear(4, 3)
    ours = ORTWrap(copy.deepcopy(eager))
    ours.__dict__["_recorded_by_test"] = True
    x = torch.randn(2, 4)
    with pytest.warns(FallbackWarning, match="the test integration cannot take this call over"):
        assert_close(ours(x), eager(x), "output")
    assert isinstance(ours.fallback_reason, ExportError) and ours.export_count == 0 and not ours.programs()


def test_graph_key_names_its_parts():
    w = ORTWrap(nn.Linear(4, 3))
    x = torch.randn(2, 4)
    key, leaves, in_spec = w._dispatch.signature((x,), {})
    assert isinstance(key, GraphKey) and leaves == [x] and in_spec is None
    assert key.training and key.needs_grad and key.structure == 1 and key.autocast is None
    assert key.tensors == ((2, torch.float32, torch.device("cpu"), False),)
    assert key.params_requires_grad == (True, True)
    with torch.no_grad():
        key2 = w._dispatch.signature((x,), {})[0]
    assert not key2.needs_grad and key2.params_requires_grad == () and key2 != key
    assert hash(key) == hash(tuple(key))  # a tuple to the program table: NamedTuple costs nothing per step
