"""Ops the OpInfo sweep (issue 24) found refused that now train with eager's numbers, each against
eager PyTorch: outputs and every input gradient, under both exporters (``test_op_fixes.check``).

- ``special.erfcx`` / ``special.log_ndtr`` (dynamo): torchlib's ``exp(x^2) * (1 - erf(x))`` failed
  ORT's Pow gradient (an int64 exponent) and overflows to NaN for large x; ``log_ndtr``'s
  decomposition differentiated its unused branch (inf). Both run as ATen nodes (``ops.ATEN_OPS``);
- ``native_layer_norm`` returning its mean and rstd (dynamo): ORT's builder found no gradient to
  yield for them; they are stop-gradient, as eager's backward ignores them;
- ``tile`` of a 0-d tensor with no repeats: ONNX ``Tile`` needs rank >= 1 (both exporters);
- ``nll_loss(reduction="none")`` (dynamo declared its output 0-d: ``export/adapter.py`` asks ONNX
  inference) and ``nll_loss`` with class weights (``DecomposeNLLLossPass`` scales by them).
"""

from __future__ import annotations

import pytest
import torch
from test_op_fixes import check, randn

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
