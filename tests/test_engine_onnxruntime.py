"""The ``"onnxruntime"`` engine (ortwrap/engines/onnxruntime/): AOTAutograd's forward and backward
graphs on onnxruntime's InferenceSession, against eager PyTorch.

Runs wherever an onnxruntime imports: the maintained onnxruntime (``ORT_EXTRA=ort make test``, its own
venv), and the training build's InferenceSession in the default venv.
"""

from __future__ import annotations

import copy
import gc
import logging

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from model_zoo import ResNetish, image_inputs
from parity import assert_close, check_parity
from tiny_gpt import GPTConfig, TinyGPT, batch
from tiny_llama import LlamaBlock, LlamaConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

import ortwrap
from ortwrap import Options, ORTWrap
from ortwrap.engines import available_engines, is_onnxruntime_available, is_training_available, resolve
from ortwrap.engines.onnxruntime import functions
from ortwrap.engines.onnxruntime.dynamic import DynamicRunner, split_shapes
from ortwrap.engines.onnxruntime.session import GraphRunner, binds_bfloat16
from ortwrap.engines.onnxruntime.split import SplitRunner

# (the exporter fixture only where the training engine's exporters handle a case differently, Functions:
# this engine takes its graphs from AOTAutograd, the exporter option does not apply to it)
pytestmark = pytest.mark.skipif(not is_onnxruntime_available(), reason="onnxruntime is not installed")

ORT = {"engine": "onnxruntime"}
#: The heavier builds: slow (``make test-slow``) in the training build's venv, where this engine is the
#: second one; ``ORT_EXTRA=ort make test`` runs every test of this file.
SLOW_BESIDE_TRAINING = pytest.mark.slow if is_training_available() else (lambda f: f)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(torch.tanh(self.fc1(x)))))


