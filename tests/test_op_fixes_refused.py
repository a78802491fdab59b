"""Ops the OpInfo sweep (issue 24) found refused that now train with eager's numbers, each against
eager PyTorch: outputs and every input gradient, under both exporters (``test_op_fixes.check``).

- ``special.erfcx`` / ``special.log_ndtr`` (dynamo): torchlib's ``exp(x^2) * (1 - erf(x))`` failed
  ORT's Pow gradient (an int64 exponent) and overflows to NaN for large x; ``log_ndtr``'s
  decomposition differentiated its unused branch (inf). Both run as ATen nodes (``ops.ATEN_OPS``);
- ``native_layer_norm`` returning its mean and rstd (dynamo): ORT's builder found no gradient to
  yield for them; they are stop-gradient, as eager's backward ignores them;
- ``tile`` of a 0-d tensor with no repeats: ONNX ``Tile`` needs rank >= 1 (both exporters);
- ``nll_loss(reduction="none")`` (dynamo declared its output 0-d: ``export/adapter.py`` asks ONNX
  inference) and ``nll_loss`` with class weights (``DecomposeNLLLossPass`` scales by them);
- ``bernoulli`` and ``normal``: ONNX's random ops have no ORT gradient; as ATen nodes PyTorch draws
  and their gradient is eager's zeros (``grad/aten.py``'s ``_ZERO_GRADIENT_DRAWS``);
- eval-mode ``batch_norm`` of running statistics passed as inputs (dynamo): its saved statistics
  are new empty values, as eager's;
- ``unsafe_chunk`` (dynamo): written as torchlib's ``chunk`` (a ``Split``);
- ``diagonal_scatter`` (dynamo): an ATen node (the decomposition wrote into a view);
- ``cross_entropy`` of class probabilities (dynamo): eager's sum of target times log-softmax;
- a non-constant ``pad`` of the last dim of a 4-D input (``ortwrap_ops::pad`` keeps the pads F.pad needs).
"""

from __future__ import annotations

import pytest
import torch
from test_op_fixes import Fn, check, randn

from ortwrap import ORTWrap

pytestmark = pytest.mark.usefixtures("exporter")


def test_erfcx_large_arguments(exporter):
    # exp(x^2) overflows float32 from x ~ 9.4: the ONNX formula gave inf * 0 = NaN there
    x = torch.tensor([-3.0, -0.5, 0.0, 0.7, 4.0, 12.0, 30.0]).requires_grad_()
    check(torch.special.erfcx, [x], exporter)


def test_log_ndtr_tails(exporter):
    x = torch.tensor([-12.0, -6.0, -1.5, 0.0, 0.9, 3.0, 8.0]).requires_grad_()
    check(torch.special.log_ndtr, [x], exporter)


@pytest.mark.parametrize("normalized", [[3], [2, 3]], ids=["last", "two"])
def test_native_layer_norm_statistics(exporter, normalized, request):
    if exporter == "torchscript":
        # TorchScript writes native_layer_norm out in ReduceMean/Sub/Pow/...: ORT's HandleBroadcasting
        # fails on a gradient shape it cannot infer (not fixed here; OpInfo's own samples pass)
        request.applymarker(pytest.mark.xfail(strict=True, reason="ORT HandleBroadcasting (TorchScript form)"))
    w, b = randn(*normalized, seed=1), randn(*normalized, seed=2)
    check(lambda x, w, b: torch.native_layer_norm(x, normalized, w, b, 0.5), [randn(4, 2, 3), w, b], exporter)


def test_tile_zero_d(exporter):
    check(lambda x: torch.tile(x, ()) * 3.0, [torch.tensor(1.5).requires_grad_()], exporter)
    check(lambda x: torch.tile(x, (2, 3)), [torch.tensor(-0.5).requires_grad_()], exporter)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_nll_loss(exporter, reduction, weighted):
    # "none" under dynamo: the exporter declared the [N] loss 0-d (refused as a wrong translation);
    # class weights: DecomposeNLLLossPass refused them (ORT has no NegativeLogLikelihoodLoss gradient)
    t = torch.tensor([0, 2, 1, 2, -100])
    if not weighted:
        fn = lambda x, t: torch.nn.functional.nll_loss(x, t, reduction=reduction)  # noqa: E731
        check(fn, [randn(5, 3), t], exporter)
        return
    fn = lambda x, t, w: torch.nn.functional.nll_loss(x, t, weight=w, reduction=reduction)  # noqa: E731
    check(fn, [randn(5, 3), t, torch.tensor([0.5, 2.0, 1.5])], exporter)


RANDOM_OPS = [
    lambda p, s: torch.bernoulli(p) * s,
    lambda m, s: torch.normal(m, s),
    lambda m, s: torch.normal(m, 2.0) + torch.normal(0.5, s),
]


