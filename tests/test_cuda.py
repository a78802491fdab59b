"""CUDA tensors run on the CUDA build of ORT (CUDAExecutionProvider). Skipped without a GPU and
the ortwrap[cuda] install (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
from parity import check_parity, seq_len
from test_models import SmallCNN, mlp
from tiny_gpt import GPTConfig, TinyGPT

pytestmark = pytest.mark.gpu


def test_mlp_on_cuda():
    w = check_parity(mlp, lambda b, g: ((torch.randn(b, 20, generator=g),), {}), device="cuda")
    assert "CUDAExecutionProvider" in w.programs()[0].runner._session.get_providers()


def test_cnn_batchnorm_on_cuda():
    check_parity(SmallCNN, lambda b, g: ((torch.randn(b, 3, 10, 10, generator=g),), {}), device="cuda", atol=1e-4)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_gpt_on_cuda(exporter):
    cfg = GPTConfig(vocab=97, d=32, heads=4, layers=2, max_len=16)

    def inputs(b, g):
        data = torch.randint(0, cfg.vocab, (b, seq_len(b, 13)), generator=g)
        return (data[:, :-1], data[:, 1:]), {}

    check_parity(
        lambda: TinyGPT(cfg),
        inputs,
        batch_sizes=(2, 3),
        loss_fn=lambda out: out[0],
        device="cuda",
        atol=1e-4,
        wrap_options={"exporter": exporter},
    )


def test_mixed_devices_are_refused():
    from ortwrap import ORTWrap, UnsupportedInputError

    w = ORTWrap(torch.nn.Linear(2, 2).cuda())
    with pytest.raises(UnsupportedInputError, match="several devices"):
        w(torch.randn(1, 2))


# Mixed precision on CUDA (issue 15): ORT's CUDA kernels compute in half precision, so the graph
# keeps eager's dtypes (HalfPrecisionOnCPUPass runs on CPU graphs only).
HALF_TOL = {torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}, torch.float16: {"atol": 5e-3, "rtol": 5e-3}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_on_cuda(dtype):
    w = check_parity(
        mlp,
        lambda b, g: ((torch.randn(b, 20, generator=g),), {}),
        device="cuda",
        autocast=lambda: torch.autocast("cuda", dtype=dtype),
        **HALF_TOL[dtype],
    )
    assert w.fallback_reason is None
    assert "HalfPrecisionOnCPUPass" not in [p.name for p in w.last_artifacts.passes if p.modified]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_model_on_cuda(dtype):
    w = check_parity(
        lambda: mlp().to(dtype),
        lambda b, g: ((torch.randn(b, 20, generator=g).to(dtype),), {}),
        device="cuda",
        lr=0.01,
        **{k: 2 * v for k, v in HALF_TOL[dtype].items()},
    )
    assert all(p.grad is None or p.grad.dtype == dtype for p in w.parameters())


def test_grad_scaler_on_cuda():
    """fp16 autocast with torch.amp.GradScaler: scaling, unscale, inf detection and the skipped
    step behave as in eager."""
    import copy

    from ortwrap import ORTWrap

    torch.manual_seed(0)
    eager = mlp().cuda()
    ours = ORTWrap(copy.deepcopy(eager), fallback=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, ours)]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**14) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(6, 20, generator=g)
        if step == 2:
            x[0, 0] = float("inf")
        x = x.cuda()
        for model, opt, sc in zip((eager, ours), opts, scalers):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
        assert scalers[1].get_scale() == scalers[0].get_scale(), step
    for p_o, p_e in zip(ours.parameters(), eager.parameters()):
        torch.testing.assert_close(p_o, p_e, **HALF_TOL[torch.float16])