class SmallCNN(nn.Module):
    """Conv, BatchNorm (running statistics), ReLU, max pool, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        # (no bias before a BatchNorm: its gradient is rounding noise, which AdamW's normalized step amplifies)
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


def lm_model():
    return TinyGPT(GPTConfig(vocab=64, d=32, heads=4, layers=2, max_len=32))


def lm_inputs(b, g):
    ids, tgt = batch(GPTConfig(vocab=64), b, {4: 12, 7: 9, 3: 16}.get(b, 10), g)
    return (ids, tgt), {}


def test_engines_available_and_resolved():
    engines = available_engines()
    assert "onnxruntime" in engines and ortwrap.available_engines() == engines
    assert ("training" in engines) == is_training_available()
    assert resolve("auto") == ("training" if is_training_available() else "onnxruntime")
    assert resolve(Options.resolve(engine="onnxruntime").engine) == "onnxruntime"
    with pytest.raises(ValueError, match="engine='tensorrt' is invalid; allowed: auto, training, onnxruntime"):
        Options.resolve(engine="tensorrt")


def test_engine_from_the_environment(monkeypatch):
    monkeypatch.setenv("ORTWRAP_ENGINE", "onnxruntime")
    assert Options.resolve().engine == "onnxruntime"
    w = ORTWrap(MLP())
    assert w._engine is not None and w._engine.name == "onnxruntime"
    monkeypatch.setenv("ORTWRAP_ENGINE", "bogus")
    with pytest.raises(ValueError, match="engine='bogus' is invalid"):
        Options.resolve()


@pytest.mark.skipif(is_training_available(), reason="the training build is installed here")
def test_training_engine_without_the_training_build_says_what_to_install():
    assert ORTWrap(MLP())._engine is not None  # auto: the onnxruntime engine
    with pytest.raises(ImportError, match=r"engine='training'\) needs ONNX Runtime's training build.*ortwrap\[ort\]"):
        ORTWrap(MLP(), engine="training")


def test_mlp_adamw_parity_and_batch_sizes():
    w = check_parity(MLP, lambda b, g: ((torch.randn(b, 12, generator=g),), {}), wrap_options=ORT, optimizer=adamw)
    assert w._engine.build_count == 2  # the first shape's build, then one with symbolic sizes (dynamic dims)
    assert set(w._engine.last.runners) == {"forward", "backward"}


def test_mlp_input_gradient_and_repeated_shapes():
    def inputs(b, g):
        return (torch.randn(b, 12, generator=g).requires_grad_(),), {}

    w = check_parity(MLP, inputs, batch_sizes=(4, 7, 4, 7), wrap_options=ORT, optimizer=adamw)
    assert w._engine.build_count == 2  # the second batch of a shape reuses its build


def test_cnn_batchnorm_parity_train_then_eval():
    w = check_parity(
        SmallCNN, lambda b, g: ((torch.randn(b, 3, 12, 12, generator=g),), {}), wrap_options=ORT, optimizer=adamw
    )
    # eval: running statistics used, not updated, as in eager
    check_parity(SmallCNN, lambda b, g: ((torch.randn(b, 3, 12, 12, generator=g),), {}), wrap_options=ORT, train=False)
    assert w._engine.build_count == 2


@SLOW_BESIDE_TRAINING
def test_resnetish_from_the_zoo():
    check_parity(ResNetish, lambda b, g: image_inputs(b, g, size=lambda b: 16 + 8 * (b % 2)), wrap_options=ORT,
                 optimizer=adamw, loss_fn=lambda out: out)  # fmt: skip


@SLOW_BESIDE_TRAINING
def test_gpt_lm_with_the_loss_inside():
    check_parity(lm_model, lm_inputs, wrap_options=ORT, optimizer=adamw, loss_fn=lambda out: out[0])


class _BatchFirstAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def test_backward_of_a_transposed_saved_value_translates():
    # nn.MultiheadAttention(batch_first=True)'s backward views a permute of a saved value that the
    # forward laid out transposed: translated on contiguous stand-ins, the view was illegal
    # ("Cannot view a tensor with shape [6, 4, 16] and strides (16, 96, 1)"); the stand-ins now keep
    # the traced strides
    check_parity(
        _BatchFirstAttention,
        lambda b, g: ((torch.randn(b, 6, 16, generator=g, requires_grad=True),), {}),
        wrap_options=ORT,
        batch_sizes=(4, 3),
    )  # (SGD: the key bias's gradient is rounding noise, which AdamW would turn into full steps)


class _UnfoldLastDim(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        h = self.l(x)
        return h.unfold(-1, 4, 2).sum(-1).repeat(1, 3)[:, :8] * h  # (overlapping windows: uneven weights)


def test_unfold_backward_with_a_negative_dim():
    # aten.unfold_backward's decomposition gave ScatterND int32 indices, which onnxruntime refuses
    # (ONNX: int64 only): "Type 'tensor(int32)' of input parameter ... of operator (ScatterND) is invalid"
    check_parity(_UnfoldLastDim, lambda b, g: ((torch.randn(b, 8, generator=g),), {}), wrap_options=ORT)


def test_translated_graphs_come_from_the_build_cache(tmp_path, monkeypatch):
    """The translation (most of a graph's build) is cached on disk, keyed by the AOTAutograd graph with
    its constants: a second wrapper (as a second process) loads both graphs, with eager's numbers."""
    monkeypatch.setenv("ORTWRAP_BUILD_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 12)

    def step(**options):
        m = copy.deepcopy(model)
        w = ORTWrap(m, engine="onnxruntime", fallback=False, **options)
        out = w(x)
        out.square().sum().backward()
        return w, out.detach(), [p.grad for p in m.parameters()]

    first, out1, grads1 = step()
    assert not any(r.graph.from_cache for r in first._engine.last.runners.values())
    assert len(list(tmp_path.iterdir())) == 2  # (forward, backward)
    second, out2, grads2 = step()
    assert all(r.graph.from_cache for r in second._engine.last.runners.values())
    out_e = model(x)
    out_e.square().sum().backward()
    assert_close(out2, out_e.detach(), "output from the cache")
    assert_close(out1, out_e.detach(), "output")
    for g1, g2, p in zip(grads1, grads2, model.parameters()):
        assert_close(g2, p.grad, "gradient from the cache")
        assert_close(g1, p.grad, "gradient")
    third, _, _ = step(build_cache=False)
    assert not any(r.graph.from_cache for r in third._engine.last.runners.values())


def test_no_grad_and_eval_calls_use_an_inference_graph():
    torch.manual_seed(0)
    model = lm_model()
    eager = copy.deepcopy(model)
    w = ORTWrap(model, engine="onnxruntime", fallback=False)
    ids, tgt = batch(GPTConfig(vocab=64), 3, 9, torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss, logits = w(ids, tgt)
        loss_e, logits_e = eager(ids, tgt)
    assert not loss.requires_grad and set(w._engine.last.runners) == {"inference"}
    assert_close(logits, logits_e, "no_grad logits")
    w.eval(), eager.eval()
    loss, _ = w(ids, tgt)  # eval with grad: a training graph without dropout
    loss_e, _ = eager(ids, tgt)
    assert_close(loss.detach(), loss_e.detach(), "eval loss")
    loss.backward(), loss_e.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close(p.grad, q.grad, f"eval grad of {name}")


class Scale(torch.autograd.Function):
    """A Function whose backward is not forward's derivative (x2 in backward): traced, it must keep it."""

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        return g * 2


class NotTraceable(torch.autograd.Function):
    """Untraceable three ways: ``.item()`` into Python control flow, numpy, a non-tensor argument; its
    backward is not the forward's derivative (x2) and reads ``ctx`` state set in the forward."""

    @staticmethod
    def forward(ctx, x, k):
        scale = float(x.abs().max().item())  # data-dependent Python: no graph can hold it
        ctx.scale = scale if scale > 0.5 else 1.0
        ctx.save_for_backward(x)
        return torch.from_numpy(np.sin(x.detach().numpy())) * (k * ctx.scale)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.cos(x) * ctx.scale * 2, None


class WithFunction(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.fn = fn
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc(x)
        h = self.fn.apply(h) if self.fn is Scale else self.fn.apply(h, 1.5)
        return self.head(h.tanh())


def _inputs_with_grad(b, g):
    return (torch.randn(b, 6, generator=g).requires_grad_(),), {}


def test_traceable_function_runs_its_own_backward(exporter):
    """Traced into the joint graph (no op in PyTorch), under either exporter setting (the engine's
    graphs come from AOTAutograd: ``exporter`` does not apply to it)."""
    w = check_parity(lambda: WithFunction(Scale), _inputs_with_grad, wrap_options=ORT, batch_sizes=(4, 7))
    assert isinstance(w._engine.last.runners["forward"], GraphRunner), "a traceable Function must be traced"


def test_untraceable_function_runs_in_pytorch_between_ort_segments(exporter):
    """Was refused (UnsupportedFunctionError). Now it is one opaque op in the forward graph and one in the
    backward graph, run in PyTorch between ORT segments: its own forward and backward (with its ctx),
    every gradient, the input's too, as eager; a build per batch size."""
    # (SGD: with AdamW, head.bias[1]'s gradient at batch 7 is 0 up to rounding, which AdamW's step amplifies)
    w = check_parity(lambda: WithFunction(NotTraceable), _inputs_with_grad, wrap_options=ORT)
    assert w._engine.build_count == 3
    forward, backward = w._engine.last.runners["forward"], w._engine.last.runners["backward"]
    assert isinstance(forward, SplitRunner) and forward.in_torch == ["ortwrap_engine.function_forward.default"]
    assert isinstance(backward, SplitRunner) and backward.in_torch == ["ortwrap_engine.function_backward.default"]
    assert len(forward.segments) == 2 and backward.segments  # (the linear layers and tanh: on ORT)
    assert not functions._STATES  # each forward's state went with its backward


def test_untraceable_function_without_grad_and_unbackpropagated():
    torch.manual_seed(0)
    model = WithFunction(NotTraceable)
    eager = copy.deepcopy(model)
    w = ORTWrap(model, engine="onnxruntime", fallback=False)
    x = torch.randn(5, 6)
    with torch.no_grad():
        assert_close(w(x), eager(x), "no_grad output")
    assert set(w._engine.last.runners) == {"inference"}
    assert w._engine.last.runners["inference"].in_torch == ["ortwrap_engine.function_forward.default"]
    out = w(x)  # a forward whose backward never runs: its state goes with the graph
    assert_close(out.detach(), eager(x).detach(), "output")
    assert functions._STATES
    del out
    gc.collect()
    assert not functions._STATES


class RaisesOnFlag(torch.autograd.Function):
    """Raises its own error in the forward while ``fail`` is set (a check of its arguments, say)."""

    fail = False

    @staticmethod
    def forward(ctx, x, k):
        if RaisesOnFlag.fail:
            raise ValueError("boom 42: input too large")
        return x * k

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


def test_function_raising_its_own_error_while_a_signature_builds():
    """Was: the build took the Function for untraceable, made it opaque for good, and raised
    UnsupportedFunctionError (its probe raised too). Now the caller gets the Function's exception, type
    and message, as eager; the Function is traced again at the next build, with eager's numbers."""
    torch.manual_seed(0)
    eager = WithFunction(RaisesOnFlag)
    w = ORTWrap(copy.deepcopy(eager), engine="onnxruntime", fallback=False)
    RaisesOnFlag.fail = True
    try:
        with pytest.raises(ValueError, match="boom 42") as eager_error:
            eager(torch.randn(4, 6))
        with pytest.raises(ValueError, match="boom 42") as error:
            w(torch.randn(4, 6))
    finally:
        RaisesOnFlag.fail = False
    assert type(error.value) is ValueError and error.value.args == eager_error.value.args
    assert not w._engine._opaque
    x = torch.randn(4, 6, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    out, out_e = w(x), eager(xe)
    assert_close(out.detach(), out_e.detach(), "output")
    out.sum().backward(), out_e.sum().backward()
    assert_close(x.grad, xe.grad, "input grad")
    for (name, p), (_, q) in zip(w.module.named_parameters(), eager.named_parameters()):
        assert_close(p.grad, q.grad, f"grad of {name}")
    assert isinstance(w._engine.last.runners["forward"], GraphRunner)  # traced, not opaque


class DoubleInPlaceNumpy(torch.autograd.Function):
    """Untraceable (numpy) and in place (``ctx.mark_dirty``)."""

    @staticmethod
    def forward(ctx, x, k):
        x.mul_(k * float(np.abs(x.detach().numpy()).max() >= 0))  # (numpy: k)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 5, None


class SinNumpySetupContext(torch.autograd.Function):
    """Untraceable (numpy), ``setup_context`` style."""

    @staticmethod
    def forward(x, k):
        return torch.from_numpy(np.sin(x.detach().numpy())) * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.k = inputs[1]

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.cos(x) * ctx.k * 2, None


class InPlaceOn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.fn = fn
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc(x)
        a = self.fn.apply(h, 1.5)
        return self.head(torch.relu(a) + torch.sigmoid(h))  # (h is a after an in-place Function)


@pytest.mark.parametrize("fn", [DoubleInPlaceNumpy, SinNumpySetupContext], ids=["mark_dirty", "setup_context"])
def test_untraceable_function_that_cannot_be_opaque_is_refused_or_falls_back(fn):
    """docs/engines.md: an untraceable in-place (``mark_dirty``) or ``setup_context`` Function cannot run
    opaque yet. Refused naming it, and why; with fallback, its calls run in PyTorch with eager's numbers.
    (mark_dirty was: the trace held, and the first call failed in PyTorch's in-place check of a leaf.)"""
    why = {DoubleInPlaceNumpy: "modifies an input in place", SinNumpySetupContext: "setup_context"}[fn]
    w = ORTWrap(InPlaceOn(fn), engine="onnxruntime", fallback=False)
    with pytest.raises(ortwrap.RuntimeRunError, match=f"{fn.__name__}.*{why}"):
        w(torch.randn(4, 6))
    with pytest.warns(ortwrap.FallbackWarning, match=fn.__name__):
        w = check_parity(lambda: InPlaceOn(fn), _inputs_with_grad, wrap_options={**ORT, "fallback": True})
    assert w._engine.fallback_calls == 3 and w._engine.build_count == 0


class NumpyBackward(torch.autograd.Function):
    """A traceable forward, an untraceable backward (numpy, a Python float from ``.item()``)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        return x.sin() * k

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        scale = 1.0 + float(g.abs().max().item())
        return torch.from_numpy(np.cos(x.numpy()) * g.numpy() * scale), None


def test_function_with_an_untraceable_backward_runs_in_pytorch():
    w = check_parity(lambda: WithFunction(NumpyBackward), _inputs_with_grad, wrap_options=ORT, batch_sizes=(4, 7))
    assert w._engine.last.runners["backward"].in_torch == ["ortwrap_engine.function_backward.default"]


class ValueShaped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x[x > 0].clone()  # (its output's shape depends on the values)

    @staticmethod
    def backward(ctx, g):
        raise AssertionError("not reached")


class ValueShapedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return ValueShaped.apply(self.fc(x))


def test_function_with_value_dependent_output_shape_is_named():
    w = ORTWrap(ValueShapedModel(), engine="onnxruntime", fallback=False)
    with pytest.raises(ortwrap.RuntimeRunError, match="ValueShaped returned"):
        w(torch.randn(3, 6))


class ReentrantCheckpoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return self.b(checkpoint(lambda h: self.a(h).tanh(), x, use_reentrant=True))


def test_function_reading_parameters_from_a_closure_is_refused_by_name():
    """checkpoint(use_reentrant=True): untraceable, and its forward reads self.a's parameters, which it
    is not passed, so it cannot be opaque either: refused naming it, or (fallback) run in PyTorch."""
    w = ORTWrap(ReentrantCheckpoint(), engine="onnxruntime", fallback=False)
    with pytest.raises(ortwrap.UnsupportedFunctionError, match=r"CheckpointFunction.*from a closure"):
        w(torch.randn(3, 6, requires_grad=True))
    fallback = ORTWrap(ReentrantCheckpoint(), engine="onnxruntime")
    x = torch.randn(3, 6, requires_grad=True)
    with pytest.warns(ortwrap.FallbackWarning, match="CheckpointFunction"):
        out = fallback(x)
    assert_close(out, fallback.module(x), "fallback output")


@torch.library.custom_op("ortwrap_test_engine_ort::numpy_softsign", mutates_args=())
def numpy_softsign(x: torch.Tensor) -> torch.Tensor:
    a = x.detach().numpy()
    return torch.from_numpy(a / (1 + np.abs(a)))


numpy_softsign.register_fake(lambda x: torch.empty_like(x))
numpy_softsign.register_autograd(
    lambda ctx, g: g / (1 + ctx.saved_tensors[0].abs()) ** 2,
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]),
)


class WithCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(numpy_softsign(self.fc1(x)) * 3)


def test_op_without_onnx_translation_runs_in_pytorch():
    """A user's torch.library op (numpy inside, no ONNX translation) failed the translation (fallback=
    False raised ExportError); now it runs in PyTorch between the forward's ORT segments, and its
    backward formula (ATen ops) in ORT."""
    w = check_parity(WithCustomOp, _inputs_with_grad, wrap_options=ORT, batch_sizes=(4, 7))
    runners = w._engine.last.runners
    assert runners["forward"].in_torch == ["ortwrap_test_engine_ort.numpy_softsign.default"]
    assert len(runners["forward"].segments) == 2
    assert isinstance(runners["backward"], GraphRunner)


@pytest.mark.parametrize(
    "cin,cout,k,stride,pad,dil,groups,size",
    [(3, 8, 3, 1, 1, 1, 1, 12), (8, 16, 3, 2, 1, 1, 1, 11), (8, 8, 3, 1, 1, 2, 8, 10), (4, 6, 5, 2, 2, 1, 2, 13)],
    ids=["plain", "strided-odd", "depthwise-dilated", "grouped"],
)
def test_convolution_backward_decomposition(cin, cout, k, stride, pad, dil, groups, size):
    from ortwrap.engines.onnxruntime.decompositions import convolution_backward

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cin, size, size, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(cout, cin // groups, k, k, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(cout, dtype=torch.float64, generator=g, requires_grad=True)
    y = F.conv2d(x, w, b, stride, pad, dil, groups)
    go = torch.randn(y.shape, dtype=torch.float64, generator=g)
    expected = torch.autograd.grad(y, (x, w, b), go)
    got = convolution_backward(
        go, x.detach(), w.detach(), [cout], [stride] * 2, [pad] * 2, [dil] * 2, False, [0, 0], groups, [True] * 3
    )
    for name, a, e in zip(("input", "weight", "bias"), got, expected):
        assert_close(a, e, f"grad of {name}")


@pytest.mark.parametrize(
    "cin,cout,k,stride,pad,outpad,dil,groups,size",
    [(8, 4, 2, 2, 0, 0, 1, 1, 6), (4, 6, 3, 2, 1, 1, 1, 2, 7), (6, 6, 3, 1, 1, 0, 2, 3, 5)],
    ids=["unet-up", "grouped-output-padding", "dilated-grouped"],
)
def test_transposed_convolution_backward_decomposition(cin, cout, k, stride, pad, outpad, dil, groups, size):
    """A transposed convolution's backward (the UNet's ConvTranspose2d upsampling): was left whole,
    which torchlib cannot translate."""
    from ortwrap.engines.onnxruntime.decompositions import convolution_backward

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cin, size, size + 1, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(cin, cout // groups, k, k, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(cout, dtype=torch.float64, generator=g, requires_grad=True)
    y = F.conv_transpose2d(x, w, b, stride, pad, outpad, groups, dil)
    go = torch.randn(y.shape, dtype=torch.float64, generator=g)
    expected = torch.autograd.grad(y, (x, w, b), go)
    got = convolution_backward(
        go, x.detach(), w.detach(), [cout], [stride] * 2, [pad] * 2, [dil] * 2, True, [outpad] * 2, groups, [True] * 3
    )
    for name, a, e in zip(("input", "weight", "bias"), got, expected):
        assert_close(a, e, f"grad of {name}")


class Upsampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)

    def forward(self, x):
        return self.up(F.relu(self.conv(x))).tanh()


def test_conv_transpose_trains():
    check_parity(Upsampler, lambda b, g: ((torch.randn(b, 3, 6 + b, 6, generator=g),), {}), wrap_options=ORT,
                 optimizer=adamw)  # fmt: skip


@SLOW_BESIDE_TRAINING
def test_min_cut_partitioner_saves_fewer_values_than_recompute_none():
    """recompute (default "cheap"): AOTAutograd's min-cut partitioner recomputes cheap ops in the
    backward; recompute="none": the default partitioner saves what the backward reads."""
    saved = {}
    for recompute in ("cheap", "none"):
        torch.manual_seed(0)
        w = ORTWrap(lm_model(), engine="onnxruntime", fallback=False, recompute=recompute)
        (ids, tgt), _ = lm_inputs(3, torch.Generator().manual_seed(0))
        loss, _ = w(ids, tgt)
        loss.backward()
        backward = w._engine.last.graphs["backward"]
        saved[recompute] = sum(n.op == "placeholder" for n in backward.graph.nodes)
    assert saved["cheap"] < saved["none"], saved


class DetachAndPadding(nn.Module):
    """``detach()`` and an embedding's ``padding_idx``: ortwrap's translations mark both
    ``ortwrap::StopGradient`` (for the training build's gradient builder), which an InferenceSession
    does not know: the session failed to build (BERT, RoBERTa, ALBERT, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, padding_idx=0)
        self.fc = nn.Linear(6, 6)

    def forward(self, ids):
        h = self.fc(self.emb(ids))
        return h * h.detach().tanh()


def test_stop_gradient_markers_are_resolved():
    check_parity(DetachAndPadding, lambda b, g: ((torch.randint(0, 10, (b, 5), generator=g),), {}),
                 wrap_options=ORT, optimizer=adamw)  # fmt: skip


class TwoLayerLSTM(nn.Module):
    """With mkldnn on, torch's LSTM decomposition writes the first layer (its input needs no gradient)
    as ``aten.mkldnn_rnn_layer``, which has no ONNX translation."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, num_layers=2, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


@pytest.mark.slow  # ~19 s; the engine's LSTM parity by default: tests/test_rnn.py in the engine venv
def test_lstm_traced_without_mkldnn():
    check_parity(TwoLayerLSTM, lambda b, g: ((torch.randn(b, 3 + b, 4, generator=g),), {}), wrap_options=ORT,
                 optimizer=adamw, atol=1e-4)  # fmt: skip


class SkipsWhenNotTracing(nn.Module):
    """transformers' masks: outside a trace, a data-dependent shortcut (``if mask.all(): no mask``);
    traced (``torch.compiler.is_compiling()``), the mask is always applied. AOTAutograd's fake tensors
    cannot take the shortcut's ``.all()`` (DataDependentOutputException: BERT, DistilBERT)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x, mask):
        h = self.fc(x)
        if torch.compiler.is_compiling() or not bool(mask.all()):
            h = h.masked_fill(~mask, 0.0)
        return h.softmax(-1)


def test_traced_as_torch_compile_traces():
    def inputs(b, g):
        mask = torch.ones(b, 5, dtype=torch.bool)
        mask[1:, -2:] = False
        return (torch.randn(b, 5, generator=g), mask), {}

    check_parity(SkipsWhenNotTracing, inputs, wrap_options=ORT, optimizer=adamw)


class ConstantInGraph(nn.Module):
    """A tensor constant in the graph (transformers' ``torch.tensor([])`` caches, here an empty
    tensor concatenated): the dynamo cleanup's constant folding read it inside AOTAutograd's fake
    mode ("Please convert all Tensors to FakeTensors first": GPT-2, Llama)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.cat([torch.tensor([]).view(h.shape[0], 0), h], -1).tanh()


def test_graph_constants_translated_outside_the_fake_mode():
    check_parity(ConstantInGraph, lambda b, g: ((torch.randn(b, 4, generator=g),), {}), wrap_options=ORT,
                 optimizer=adamw)  # fmt: skip


class SetsAColumn(nn.Module):
    """``out[:, 0] = 2``: functionalized to ``aten.copy`` of a 0-d constant into a slice (BART's and T5's
    ``shift_tokens_right``), which torchlib translates without the broadcast. And a weight-normed
    convolution (wav2vec2's positional embedding), whose backward op has no translation."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(5, 5, 3, padding=1), dim=2)

    def forward(self, x, ids):
        h = self.fc(x)
        out = h.clone()
        out[:, 0] = 2
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1]
        shifted[:, 0] = 5
        return self.conv(out) * shifted[..., None], shifted


def test_copy_into_a_slice_and_weight_norm():
    def inputs(b, g):
        return (torch.randn(b, 5, 4, generator=g), torch.randint(0, 9, (b, 5), generator=g)), {}

    check_parity(SetsAColumn, inputs, wrap_options=ORT, optimizer=adamw)


class GroupedExperts(nn.Module):
    """transformers' MoE experts: ``transformers::grouped_mm_fallback`` over rows sorted by expert.
    AOTAutograd records its backward whole (``grouped_mm_fallback_backward``), which had no translation
    (Mixtral, Qwen2-MoE). ``expert``: each row's expert, sorted; expert 2 gets no row in some batches."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.experts = nn.Parameter(torch.randn(3, 4, 5))

    def forward(self, x, expert):
        offs = (expert[None, :] <= torch.arange(3)[:, None]).sum(1).to(torch.int32)  # each expert's end
        return torch.ops.transformers.grouped_mm_fallback(self.proj(x), self.experts, offs).tanh()


def test_grouped_mm_backward_of_transformers_experts():
    pytest.importorskip("transformers.integrations.moe")

    def inputs(b, g):
        return (torch.randn(2 * b, 4, generator=g), torch.randint(0, 2 + b % 2, (2 * b,), generator=g).sort()[0]), {}

    check_parity(GroupedExperts, inputs, wrap_options=ORT, optimizer=adamw)


class RandomDraws(nn.Module):
    """Random ops in training mode (engines/onnxruntime/in_torch.py): nn.Dropout and F.dropout, PhiMoE's
    ``torch.rand_like(...).uniform_()`` mask, ``randn_like``, ``bernoulli``, an ``exponential_`` Gumbel
    draw, a ``randperm`` and a ``normal_``. Before: dropout and ``rand_like``/``randn_like``/``bernoulli``/
    ``normal_`` ran as ONNX ops on ORT's generator (another mask than eager's under the same seed), and
    ``rand_like(...).uniform_()``'s ``prims.uniform`` refused."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = self.drop(torch.tanh(self.fc1(x)))
        h = h * ((torch.rand_like(h).uniform_() > 0.5).float() * 0.5 + 0.75) + 0.1 * torch.randn_like(h)
        h = h + 0.1 * torch.empty_like(h).exponential_().log()
        h = h * torch.bernoulli(torch.sigmoid(h.detach())) + F.dropout(h, 0.2, training=self.training)
        h = h[:, torch.randperm(h.shape[1])] + torch.empty_like(h).normal_(0.0, 0.5)
        return self.fc2(h)


def test_random_ops_draw_from_torchs_generator():
    """Outputs and every parameter gradient equal eager's under the same ``torch.manual_seed`` before each
    side's forward (3 AdamW steps, two batch sizes); also a training-mode call without grad (inference
    graph). check_parity does not seed each side alike, hence the loop here."""
    torch.manual_seed(0)
    eager = RandomDraws()
    ours = copy.deepcopy(eager)
    wrapped = ORTWrap(ours, engine="onnxruntime", fallback=False)
    opt_e, opt_o = adamw(eager.parameters()), adamw(ours.parameters())
    gen = torch.Generator().manual_seed(1)
    for step, b in enumerate((4, 7, 4)):
        x = torch.randn(b, 8, generator=gen)
        torch.manual_seed(100 + step)
        out_e = eager(x)
        torch.manual_seed(100 + step)
        out_o = wrapped(x)
        assert_close(out_o.detach(), out_e.detach(), f"step {step} output")
        out_e.square().mean().backward()
        out_o.square().mean().backward()
        for (name, p_o), p_e in zip(ours.named_parameters(), eager.parameters()):
            assert_close(p_o.grad, p_e.grad, f"step {step} grad of {name}")
        opt_e.step(), opt_o.step(), opt_e.zero_grad(), opt_o.zero_grad()
    with torch.no_grad():
        torch.manual_seed(7)
        out_e = eager(x)
        torch.manual_seed(7)
        assert_close(wrapped(x), out_e, "training mode without grad")
    runners = wrapped._engine.last.runners
    assert {"aten.native_dropout.default", "aten.rand_like.default", "aten.uniform.default",
            "aten.bernoulli.default"} <= set(runners["inference"].in_torch)  # fmt: skip
    assert wrapped._engine.build_count == 3  # (two shapes with grad, one without)


class ComplexRope(nn.Module):
    """Complex RoPE (DeepSeek-V2's): ``torch.polar`` frequencies, ``view_as_complex`` of the projected
    pairs, a complex product, ``view_as_real``; the forward saves complex tensors for the backward.
    Before: IOBinding refused complex64 (SessionError); ORT has no complex kernels (in_torch.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(8, 8), nn.Linear(8, 3)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)

    def forward(self, x):
        t = torch.arange(x.shape[1], dtype=torch.float32)
        freqs = torch.polar(torch.ones(x.shape[1], 4), torch.outer(t, self.inv_freq))
        q = self.q(x)
        rotated = torch.view_as_real(torch.view_as_complex(q.reshape(*q.shape[:-1], 4, 2)) * freqs).flatten(-2)
        return self.out(rotated * q)


def test_complex_rope_runs_its_complex_ops_in_pytorch():
    def inputs(b, g):
        return (torch.randn(b, {4: 5, 7: 6}.get(b, 4), 8, generator=g).requires_grad_(),), {}

    # (SGD: default_loss's symmetric weights make the head's bias gradient rounding noise, which AdamW's
    # normalized step turns into a full step either way)
    w = check_parity(ComplexRope, inputs, wrap_options=ORT)
    runners = w._engine.last.runners
    for what in ("forward", "backward"):
        assert isinstance(runners[what], SplitRunner)
        assert {"aten.view_as_complex.default", "aten.view_as_real.default"} <= set(runners[what].in_torch)
        for segment in runners[what].segments:  # (ORT sees real tensors only)
            assert all(not dtype.is_complex for _, dtype in segment.graph.output_meta)


class DataDependent(nn.Module):
    """Python that reads a value (a branch on the batch's sum, as Wav2Vec2ForCTC's label check) and a
    gather of the rows ``nonzero`` picks (as DeBERTa's valid labels, the routed experts' tokens): one
    AOTAutograd graph cannot hold either (``fallback=False`` raised ExportError). The branch goes
    each way over the batches, and the picked rows change in number."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.picked, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if x.sum() > 0:
            h = h * 2 - 0.5
        rows = (x[:, 0] > 0).nonzero().squeeze(1)
        g = torch.sigmoid(self.picked(h[rows]))
        return self.out(h).tanh(), g.sum(0) / (rows.numel() + 1)


def test_data_dependent_python_and_shapes_run_as_a_split_capture(caplog):
    caplog.set_level(logging.INFO, logger="ortwrap")
    shift = {4: 1.0, 7: -1.0, 3: 0.5}

    def inputs(b, g):
        return (torch.randn(b, 6, generator=g) + shift[b],), {}

    w = check_parity(DataDependent, inputs, wrap_options=ORT, optimizer=adamw, batch_sizes=(4, 7, 3),
                     loss_fn=lambda out: out[0].pow(2).sum() + (out[1] * torch.arange(8.0)).sum())  # fmt: skip
    split = w.split_capture
    assert split is not None and split.fragments and all(f.on_ort for f in split.fragments), split.summary()
    assert split.programs >= len(split.fragments)
    said = [r.getMessage() for r in caplog.records if "stops on a data-dependent" in r.getMessage()]
    assert len(said) == 1 and "DataDependentOutputException" in said[0] and "forward" in said[0], said


class AddsAParameter(nn.Module):
    """A backward that hands its gradient through (no op but an Identity): its ONNX imported no opset,
    and ORT refused the model (DBRX's split capture has such fragments)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(3, 5))

    def forward(self, x):
        return x + self.p


def test_backward_of_no_ops_builds():
    check_parity(AddsAParameter, lambda b, g: ((torch.randn(3, 5, generator=g) * b,), {}), wrap_options=ORT,
                 batch_sizes=(4, 7), loss_fn=lambda out: (out * torch.arange(15.0).view(3, 5)).sum())  # fmt: skip


class GathersRows(nn.Module):
    """``h[rows]`` into a Linear: torchlib writes an identity Transpose around the gathered rows, which
    onnxruntime 1.19.2's GemmTransposeFusion took for a transpose (the training build's
    InferenceSession: wrong numbers, or a dimension error)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 8)

    def forward(self, x, rows):
        return torch.sigmoid(self.fc2(torch.tanh(self.fc1(x))[rows]))


def test_gathered_rows_into_a_linear():
    def inputs(b, g):
        return (torch.randn(b, 6, generator=g), torch.randperm(b, generator=g)[: b - 1]), {}

    check_parity(GathersRows, inputs, wrap_options=ORT, optimizer=adamw)


# ---- autocast (bf16, fp16): autocast's casts traced into the graphs, computed in float32 between Casts

#: test_coverage_amp.py's tolerances (check_parity's atol == rtol, relative to each tensor's largest element)
BF16, FP16 = 3e-2, 5e-3


#: bf16 tensors bind on onnxruntime >= 1.20 (not the training build's 1.19.2: the engine falls back there)
NEEDS_BF16 = pytest.mark.skipif(not binds_bfloat16(), reason="bfloat16 IOBinding needs onnxruntime >= 1.20")


def _amp(dtype):
    return lambda: torch.autocast("cpu", dtype=dtype)


def _amp_adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5)  # (as test_coverage_amp.py)