@pytest.mark.parametrize("fn", RANDOM_OPS, ids=["bernoulli", "normal", "normal_scalar"])
def test_random_op_zero_gradient(exporter, fn):
    # ONNX Bernoulli/RandomNormalLike have no ORT gradient (refused); eager's gradient of the
    # probabilities, mean and std is zeros (no reparametrization), and the draws follow the parameters
    torch.manual_seed(0)
    a = torch.rand(200, 50).clamp(0.05, 0.95).requires_grad_()
    s = (torch.rand(200, 50) + 0.5).requires_grad_()
    m = ORTWrap(Fn(fn), fallback=False, exporter=exporter, build_cache=False)
    out = m(a, s)
    want = fn(a, s)
    assert out.shape == want.shape and out.dtype == want.dtype
    w = torch.rand(out.shape) + 0.5
    got_grads = torch.autograd.grad((out * w).sum(), [a, s], allow_unused=True)
    want_grads = torch.autograd.grad((want * w).sum(), [a, s], allow_unused=True)
    for i, (g, e) in enumerate(zip(got_grads, want_grads)):
        assert (g is None) == (e is None), f"input {i}: gradient {g is not None} vs eager {e is not None}"
        assert g.shape == e.shape, f"input {i}"
        if i == 1 and fn is RANDOM_OPS[0]:  # bernoulli(p) * s: s's gradient reads the forward's draw
            torch.testing.assert_close(g, w * (out.detach() / s.detach()))
        else:
            assert bool((g == 0).all()) and bool((e == 0).all()), f"input {i}: a gradient that is not zero"
    # the draws: same distribution as eager's (means over 10,000 draws)
    o_mean, e_mean = float(out.detach().mean()), float(want.detach().mean())
    assert abs(o_mean - e_mean) < 0.1 * (1 + abs(e_mean))
    assert not torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, rm, rv, w, b: torch.nn.functional.batch_norm(x, rm, rv, w, b, training=False, momentum=-1.2),
        lambda x, rm, rv, w, b: torch._native_batch_norm_legit(x, w, b, rm, rv, False, 0.1, 1e-5)[0],
    ],
    ids=["batch_norm", "native_batch_norm_legit"],
)
def test_eval_batch_norm_of_input_statistics(exporter, fn):
    # dynamo: the saved statistics were the running ones, declared [0] (eager's empty ones): the
    # running-stat inputs became [0] and ORT's gradient failed at run time
    rm, rv = torch.tensor([0.3, -0.2]), torch.tensor([0.5, 2.0])
    check(fn, [randn(3, 2, 4), rm, rv, randn(2, seed=1), randn(2, seed=2)], exporter)


@pytest.mark.parametrize("chunks, dim", [(2, 0), (2, 1)], ids=["even_dim0", "uneven"])
def test_unsafe_chunk(exporter, chunks, dim, request):
    # dynamo: the decomposition's unsafe_split of a computed size failed the constant folder. (Fewer
    # chunks than asked, 5 into 4 as 2, 2, 1, fails ORT's Split at run time, as torchlib's chunk does.)
    if exporter == "torchscript":
        request.applymarker(pytest.mark.xfail(strict=True, reason="TorchScript: ORT has no aten::unsafe_chunk"))
    check(lambda x: torch.unsafe_chunk(x * 2.0, chunks, dim), [randn(4, 5, 3)], exporter)


@pytest.mark.parametrize("offset", [0, 1, -2])
def test_diagonal_scatter(exporter, offset):
    # dynamo: the exporter's decomposition wrote a copy_to into a view (refused); an ATen node now
    n = 5 - abs(offset)
    check(lambda x, src: torch.diagonal_scatter(x * 1.5, src * src, offset), [randn(5, 5), randn(n, seed=1)], exporter)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "shape, weighted, smoothing",
    [((4, 3), False, 0.0), ((4, 3, 2), True, 0.0), ((4, 3), True, 0.2), ((3,), False, 0.1)],
    ids=["2d", "3d_weighted", "weighted_smoothed", "unbatched_smoothed"],
)
def test_cross_entropy_probability_targets(exporter, reduction, shape, weighted, smoothing, request):
    # dynamo: SoftmaxCrossEntropyLoss of a float target, which ORT refused (class indices only)
    if exporter == "torchscript" and not (weighted and smoothing):
        # refused at build (torch's symbolic writes a wrong rank; not fixed here)
        request.applymarker(pytest.mark.xfail(strict=True, reason="TorchScript: probability targets refused"))
    target = torch.softmax(randn(*shape, seed=3), dim=1 if len(shape) > 1 else 0).detach().requires_grad_()
    w = torch.tensor([0.5, 2.0, 1.5]) if weighted else None
    fn = lambda x, t: torch.nn.functional.cross_entropy(  # noqa: E731
        x, t, weight=w, reduction=reduction, label_smoothing=smoothing
    )
    check(fn, [randn(*shape), target], exporter)


@pytest.mark.parametrize(
    "mode, pad, shape",
    [
        ("replicate", (-1, 2, 0, 0), (2, 3, 4, 4)),
        ("reflect", (1, 2, 0, 0), (2, 3, 4, 5)),
        ("circular", (2, 1, 0, 0), (2, 3, 4, 5)),
    ],
    ids=["replicate_negative", "reflect_last_dim", "circular_last_dim"],
)
def test_pad_of_the_last_dim_only(exporter, mode, pad, shape):
    # dynamo: ortwrap_ops::pad dropped the zero pads of leading dims, leaving 2 values for a 4-D
    # input, which F.pad's non-constant modes refuse
    check(lambda x: torch.nn.functional.pad(x * 1.5, pad, mode=mode), [randn(*shape)], exporter)
