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