def _rewritten(w) -> int:
    runners = [s for r in w._engine.last.runners.values() for s in getattr(r, "segments", [r])]
    return sum(r.half_rewritten for r in runners)


def _frozen(params):
    return torch.optim.SGD(params, lr=0.0)


class ConvNet(nn.Module):
    """Convolutions (one strided, one depthwise), GELU, max pool, a linear head; no BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
        self.conv3 = nn.Conv2d(8, 16, 1)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = F.max_pool2d(F.gelu(self.conv1(x)), 2)
        x = F.gelu(self.conv3(self.conv2(x)))
        return self.head(x.mean((2, 3)))


def _mlp_inputs(b, g):
    return (torch.randn(b, 12, generator=g),), {}


def _cnn_inputs(b, g):
    return (torch.randn(b, 3, 12, 12, generator=g),), {}


@pytest.mark.parametrize(
    "model, inputs, dtype, loss, optimizer",
    [
        pytest.param(MLP, _mlp_inputs, torch.bfloat16, None, _amp_adamw, id="mlp-bf16", marks=NEEDS_BF16),
        pytest.param(MLP, _mlp_inputs, torch.float16, None, _amp_adamw, id="mlp-fp16"),
        pytest.param(ConvNet, _cnn_inputs, torch.bfloat16, None, _amp_adamw, id="cnn-bf16", marks=NEEDS_BF16),
        # (BatchNorm: gradients at the same parameters each step (lr 0): conv1's weight gradient is
        # ill-conditioned in bf16, eager's and ORT's 1-18% from a float64 run at the same parameters, ORT's
        # 0.4-0.8% from eager's; training lets the two sides' parameters part by that noise)
        pytest.param(SmallCNN, _cnn_inputs, torch.bfloat16, None, _frozen, id="cnn-batchnorm-bf16", marks=NEEDS_BF16),
        pytest.param(
            lm_model, lm_inputs, torch.bfloat16, lambda out: out[0], _amp_adamw, id="lm-bf16", marks=NEEDS_BF16
        ),
    ],
)
def test_autocast_trains_like_eager_autocast(model, inputs, dtype, loss, optimizer):
    """Outputs (in autocast's dtypes), the loss and every parameter gradient against eager autocast
    over 3 steps; the build is AOTAutograd's graphs with autocast's casts, nothing falls back."""
    tol = BF16 if dtype == torch.bfloat16 else FP16
    kw = {"loss_fn": loss} if loss else {}
    w = check_parity(
        model, inputs, wrap_options=ORT, optimizer=optimizer, autocast=_amp(dtype), atol=tol, rtol=tol, **kw
    )
    # (3 batch sizes: the first builds with static sizes, the next with symbolic ones that serve the third)
    assert w._engine.fallback_calls == 0 and w._engine.build_count == 2
    assert _rewritten(w) > 0  # (half-precision nodes computed in float32 between Casts: half.py)
    # (batch norm's var_mean was left to PyTorch by the split before it was decomposed; max pooling's
    # backward, which torchlib does not translate, still runs in PyTorch between two ORT segments)
    in_torch = [op for r in w._engine.last.runners.values() if isinstance(r, SplitRunner) for op in r.in_torch]
    assert set(in_torch) <= {"aten.max_pool2d_with_indices_backward.default"}, in_torch


class Rounds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return h, (h * 3) / 3  # (in bf16: rounded twice, ~12% of the elements differ from h)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=NEEDS_BF16), torch.float16])
def test_autocast_rounding_is_kept(dtype):
    """Each half-precision op rounds its result as eager's kernel does: ``(h * 3) / 3`` differs from
    ``h`` in eager autocast, and equally here (ORT keeps the Cast to bf16 between the two float32 ops;
    computing the chain in float32 would give ``h`` back)."""
    torch.manual_seed(0)
    eager = Rounds()
    w = ORTWrap(copy.deepcopy(eager), engine="onnxruntime", fallback=False)
    x = torch.randn(64, 16)
    with torch.autocast("cpu", dtype=dtype):
        h, y = w(x)
        h_e, y_e = eager(x)
    assert y.dtype == dtype and torch.equal(h, h_e) and torch.equal(y, y_e)
    assert not torch.equal(y_e, h_e)  # (the test can tell)


@NEEDS_BF16
def test_autocast_state_keys_the_build():
    """bf16, fp16 and no autocast are three builds (the autocast dtype is in the signature), each
    with its dtype's outputs; a repeated state reuses its build."""
    torch.manual_seed(0)
    eager = MLP()
    w = ORTWrap(copy.deepcopy(eager), engine="onnxruntime", fallback=False)
    x = torch.randn(4, 12)
    for dtype in (torch.bfloat16, torch.float16, None, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            y, y_e = w(x), eager(x)
        assert y.dtype == y_e.dtype == (dtype or torch.float32)
        assert_close(y.detach(), y_e.detach(), f"{dtype}", 5e-3 if dtype else 1e-5, 5e-3 if dtype else 1e-5)
    assert w._engine.build_count == 3 and w._engine.fallback_calls == 0


def test_float16_autocast_with_grad_scaler():
    """fp16 autocast with ``torch.amp.GradScaler``: the scaled loss's gradients, the unscale and the
    skipped-or-taken steps as eager's (3 AdamW steps)."""
    torch.manual_seed(0)
    eager = MLP()
    w = ORTWrap(copy.deepcopy(eager), engine="onnxruntime", fallback=False)
    sides = [
        (eager, torch.amp.GradScaler("cpu", init_scale=2.0**12)),
        (w, torch.amp.GradScaler("cpu", init_scale=2.0**12)),
    ]
    opts = [_amp_adamw(m.parameters()) for m, _ in sides]
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(4 + step, 12, generator=g)
        outs = []
        for (m, scaler), opt in zip(sides, opts):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(x)
            scaler.scale((out.float() ** 2).mean()).backward()
            scaler.unscale_(opt)
            outs.append((out.detach(), [p.grad.clone() for p in m.parameters()]))
            scaler.step(opt)
            scaler.update()
        (o_e, g_e), (o_w, g_w) = outs
        assert_close(o_w, o_e, f"step {step} output", FP16, FP16)
        for i, (a, b) in enumerate(zip(g_w, g_e)):
            assert_close(a, b, f"step {step} grad {i}", FP16, FP16)
    assert sides[0][1].get_scale() == sides[1][1].get_scale()
    for a, b in zip(w.parameters(), eager.parameters()):
        assert_close(a.detach(), b.detach(), "parameter", FP16, FP16)


@pytest.mark.skipif(binds_bfloat16(), reason="onnxruntime >= 1.20 binds bfloat16: the engine trains it")
def test_bfloat16_autocast_falls_back_where_onnxruntime_cannot_bind_it():
    """The training build's onnxruntime 1.19.2 binds no bfloat16 tensor: the call runs in PyTorch,
    saying why (float16 autocast trains there)."""
    from ortwrap.errors import FallbackWarning

    torch.manual_seed(0)
    eager = MLP()
    w = ORTWrap(copy.deepcopy(eager), engine="onnxruntime")
    x = torch.randn(4, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(FallbackWarning, match=r"bfloat16 autocast .* needs onnxruntime >= 1\.20"):
            y = w(x)
        assert torch.equal(y, eager(x)) and w._engine.fallback_calls == 1


@NEEDS_BF16
def test_bfloat16_scatter_add_computes_in_float32():
    """onnxruntime's CPU ScatterND has a bfloat16 kernel (the session builds) but refuses
    ``reduction='add'`` when it runs (Qwen2-MoE's experts' backward under autocast): a scatter with
    a reduction is not data movement, half.py computes it in float32 between Casts."""
    from onnx import TensorProto, helper

    from ortwrap._ort import ort
    from ortwrap.engines.onnxruntime.half import compute_in_float32

    BF16 = TensorProto.BFLOAT16
    node = helper.make_node("ScatterND", ["data", "idx", "upd"], ["out"], reduction="add")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("data", BF16, [4, 3]), helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 1]),
         helper.make_tensor_value_info("upd", BF16, [2, 3])],
        [helper.make_tensor_value_info("out", BF16, [4, 3])],
    )  # fmt: skip
    model, rewritten = compute_in_float32(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    )
    assert rewritten == 1
    data, upd, idx = torch.randn(4, 3).bfloat16(), torch.randn(2, 3).bfloat16(), torch.tensor([[1], [3]])
    out = torch.empty(4, 3, dtype=torch.bfloat16)
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    for name, t, onnx_type in (("data", data, BF16), ("idx", idx, np.int64), ("upd", upd, BF16)):
        binding.bind_input(name, "cpu", 0, onnx_type, list(t.shape), t.data_ptr())
    binding.bind_output("out", "cpu", 0, BF16, [4, 3], out.data_ptr())
    session.run_with_iobinding(binding)  # (refused before: "BFloat16 ... not supported with ScatterND ... 'add'")
    assert torch.equal(out, data.clone().index_add_(0, idx[:, 0], upd))


