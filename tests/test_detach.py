"""``detach()`` stops the gradient on ORT as in eager, under both exporters.

Both exporters write ``detach`` as ``Identity`` (or drop it), which ORT's gradient builder
differentiates through: a wrong implementation gives gradients that differ from eager's by O(1)
here (``passes/stop_gradient.py``). On the engine the venv resolves (``ON_ENGINE``: AOTAutograd's
graphs, whatever ``exporter`` says, so ``[torchscript]`` is skipped there) with the same numbers; the
assertions on ``last_artifacts`` (the training engine's build) are that engine's."""

from __future__ import annotations

import copy

import onnx
import pytest
import torch
from parity import check_parity
from torch import nn

from ortwrap import ORTWrap
from ortwrap.engines import is_training_available

EXPORTERS = ["torchscript", "dynamo"]
ON_ENGINE = not is_training_available()
pytestmark = pytest.mark.usefixtures("one_exporter_on_the_engine")


class Detached(nn.Module):
    """Every kind of detach: of a computed value, in place on a value read afterwards, of a
    parameter, and of a constant."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.l1 = nn.Linear(4, 6)
        self.l2 = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x):
        h = self.l1(x)
        if self.how == "computed":
            gate = torch.sigmoid(h).detach()  # a stop-gradient gate (straight-through style)
            h = torch.tanh(h) * gate
        elif self.how == "in_place":
            g = h * 2
            g.detach_()  # every later use of g has no gradient
            h = torch.tanh(h) * g
        elif self.how == "parameter":
            h = h * self.scale.detach() + h * self.scale  # one path with, one without a gradient
        elif self.how == "constant":
            h = h + torch.ones(6).detach()
        return self.l2(h)


def _inputs(b, g):
    return (torch.randn(b, 4, generator=g),), {}


@pytest.mark.parametrize("how", ["computed", "in_place", "parameter", "constant"])
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_detach_stops_the_gradient_like_eager(exporter, how):
    w = check_parity(lambda: Detached(how), _inputs, wrap_options={"exporter": exporter})
    if ON_ENGINE:  # (last_artifacts and its ATen detach nodes: the training engine's build)
        return
    assert w.last_artifacts.exporter == exporter
    model = onnx.load_from_string(w.last_artifacts.graph.model_bytes)
    detaches = [n for n in model.graph.node if n.op_type == "ATen" and b"detach" in n.attribute[0].s]
    # a computed value gets PyTorch's detach (a stop-gradient edge); a parameter a frozen
    # duplicate input; a constant nothing
    assert len(detaches) == (1 if how in ("computed", "in_place") else 0)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_detach_in_an_inference_graph_costs_nothing(exporter):
    torch.manual_seed(0)
    model = Detached("computed").eval()
    w = ORTWrap(model, fallback=False, exporter=exporter)
    x = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(w(x), model(x))
    if ON_ENGINE:  # (AOTAutograd's inference graph has no detach; last_artifacts is the training engine's)
        return
    built = onnx.load_from_string(w.last_artifacts.graph.model_bytes)
    assert not [n for n in built.graph.node if n.op_type == "ATen" or n.domain == "ortwrap"]


class NoGradInside(nn.Module):
    """``torch.no_grad()`` / ``set_grad_enabled(False)`` inside forward: eager's gradient stops at
    what the block computes from values that need grad. Gradients differ by O(1) if it flows."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.l1 = nn.Linear(4, 6)
        self.l2 = nn.Linear(6, 3)
        self.register_buffer("running", torch.zeros(6))

    def forward(self, x):
        h = self.l1(x)
        if self.how == "scale":
            with torch.no_grad():
                scale = h.abs().mean(-1, keepdim=True) + 1  # a statistic used as a constant
            h = h / scale
        elif self.how == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                gate = torch.sigmoid(h * 3)
            h = torch.tanh(h) * gate + h
        elif self.how == "buffer":
            with torch.no_grad():  # a running statistic updated in place, then read
                self.running.mul_(0.9).add_(h.mean(0), alpha=0.1)
            h = h - self.running
        elif self.how == "nested":
            with torch.no_grad():
                t = h * 2
                with torch.enable_grad():
                    u = t + self.l1.bias.sum()  # grad on again: reaches the bias, not h
            h = h * u
        return self.l2(h)


