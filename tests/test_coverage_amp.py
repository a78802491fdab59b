"""Model coverage in mixed precision: the zoo of ``tests/model_zoo.py`` trains on ORT under
``torch.autocast("cpu", dtype=torch.bfloat16)`` with both exporters, and a representative subset (a
GPT-2 and a Llama LM, a ResNet with BatchNorm, an LSTM->GRU stack) as ``model.to(torch.bfloat16)``
and ``model.to(torch.float16)``, and a few under float16 autocast, like eager.

Each case runs the zoo's three steps (changing sequence length or image size), fallback off, and
``check_parity`` compares outputs (and their dtypes), the loss, every gradient and buffer with eager
run in the same precision. Autocast runs on the ``native`` route (bf16 GEMMs inside the graph; the
default, ``auto``, measures which route is faster and takes ``float32`` for graphs as small as
these, tests/test_gemm_choice.py) and a few cases on the ``float32`` route (float32 between eager's
bf16 boundaries).

Tolerances: check_parity's ``atol == rtol == t``, the absolute part relative to each tensor's
largest element (at least 1). Measured on 2026-11-28 (AMD EPYC Zen4-class, avx512_bf16, no AMX;
torch 2.13.0) as the smallest ``t`` each case passes with, over its three steps:

- bf16 autocast, ``native`` route: transformers (encoders, decoders, MoE, encoder-decoders, ViT,
  Whisper) 1e-4..1.1e-2, OPT 2.3e-2 (an attention bias gradient), RNNs 3e-3..5e-3, ConvNeXt and
  the UNets 7e-4..5e-3, MobileNetV3 3e-3; ResNet 7e-2 and the wav2vec2 encoder 2.1e-1 (below).
  The ``float32`` route: the same to within 2x (GPT-2 2e-3, ResNet 8e-2).
- ``model.to(torch.bfloat16)``: LMs 2.7e-3, LSTM->GRU 4.8e-3, ResNet 5.8e-2.
- ``model.to(torch.float16)``: LMs 3.2e-4, LSTM->GRU 6e-4, ResNet 3.4e-2.
- float16 autocast: LMs and T5 2.2e-4..5.1e-4, ResNet 4.7e-2.

So :data:`BF16` (3e-2) and :data:`FP16` (5e-3), with the exceptions of :data:`AMP_TOL` /
:data:`HALF_TOL`. The large ones are eager's own rounding, not ORT's: eager runs BatchNorm in bf16
(ResNet), where ORT computes in float32; against a float64 run of the same weights, ORT's ResNet
gradients are 35x closer than eager's under autocast (1.2e-3 against 4.3e-2), and 5-100x closer per
parameter as a bf16 model (stem conv weight: eager 3.7e-2, ORT 5e-3). The wav2vec2
encoder (a conv feature extractor with LayerNorms over 16 channels) is as far from float64 in eager
autocast (2.2e-1; ORT 1.9e-1), and its distance to eager changes with the thread count: it is an
``xfail`` (:data:`AMP_XFAIL`). (Measured with 1 thread; the suite runs 2, which moves these by
up to 1.5x.)

AdamW with ``eps=1e-5`` for autocast (as tests/test_coverage.py), SGD for half-precision models:
Adam normalizes each update, so a float16 gradient that is rounding noise on both sides gets a
full learning-rate step in a random direction.

The default selection (not ``slow``) runs the TorchScript ResNet under autocast (the capture that
failed on autocast's cast cache), the LSTM->GRU stack with dynamo, a GPT-2 on the ``float32``
route, and half-precision Llama and ResNet; the rest is ``slow``.
"""

from __future__ import annotations

import pytest
import torch
from model_zoo import BATCH_SIZES, BY_NAME, CASES
from parity import check_parity, default_loss
from test_coverage import ENGINE_XFAIL

pytest.importorskip("transformers")