# ------------------------------------------------------------------------------------ dynamic dims

#: 4 steps, batch and length (or image size) changing at each
DYNAMIC_STEPS = (4, 7, 3, 5)
_LENGTHS = {4: 12, 7: 9, 3: 16, 5: 11}


def _dynamic_built(w) -> None:
    # one build with static sizes (the first shape), one with symbolic sizes (every later shape: static
    # shapes built 4)
    assert w._engine.build_count == 2
    (builds,) = w._engine._shapes._builds.values()
    assert len(builds) == 1 and w._engine.last is builds[0][0]
    assert all(isinstance(r, DynamicRunner) for r in w._engine.last.runners.values())


def test_dynamic_dims_mlp():
    w = check_parity(MLP, lambda b, g: ((torch.randn(b, 12, generator=g),), {}), batch_sizes=DYNAMIC_STEPS,
                     wrap_options=ORT, optimizer=adamw)  # fmt: skip
    _dynamic_built(w)


def test_dynamic_dims_gpt_lm_with_the_loss_inside():
    def inputs(b, g):
        ids, tgt = batch(GPTConfig(vocab=64), b, _LENGTHS[b], g)
        return (ids, tgt), {}

    w = check_parity(lm_model, inputs, batch_sizes=DYNAMIC_STEPS, wrap_options=ORT, optimizer=adamw,
                     loss_fn=lambda out: out[0])  # fmt: skip
    _dynamic_built(w)


