"""Fallback is per input signature: a build (or a program's first run) that fails for one graph key
(eval-mode inference, a call with an optional argument) runs those calls in PyTorch, said once, and
every other key keeps building and training on ONNX Runtime with eager's loss and gradients."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from parity import assert_close
from torch import nn

from ortwrap import FallbackWarning, ORTWrap
from ortwrap.errors import ExportError, RuntimeRunError


class ReturnsInt(torch.autograd.Function):
    """A Function with a non-tensor output: it cannot run inside ONNX Runtime."""

    @staticmethod
    def forward(ctx, x):
        return x * 2, 3

    @staticmethod
    def backward(ctx, g, _):
        return g * 2


class EvalPathUnbuildable(nn.Module):
    """Trains on ORT; its eval-mode path (an inference-only head, as in ``generate``) cannot be built."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.int_head = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if not self.training and self.int_head:
            h, k = ReturnsInt.apply(h)
            h = h * k
        return self.b(h)


def _train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.detach()


def _assert_grads(ours: nn.Module, eager: nn.Module, what: str) -> None:
    for (n, p), q in zip(eager.named_parameters(), ours.parameters()):
        if p.grad is None:  # (a parameter this call does not use)
            assert q.grad is None, f"{n}.grad ({what})"
        else:
            assert_close(q.grad, p.grad, f"{n}.grad ({what})")


@pytest.mark.usefixtures("exporter")
def test_an_inference_signature_that_cannot_build_leaves_training_on_ort(exporter):
    torch.manual_seed(0)
    eager = EvalPathUnbuildable()
    ours = ORTWrap(copy.deepcopy(eager), exporter=exporter)
    batches = [(torch.randn(5, 6), torch.randn(5, 3)) for _ in range(4)]

    loss = _train_step(ours, *batches[0])
    assert_close(loss, _train_step(eager, *batches[0]), "loss before the fallback")
    _assert_grads(ours, eager, "before the fallback")
    exports = ours.export_count
    (training,) = ours.programs()
    assert training.with_backward and training.runs == 1

    ours.eval()
    eager.eval()
    with torch.no_grad():
        with pytest.warns(FallbackWarning, match=r"eval-mode calls without gradients \(inference\) on inputs "
                          r"\(x: float32 2-d on cpu\).*ReturnsInt") as record:  # fmt: skip
            out = ours(batches[1][0])
    assert len([w for w in record if issubclass(w.category, FallbackWarning)]) == 1
    assert_close(out, eager(batches[1][0]), "the fallen-back inference call")
    assert isinstance(ours.fallback_reason, ExportError)
    exports_after_failure = ours.export_count
    assert exports_after_failure > exports  # the failed build is counted

    ours.train()
    eager.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, for either signature
        for x, y in batches[2:]:
            loss = _train_step(ours, x, y)
            assert_close(loss, _train_step(eager, x, y), "loss after the fallback")
            _assert_grads(ours, eager, "after the fallback")
            ours.eval()
            eager.eval()
            with torch.no_grad():
                assert_close(ours(x), eager(x), "inference after the fallback")
            ours.train()
            eager.train()
    # the training graph is the same program, and it ran; the failed key was not built again
    assert ours.programs() == [training] and training.runs == 3
    assert ours.export_count == exports_after_failure


class OptionalSmoothing(nn.Module):
    """Builds and runs on ORT without ``skip``; with it, the graph holds an ATen node that the
    TorchScript export writes but that fails at run time (torch's symbolic of ``norm(p="nuc")``
    passes PyTorch's op a list where it wants a number): the program fails its first run. (If that
    export is ever fixed, swap in another such op, as tests/test_robustness.py's NuclearNorm.)"""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x, skip=None):
        h = self.c(x)
        if skip is None:
            return h
        return h, torch.norm(self.c(skip).flatten(0, 1).flatten(1), p="nuc")


def test_an_optional_argument_whose_program_fails_its_first_run_falls_back_alone():
    torch.manual_seed(0)
    eager = OptionalSmoothing()
    ours = ORTWrap(copy.deepcopy(eager), exporter="torchscript")

    def step(x, skip=None):
        results = []
        for model in (ours, eager):
            model.zero_grad()
            out = model(x) if skip is None else sum(model(x, skip=skip)[i].square().sum() for i in (0, 1))
            out.square().mean().backward()
            results.append(out.detach())
        assert_close(results[0], results[1], "output")
        _assert_grads(ours, eager, "step")

    step(torch.randn(2, 3, 8, 8))
    (plain,) = ours.programs()
    with pytest.warns(FallbackWarning, match=r"training-mode calls with gradients on inputs \(x: float32 4-d on cpu, "
                      r"skip: float32 4-d on cpu\).*runtime phase failed") as record:  # fmt: skip
        step(torch.randn(2, 3, 8, 8), torch.randn(2, 3, 16, 16))
    assert len([w for w in record if issubclass(w.category, FallbackWarning)]) == 1
    assert isinstance(ours.fallback_reason, RuntimeRunError)
    exports = ours.export_count
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            step(torch.randn(2, 3, 8, 8))  # on ORT
            step(torch.randn(2, 3, 8, 8), torch.randn(2, 3, 16, 16))  # in PyTorch, no new build or warning
    assert ours.programs() == [plain] and plain.runs == 3
    assert ours.export_count == exports


def test_copies_and_module_changes_try_a_failed_signature_again():
    torch.manual_seed(0)
    ours = ORTWrap(EvalPathUnbuildable()).eval()
    x = torch.randn(4, 6)
    with torch.no_grad(), pytest.warns(FallbackWarning):
        ours(x)
    assert ours.fallback_reason is not None
    clone = copy.deepcopy(ours)
    assert clone.fallback_reason is None  # a new wrapper: nothing compiled, nothing failed
    with torch.no_grad(), pytest.warns(FallbackWarning, match="eval-mode"):
        assert_close(clone(x), ours.module(x), "the copy's inference")

    # a change through the wrapper rebuilds what may read it, and tries the failed key again (here
    # the change is what fixes it)
    ours.int_head = False
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(ours(x), ours.module(x), "after the change")
    assert len(ours.programs()) == 1 and ours.programs()[0].runs == 1