BF16 = 3e-2
FP16 = 5e-3
#: bf16 autocast tolerance where a case needs more than :data:`BF16` (measured need in brackets).
AMP_TOL = {"opt": 5e-2, "resnetish": 0.15}  # 2.3e-2, 7.9e-2
#: (case, dtype) -> tolerance where a half-precision model needs more than BF16/FP16.
HALF_TOL = {("resnetish", torch.bfloat16): 0.12, ("resnetish", torch.float16): 0.07}  # 5.8e-2, 3.4e-2

#: cases whose autocast run no tolerance checks (the float32 run passes): why.
AMP_XFAIL = {
    "wav2vec2_encoder": (
        "ill-conditioned in bf16: eager autocast's own gradients are 0.22 (normalized) from a float64 run "
        "(ORT's 0.19), and ORT vs eager reaches 0.21 with 1 thread, 0.33 with 2 (encoder.layer_norm.bias, "
        "step 2): a tolerance that passes it would pass a wrong implementation"
    ),
}
#: (case, exporter) run by default under autocast; the rest is slow.
AMP_FAST = {("resnetish", "torchscript"), ("lstm_gru", "dynamo")}
#: cases also run on the float32 route; (case, exporter) of them run by default.
FLOAT32_ROUTE = ("gpt2", "llama", "bert", "resnetish", "unet_resize", "lstm_gru")
FLOAT32_ROUTE_FAST = {("gpt2", "torchscript")}
#: the half-precision subset: a transformer LM (two), a CNN with BatchNorm, an RNN.
HALF_CASES = ("gpt2", "llama", "resnetish", "lstm_gru")
HALF_FAST = {("llama", torch.bfloat16, "dynamo"), ("resnetish", torch.float16, "torchscript")}

EXPORTERS = ("torchscript", "dynamo")


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5)


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _marks(case, exporter, fast: bool) -> list:
    marks = [] if fast else [pytest.mark.slow]
    if exporter in case.xfail:  # the float32 run fails too
        marks.append(pytest.mark.xfail(strict=False, reason=case.xfail[exporter]))
    return marks


def _train_case(case, tol, *, wrap_options, make_model=None, make_inputs=None, **parity):
    """``check_parity`` of a zoo case at ``tol`` (atol and rtol), AdamW unless ``parity`` says
    otherwise; returns the wrapper after asserting it did not fall back."""
    parity.setdefault("optimizer", adamw)
    w = check_parity(
        make_model or case.make_model,
        make_inputs or case.make_inputs,
        batch_sizes=BATCH_SIZES,
        loss_fn=case.loss or default_loss,
        atol=tol,
        rtol=tol,
        wrap_options=wrap_options,
        **parity,
    )
    assert w.fallback_reason is None
    return w


def _autocast_params():
    for case in CASES:
        for exporter in EXPORTERS:
            marks = _marks(case, exporter, (case.name, exporter) in AMP_FAST)
            if case.name in AMP_XFAIL and exporter not in case.xfail:
                marks.append(pytest.mark.xfail(strict=False, reason=AMP_XFAIL[case.name]))
            yield pytest.param(case, exporter, id=f"{case.name}-{exporter}", marks=marks)


@pytest.mark.parametrize("case, exporter", list(_autocast_params()))
def test_architecture_trains_under_autocast(case, exporter):
    _train_case(
        case, AMP_TOL.get(case.name, BF16), autocast=bf16_autocast,
        wrap_options={"exporter": exporter, "half_compute": "native"},
    )  # fmt: skip


def _float32_route_params():
    for name in FLOAT32_ROUTE:
        case = BY_NAME[name]
        for exporter in EXPORTERS:
            fast = (name, exporter) in FLOAT32_ROUTE_FAST
            yield pytest.param(case, exporter, id=f"{name}-{exporter}", marks=_marks(case, exporter, fast))


@pytest.mark.parametrize("case, exporter", list(_float32_route_params()))
def test_architecture_trains_under_autocast_on_the_float32_route(case, exporter):
    """``half_compute="float32"``: what ``auto`` picks on a CPU without bf16 instructions."""
    w = _train_case(
        case,
        AMP_TOL.get(case.name, BF16),
        autocast=bf16_autocast,
        wrap_options={"exporter": exporter, "half_compute": "float32"},
    )
    assert "TorchGemmOnCPUPass" not in [p.name for p in w.last_artifacts.passes if p.modified]