def test_dynamic_dims_cnn():
    w = check_parity(SmallCNN, lambda b, g: ((torch.randn(b, 3, _LENGTHS[b], _LENGTHS[b] + 1, generator=g),), {}),
                     batch_sizes=DYNAMIC_STEPS, wrap_options=ORT, optimizer=adamw)  # fmt: skip
    _dynamic_built(w)


def test_graph_that_cannot_be_dynamic_keeps_per_shape_builds(caplog):
    """A graph split at an op with no ONNX translation (its ORT segments): not dynamic yet; said once
    in the log, one build per shape as before, eager's numbers."""
    caplog.set_level(logging.INFO, logger="ortwrap")
    w = check_parity(WithCustomOp, _inputs_with_grad, wrap_options=ORT, batch_sizes=DYNAMIC_STEPS)
    assert w._engine.build_count == 4
    said = [r.getMessage() for r in caplog.records if "cannot run with symbolic sizes" in r.getMessage()]
    assert len(said) == 1 and "WithCustomOp" in said[0] and "numpy_softsign" in said[0]


# ------------------------------------------------------------------------ aggressive CPU fallback

_LLAMA = LlamaConfig(d=32, heads=4, hidden=64, max_len=16)


def _llama_inputs(b, g):
    # (the batch and the sequence length change at each step: the second step builds with symbolic sizes)
    return (torch.randn(b, {4: 8, 7: 5, 3: 11, 5: 16}[b], _LLAMA.d, generator=g),), {}


