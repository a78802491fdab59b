"""Parity with eager PyTorch for whole models over several steps with changing batch sizes."""

from __future__ import annotations

import pytest
import torch
from parity import check_parity
from tiny_gpt import GPTConfig, TinyGPT
from torch import nn

pytestmark = pytest.mark.usefixtures("exporter")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


def test_mlp():
    w = check_parity(mlp, lambda b, g: ((torch.randn(b, 20, generator=g),), {}))
    assert w.export_count == 1, "changing only the batch size must not re-export"


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
        x = torch.randn(b, 6, 32, generator=g)
        mask = torch.zeros(b, 6, dtype=torch.bool)
        mask[:, -2:] = True  # last two positions are padding
        return (x, mask), {}

    # The fast path of TransformerEncoderLayer is off in training and under autograd; both sides
    # take the same math path.
    check_parity(EncoderWithMask, inputs)


def test_gpt_lm_with_loss_inside():
    cfg = GPTConfig(vocab=97, d=32, heads=4, layers=2, max_len=16)

    def inputs(b, g):
        data = torch.randint(0, cfg.vocab, (b, 13), generator=g)
        return (data[:, :-1], data[:, 1:]), {}

    w = check_parity(lambda: TinyGPT(cfg), inputs, batch_sizes=(2, 3, 2), loss_fn=lambda out: out[0])
    assert w.export_count == 1


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
    check_parity(LogitsViewAndLoss, lambda b, g: ((torch.randn(b, 3, 8, generator=g),), {}), loss_fn=lambda o: o[0])