#: engine="onnxruntime" under bf16 autocast (docs/engines.md): cases run by default in the engine's own
#: venv (beside the training build they are slow, as tests/test_coverage.py's engine cases).
ENGINE_AMP_FAST = ("gpt2",)


def _engine_autocast_params():
    from ortwrap.engines import is_onnxruntime_available, is_training_available

    bf16 = False
    if is_onnxruntime_available():
        from ortwrap.engines.onnxruntime.session import binds_bfloat16

        bf16 = binds_bfloat16()
    for case in CASES:
        marks = [] if case.name in ENGINE_AMP_FAST and not is_training_available() else [pytest.mark.slow]
        if not bf16:  # (the training build's 1.19.2 binds no bfloat16 tensor: the engine falls back there)
            marks.append(pytest.mark.skip(reason="bfloat16 IOBinding needs onnxruntime >= 1.20"))
        why = ENGINE_XFAIL.get(case.name) or AMP_XFAIL.get(case.name)
        if why:
            marks.append(pytest.mark.xfail(strict=False, reason=why))
        yield pytest.param(case, "onnxruntime", id=f"{case.name}-onnxruntime", marks=marks)


@pytest.mark.parametrize("case, engine", list(_engine_autocast_params()), indirect=["engine"])
def test_architecture_trains_under_autocast_on_the_onnxruntime_engine(case, engine):
    """AOTAutograd's graphs with autocast's casts, each half-precision op computed in float32 between
    Casts on onnxruntime's CPU provider (engines/onnxruntime/half.py), against eager autocast."""
    w = _train_case(case, AMP_TOL.get(case.name, BF16), autocast=bf16_autocast, wrap_options={})
    assert w._engine.fallback_calls == 0


#: cases also run under float16 autocast (eager's LSTM has no float16 oneDNN kernel on CPU).
FP16_AUTOCAST = ("gpt2", "llama", "t5", "resnetish")
#: float16 autocast tolerance where a case needs more than :data:`FP16` (measured 4.7e-2).
FP16_AMP_TOL = {"resnetish": 0.1}


@pytest.mark.slow
@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", FP16_AUTOCAST)
def test_architecture_trains_under_float16_autocast(name, exporter):
    """``torch.autocast("cpu", dtype=torch.float16)``: float16 always computes in float32 inside."""
    case = BY_NAME[name]
    _train_case(
        case,
        FP16_AMP_TOL.get(name, FP16),
        autocast=lambda: torch.autocast("cpu", dtype=torch.float16),
        wrap_options={"exporter": exporter},
    )


def _cast_floats(obj, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(v, dtype) for v in obj)
    return obj


def _half_params():
    for name in HALF_CASES:
        case = BY_NAME[name]
        for dtype, route in ((torch.bfloat16, "auto"), (torch.bfloat16, "float32"), (torch.float16, "auto")):
            for exporter in EXPORTERS:
                fast = (name, dtype, exporter) in HALF_FAST and route == "auto"
                short = ("bf16" if dtype is torch.bfloat16 else "fp16") + (
                    "-float32route" if route == "float32" else ""
                )
                yield pytest.param(
                    case, dtype, route, exporter, id=f"{name}-{short}-{exporter}", marks=_marks(case, exporter, fast)
                )


@pytest.mark.parametrize("case, dtype, route, exporter", list(_half_params()))
def test_half_precision_architecture_trains(case, dtype, route, exporter):
    """``model.to(dtype)`` with inputs in ``dtype``: outputs and gradients in eager's dtypes (bf16
    also on the ``float32`` route: the measured needs are the same)."""
    w = _train_case(
        case,
        HALF_TOL.get((case.name, dtype), BF16 if dtype is torch.bfloat16 else FP16),
        make_model=lambda: case.make_model().to(dtype),
        make_inputs=lambda b, g: _cast_floats(case.make_inputs(b, g), dtype),
        optimizer=sgd,
        wrap_options={"exporter": exporter, "half_compute": route},
    )
    assert all(p.grad is None or p.grad.dtype == dtype for p in w.parameters())