def _onnx_ops(runner) -> dict[str, int]:
    """Op type -> count in the graph the runner's session runs (the main graph, after any split)."""
    counts: dict[str, int] = {}
    for n in onnx.load_from_string(runner.graph.model).graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


@SLOW_BESIDE_TRAINING
def test_aggressive_cpu_fallback_moves_symbolic_shapes_to_the_host(caplog):
    """``aggressive_cpu_fallback`` on a build with symbolic sizes: the shape computations of the forward
    and backward graphs (Shape of the inputs, and the Gather/Squeeze/Mul/Concat that build Reshape,
    Expand, Range and Slice inputs from it) leave the graph for the training engine's host shape program;
    eager's outputs and gradients at every sequence length."""
    caplog.set_level(logging.INFO, logger="ortwrap")
    w = check_parity(lambda: LlamaBlock(_LLAMA), _llama_inputs, batch_sizes=DYNAMIC_STEPS, lr=0.01,
                     wrap_options={**ORT, "aggressive_cpu_fallback": True})  # fmt: skip
    _dynamic_built(w)
    runners = w._engine.last.runners
    assert set(runners) == {"forward", "backward"}
    for what, runner in runners.items():
        split = runner.host_split
        assert split is not None and split.moved and split.feeds, what
        moved = [p.op_type for p in split.moved.values()]
        assert "Shape" in moved and {"Concat", "Mul"} & set(moved), (what, moved)
        # every Shape/Size of an input left the main graph: its dims come from tensor.shape on the host
        main = onnx.load_from_string(runner.graph.model)
        inputs = {v.name for v in main.graph.input}
        assert not [n.name for n in main.graph.node if n.op_type in ("Shape", "Size") and n.input[0] in inputs], what
        assert {f.name for f in split.feeds} <= inputs
        assert all(f.source in runner.graph.input_names for f in (*split.feeds, *split.program_inputs) if f.source)
        # the shape program ran once per distinct shape the symbolic build served (7, 3 and 5)
        assert runner.host_shapes_runner.runs == 3, what
    reasons = {r for p in runners["forward"].host_split.moved.values() for r in p.reasons}
    assert any("(shape)" in r for r in reasons) and any("(limit)" in r for r in reasons), reasons
    # the first shape's static build: nothing to move (every shape a constant), as the log says once
    static = [c for c in w._engine._compiled.values() if c is not w._engine.last]
    assert static and all(isinstance(r, GraphRunner) and not isinstance(r, DynamicRunner)
                          for c in static for r in c.runners.values())  # fmt: skip
    for runner in static[0].runners.values():
        assert "Shape" not in _onnx_ops(runner)
        _, split = split_shapes(runner.graph, runner.what)
        assert not split.feeds and not split.moved
    said = [r.getMessage() for r in caplog.records if "aggressive_cpu_fallback applies" in r.getMessage()]
    assert len(said) == 1 and "static sizes" in said[0] and "nothing moves" in said[0]
    # inference (no_grad, eval): its graph with symbolic sizes is split too, eager's outputs
    eager = copy.deepcopy(w.module).eval()
    w.eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for b in (4, 3, 5):
            (x,), _ = _llama_inputs(b, gen)
            assert_close(w(x), eager(x), f"inference output, batch {b}")
    inference = w._engine.last.runners["inference"]
    assert isinstance(inference, DynamicRunner) and inference.host_split.moved