@pytest.mark.parametrize("how", ["scale", "set_grad_enabled", "buffer", "nested"])
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_no_grad_inside_forward_stops_the_gradient_like_eager(exporter, how):
    check_parity(lambda: NoGradInside(how), _inputs, wrap_options={"exporter": exporter})


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_spectral_norm_trains_like_eager(exporter):
    # power iteration under no_grad (out= ops, in-place u/v updates), then a dot product of vectors
    from torch.nn.utils import parametrizations

    def make():
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), parametrizations.spectral_norm(nn.Linear(6, 3)))

    w = check_parity(make, _inputs, wrap_options={"exporter": exporter})
    assert w.fallback_reason is None


class ReturnsDetached(nn.Module):
    """Detached values as outputs (a computed one, a parameter, the input), next to the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 6)

    def forward(self, x):
        h = self.l(x)
        loss = (h * h).sum() + (h * x.detach().sum(-1, keepdim=True)).sum()
        return loss, h.detach(), self.l.weight.detach()


class ReturnsDetachedInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 6)

    def forward(self, x):
        h = self.l(x)
        return (h * h).sum(), x.detach()


class ReturnsDetachedItReads(nn.Module):
    """Detached values the graph reads and also returns: the input's and a computed one's."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        d = x.detach()
        h = self.l(x) + d
        hd = h.detach()
        return (h * h).sum() + (h * hd).sum(), d, hd


@pytest.mark.parametrize("module", [ReturnsDetached, ReturnsDetachedInput, ReturnsDetachedItReads])
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_detached_outputs_like_eager(exporter, module):
    # a detached graph output failed the build (the marker's output was a graph output); a user
    # input that needs grad gets no gradient through its detach
    torch.manual_seed(0)
    eager = module()
    ours = ORTWrap(copy.deepcopy(eager), exporter=exporter, fallback=False)
    for b in (3, 5):
        x = torch.randn(b, 4)
        xe, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = ours(xo), eager(xe)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
            assert g.requires_grad == w.requires_grad
        got[0].backward()
        want[0].backward()
        torch.testing.assert_close(xo.grad, xe.grad)
        for p, q in zip(ours.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert ours.fallback_reason is None


class WritesParameter(nn.Module):
    """Changes a parameter in place inside forward: eager changes the parameter; a graph cannot."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.e = nn.Embedding(10, 4, max_norm=1.0 if how == "max_norm" else None)
        self.l = nn.Linear(4, 3)

    def forward(self, ids):
        if self.how == "clamp":
            with torch.no_grad():
                self.l.weight.clamp_(-0.1, 0.1)
        return self.l(self.e(ids))


@pytest.mark.parametrize("how", ["max_norm", "clamp"])
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_parameter_changed_in_place_in_forward_is_refused_clearly(exporter, how):
    from ortwrap import FallbackWarning
    from ortwrap.errors import ExportError

    ids = torch.tensor([[1, 2, 3], [4, 5, 1]])
    if ON_ENGINE:
        _engine_trains_a_parameter_changed_in_place(how, ids)
        return
    with pytest.raises(ExportError, match="changes a parameter in place"):
        ORTWrap(WritesParameter(how), exporter=exporter, fallback=False)(ids)
    # with fallback (the default) it trains in PyTorch, the parameter changed as eager changes it
    torch.manual_seed(0)
    eager = WritesParameter(how)
    ours = ORTWrap(copy.deepcopy(eager), exporter=exporter, build_cache=False)
    with pytest.warns(FallbackWarning, match="changes a parameter in place"):
        ours(ids).sum().backward()
    eager(ids).sum().backward()
    for (name, p), q in zip(ours.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, msg=name)
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def _engine_trains_a_parameter_changed_in_place(how: str, ids: torch.Tensor) -> None:
    # engine="onnxruntime" (docs/engines.md): AOTAutograd functionalizes the write (an input mutation,
    # written back into the parameter after the forward, as BatchNorm's buffers are), so the engine
    # trains it like eager with fallback=False: the parameter changed as eager changes it, every gradient
    import warnings

    torch.manual_seed(0)
    eager = WritesParameter(how)
    with torch.no_grad():
        eager.l.weight.mul_(4)  # (outside clamp's bounds: the write changes it)
    ours = ORTWrap(copy.deepcopy(eager), fallback=False, build_cache=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, ours)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FallbackWarning
        for step in range(3):
            for model, opt in zip((eager, ours), opts):
                opt.zero_grad()
                (model(ids) * torch.linspace(-1, 1, 18).reshape(2, 3, 3)).sum().backward()
            for (name, p), q in zip(ours.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p, q, msg=f"step {step}: {name}")
                torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}: {name}.grad")
            for opt in opts:
                opt.step()
    assert ours.fallback_reason is None and ours._engine.build_count == 1 and ours._engine.fallback_calls == 0
