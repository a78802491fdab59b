"""Parity with eager PyTorch for whole models over several steps with changing batch sizes.

Runs on whichever engine the environment resolves (``engine="auto"``): the training engine in
``.venv``, ``engine="onnxruntime"`` in the engine's venv, where ``ORT_EXTRA=ort make test`` runs this
file too (the exporter fixture's two settings mean nothing there: the graphs come from AOTAutograd)."""

from __future__ import annotations

import pytest
import torch
from parity import check_parity, seq_len, signature_builds
from tiny_gpt import GPTConfig, TinyGPT
from torch import nn

pytestmark = pytest.mark.usefixtures("exporter")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


def test_mlp():
    w = check_parity(mlp, lambda b, g: ((torch.randn(b, 20, generator=g),), {}))
    builds, most = signature_builds(w)
    assert 1 <= builds <= most, "changing only the batch size must not re-export"


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.bn2 = nn.BatchNorm2d(8, momentum=0.3)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_cnn_batchnorm(train):
    # Buffers (running mean/var, num_batches_tracked) are compared after every step.
    check_parity(SmallCNN, lambda b, g: ((torch.randn(b, 3, 10, 10, generator=g),), {}), train=train)


class EncoderWithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 3)

    def forward(self, x, pad_mask):
        return self.head(self.layer(x, src_key_padding_mask=pad_mask))


def test_transformer_encoder_layer_with_padding_mask():
    def inputs(b, g):
        t = {4: 6, 7: 7, 3: 9}[b]  # the sequence length changes between steps
        x = torch.randn(b, t, 32, generator=g)
        mask = torch.zeros(b, t, dtype=torch.bool)
        mask[:, -2:] = True  # last two positions are padding
        return (x, mask), {}

    # The fast path of TransformerEncoderLayer is off in training and under autograd; both sides
    # take the same math path.
    w = check_parity(EncoderWithMask, inputs)
    builds, most = signature_builds(w)
    assert 1 <= builds <= most, "a new sequence length must not re-export"


class Attention(nn.Module):
    def __init__(self, batch_first: bool, masks: str) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=batch_first)
        self.batch_first = batch_first
        self.masks = masks

    def forward(self, x, pad):
        t = x.shape[1] if self.batch_first else x.shape[0]
        attn_mask = None
        if "causal" in self.masks:
            attn_mask = torch.triu(torch.full((t, t), float("-inf"), device=x.device), diagonal=1)
        kpm = pad if "padding" in self.masks else None
        out, weights = self.attn(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=True)
        return out, weights


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("masks", ["none", "padding", "causal+padding"])
def test_multihead_attention_across_sequence_lengths(batch_first, masks):
    """The sequence length of every step differs (6, then 7, then 9): nothing traced may keep it."""

    def inputs(b, g):
        t = {4: 6, 7: 7, 3: 9}[b]
        x = torch.randn(b, t, 16, generator=g)
        pad = torch.zeros(b, t, dtype=torch.bool)
        pad[0, -2:] = True
        return ((x if batch_first else x.transpose(0, 1).contiguous()), pad), {}

    w = check_parity(lambda: Attention(batch_first, masks), inputs)
    builds, most = signature_builds(w)
    assert 1 <= builds <= most


def test_gpt_lm_with_loss_inside():
    cfg = GPTConfig(vocab=97, d=32, heads=4, layers=2, max_len=16)

    lengths = iter((13, 9, 16))  # the sequence length changes every step

    def inputs(b, g):
        data = torch.randint(0, cfg.vocab, (b, next(lengths)), generator=g)
        return (data[:, :-1], data[:, 1:]), {}

    w = check_parity(lambda: TinyGPT(cfg), inputs, batch_sizes=(2, 3, 2), loss_fn=lambda out: out[0])
    builds, most = signature_builds(w)
    assert 1 <= builds <= most


class ScaledByBuffers(nn.Module):
    """A non-persistent buffer (as rotary tables are) next to a persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4), persistent=False)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 4))

    def forward(self, x):
        return self.l(x) * self.scale + self.shift


def test_non_persistent_buffers_are_fed_and_changes_are_seen(exporter):
    w = check_parity(ScaledByBuffers, lambda b, g: ((torch.randn(b, 4, generator=g),), {}))
    assert "scale" not in w.state_dict()  # still non-persistent after export
    x = torch.randn(3, 4)
    w.module.scale.mul_(3.0)  # an in-place change of the buffer is seen by the next step
    expected = w.module.l(x) * w.module.scale + w.module.shift
    torch.testing.assert_close(w(x), expected, atol=1e-5, rtol=1e-4)


class LogitsViewAndLoss(nn.Module):
    """Returns logits that are a view (Reshape) of a MatMul also fed to cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 6)
        self.w = nn.Parameter(torch.randn(6, 5))

    def forward(self, x):
        y = self.l(x).reshape(-1, 6) @ self.w
        logits = y.reshape(x.shape[0], x.shape[1], 5)
        target = torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.long)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 5), target), logits.float()


def test_returned_view_outputs_survive_the_backward(exporter):
    """ORT may reuse the buffer behind a view output during the backward: the output the user holds
    must keep its forward values (check_parity compares outputs again after backward)."""
    check_parity(
        LogitsViewAndLoss, lambda b, g: ((torch.randn(b, seq_len(b, 3), 8, generator=g),), {}), loss_fn=lambda o: o[0]
    )