@SLOW_BESIDE_TRAINING
def test_aggressive_cpu_fallback_keeps_the_numbers_and_off_keeps_the_shape_nodes():
    """The same block with the option off and on: bit-identical outputs and gradients at every sequence
    length; off, the symbolic graphs keep their shape nodes and no host program runs."""
    torch.manual_seed(0)
    base = LlamaBlock(_LLAMA)
    results = {}
    for flag in (False, True):
        w = ORTWrap(copy.deepcopy(base), engine="onnxruntime", fallback=False, aggressive_cpu_fallback=flag)
        gen = torch.Generator().manual_seed(3)
        steps = []
        for b in DYNAMIC_STEPS:
            (x,), _ = _llama_inputs(b, gen)
            x.requires_grad_(True)
            y = w(x)
            (y * y).sum().backward()
            steps.append((y.detach(), x.grad, [p.grad.clone() for p in w.parameters()]))
            w.zero_grad()
        results[flag] = (steps, w._engine.last.runners)
    (off, off_runners), (on, on_runners) = results[False], results[True]
    for (y0, gx0, g0), (y1, gx1, g1) in zip(off, on):
        assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    for what in ("forward", "backward"):
        runner_off, runner_on = off_runners[what], on_runners[what]
        assert isinstance(runner_off, DynamicRunner) and runner_off.host_split is None
        assert runner_off.host_shapes_runner is None
        ops_off, ops_on = _onnx_ops(runner_off), _onnx_ops(runner_on)
        assert ops_off.get("Shape", 0) >= 2, (what, ops_off)
        shape_ops = ("Shape", "Gather", "Squeeze", "Unsqueeze", "Concat")
        assert sum(ops_on.get(k, 0) for k in shape_ops) < sum(ops_off.get(k, 0) for k in shape_ops), what
        assert ops_on.get("Shape", 0) < ops_off["Shape"], what
        moved = len(runner_on.host_split.moved)
        assert sum(ops_off.values()) - sum(ops_on.values()) >= moved - len(runner_on.host_split.feeds), what


class ThreeOutputs(nn.Module):
    """A shared trunk and three outputs (one a view, one with a BatchNorm), a parameter the forward never
    reads, and one read only under a branch this input does not take."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.a, self.b = nn.Linear(8, 3), nn.Linear(8, 4)
        self.bn = nn.BatchNorm1d(8)
        self.unused = nn.Parameter(torch.randn(3))
        self.branch = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        if x.shape[-1] > 100:  # (never here)
            h = h * self.branch
        return self.a(h), self.b(h).view(-1, 2, 2), self.bn(h) * 2


def test_outputs_without_a_gradient_leave_what_only_they_reach_at_grad_none():
    # A loss on some outputs: eager leaves .grad None on every parameter (and input) that only the others
    # reach, or that the forward does not read; AOTAutograd's backward, fed zeros for the missing
    # outputs' gradients, computed zeros for them. Shared parameters get eager's gradient.
    torch.manual_seed(0)
    eager = ThreeOutputs()
    wrapped = ORTWrap(copy.deepcopy(eager), fallback=False, **ORT)
    for step, (size, used) in enumerate([(5, (0,)), (5, (1,)), (5, (0, 2)), (7, (2,)), (9, (1,)), (9, (0, 1, 2))]):
        x = torch.randn(size, 6, generator=torch.Generator().manual_seed(step))
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        for model, xi in zip((eager, wrapped), xs):
            model.zero_grad(set_to_none=True)
            outs = model(xi)
            sum(outs[i].pow(2).sum() for i in used).backward()
        for (name, p), q in zip(eager.named_parameters(), wrapped.parameters()):
            assert (q.grad is None) == (p.grad is None), f"step {step} (loss on {used}), {name}: grad {q.grad}"
            if p.grad is not None:  # (atol: BatchNorm's backward cancels: float32 rounding differs)
                assert_close(q.grad, p.grad, f"step {step}, {name}.grad", atol=1e-4)
        assert_close(xs[1].grad, xs[0].grad, f"step {step}, x.grad", atol=1e-4)
        for (name, b), c in zip(eager.named_buffers(), wrapped.buffers()):
            assert_close(c, b, f"step {step}, {name}")
    assert eager.unused.grad is None and eager.branch.grad is None
    assert wrapped._engine.build_count == 2  # (batch 5, then symbolic sizes: both builds checked)


def test_adamw_weight_decay_skips_parameters_the_loss_does_not_reach():
    # AdamW decays and moves a parameter with a gradient, zero or not, and skips one whose .grad is None.
    torch.manual_seed(1)
    eager = ThreeOutputs()
    wrapped = ORTWrap(copy.deepcopy(eager), fallback=False, **ORT)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5) for m in (eager, wrapped)]
    for step in range(2):
        x = torch.randn(6, 6, generator=torch.Generator().manual_seed(step))
        for model, opt in zip((eager, wrapped), opts):
            opt.zero_grad(set_to_none=True)
            model(x)[0].sum().backward()
            opt.step()
    for (name, p), q in zip(eager.named_parameters(), wrapped.parameters()):
        assert_close(q.detach(), p.detach(), f"{name} after 2 AdamW steps")
    assert torch.equal(wrapped.module.b.weight, copy.deepcopy(eager).b.weight)  # (not moved)
