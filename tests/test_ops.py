"""One parity test per op family that common models need and that ORT must differentiate.

Each model puts trainable parameters in front of the op so its gradient flows through it. Runs on
whichever engine the environment resolves, as tests/test_models.py (``ORT_EXTRA=ort make test`` runs it
on ``engine="onnxruntime"``, once: the exporter does not apply there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import check_parity, seq_len
from torch import nn

pytestmark = pytest.mark.usefixtures("exporter", "one_exporter_on_the_engine")


def seq_inputs(feat: int, seq: int = 5):
    return lambda b, g: ((torch.randn(b, seq, feat, generator=g),), {})


def img_inputs(c: int = 3, hw: int = 8):
    return lambda b, g: ((torch.randn(b, c, hw, hw, generator=g),), {})


class Pre(nn.Module):
    """Linear -> op -> Linear, so parameters before and after the op get gradients."""

    def __init__(self, op, d: int = 8, d_out: int | None = None) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.op = op
        self.b = nn.Linear(d if d_out is None else d_out, 3)

    def forward(self, x):
        return self.b(self.op(self.a(x)))


class Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_layer_norm():
    check_parity(lambda: Pre(nn.LayerNorm(8)), seq_inputs(8))


def test_layer_norm_without_affine():
    check_parity(lambda: Pre(nn.LayerNorm(8, elementwise_affine=False)), seq_inputs(8))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    check_parity(lambda: Pre(Fn(lambda x: F.gelu(x, approximate=approximate))), seq_inputs(8))


@pytest.mark.parametrize(
    "fn", [lambda x: F.softmax(x, -1), lambda x: F.log_softmax(x, -1)], ids=["softmax", "log_softmax"]
)
def test_softmax(fn):
    check_parity(lambda: Pre(Fn(fn)), seq_inputs(8))


class Attention(nn.Module):
    def __init__(self, causal: bool, with_mask: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 4)
        self.causal, self.with_mask = causal, with_mask

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = None
        if self.with_mask:
            mask = torch.ones(t, t, dtype=torch.bool).tril()
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return self.out(a.transpose(1, 2).reshape(b, t, 16))


@pytest.mark.parametrize(
    "causal,with_mask", [(False, False), (True, False), (False, True)], ids=["plain", "causal", "mask"]
)
def test_scaled_dot_product_attention(causal, with_mask):
    check_parity(lambda: Attention(causal, with_mask), seq_inputs(16, seq=6))


class EmbedLM(nn.Module):
    def __init__(self, padding_idx: int | None) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=padding_idx)
        self.head = nn.Linear(8, 20)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def ids_inputs(b, g):
    ids = torch.randint(0, 20, (b, seq_len(b, 6)), generator=g)
    ids[:, -2:] = 0  # padding tokens
    return (ids,), {}


@pytest.mark.parametrize("padding_idx", [None, 0], ids=["no_padding", "padding_idx"])
def test_embedding(padding_idx):
    check_parity(lambda: EmbedLM(padding_idx), ids_inputs)


class CELoss(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.l = nn.Linear(8, 5)
        self.kw = kw

    def forward(self, x, y):
        return F.cross_entropy(self.l(x), y, **self.kw)


def ce_inputs(b, g):
    y = torch.randint(0, 5, (b,), generator=g)
    y[0] = -100
    return (torch.randn(b, 8, generator=g), y), {}


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"ignore_index": -100},
        {"label_smoothing": 0.1},
        {"ignore_index": -100, "label_smoothing": 0.1},
        {"reduction": "sum"},
    ],
    ids=["mean", "ignore_index", "label_smoothing", "both", "sum"],
)
def test_cross_entropy(kw):
    if "ignore_index" not in kw:

        def inputs(b, g):
            return (torch.randn(b, 8, generator=g), torch.randint(0, 5, (b,), generator=g)), {}
    else:
        inputs = ce_inputs
    check_parity(lambda: CELoss(**kw), inputs, loss_fn=lambda out: out)


def test_nll_loss():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(8, 5)

        def forward(self, x, y):
            return F.nll_loss(F.log_softmax(self.l(x), -1), y, ignore_index=-100)

    check_parity(M, ce_inputs, loss_fn=lambda out: out)


def test_nll_loss_on_non_log_softmax_input():
    # Not fused into SoftmaxCrossEntropyLoss by the exporter: NegativeLogLikelihoodLoss is rewritten.
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(8, 5)

        def forward(self, x, y):
            z = self.l(x)
            return F.nll_loss(z - z.logsumexp(-1, keepdim=True), y, ignore_index=-100)

    w = check_parity(M, ce_inputs, loss_fn=lambda out: out)
    if w.last_artifacts is None:  # (engine="onnxruntime": AOTAutograd's graphs, no training-engine artifacts)
        return
    assert "NegativeLogLikelihoodLoss" not in {n.op_type for n in w.last_artifacts.pre_grad.graph.node}


class Conv(nn.Module):
    def __init__(self, tail: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.tail = tail
        self.head = nn.LazyLinear(3)

    def forward(self, x):
        return self.head(self.tail(self.conv(x)).flatten(1))


@pytest.mark.parametrize(
    "tail",
    [
        lambda: nn.Identity(),
        lambda: nn.MaxPool2d(2),
        lambda: nn.AvgPool2d(2),
        lambda: nn.AdaptiveAvgPool2d(2),
        lambda: nn.BatchNorm2d(4),
        lambda: nn.GroupNorm(2, 4),
        lambda: nn.Upsample(scale_factor=2, mode="nearest"),
        lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
    ],
    ids=[
        "conv",
        "maxpool",
        "avgpool",
        "adaptive_avgpool",
        "batchnorm",
        "groupnorm",
        "upsample_nearest",
        "upsample_bilinear",
    ],
)
def test_cnn_ops(tail):
    def make():
        m = Conv(tail())
        m(torch.randn(1, 3, 8, 8))  # materialize the lazy head
        return m

    check_parity(make, img_inputs())


def test_einsum():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 6))
            self.v = nn.Parameter(torch.randn(6))

        def forward(self, x):
            return torch.einsum("bsd,de,e->bs", x, self.w, self.v)

    check_parity(M, seq_inputs(8))


EINSUM_SIZES = {"h": 2, "i": 3, "q": 3, "j": 4, "k": 5, "s": 5, "d": 6, "e": 7}


@pytest.mark.parametrize(
    "equation,kinds",
    [
        ("bij,bjk->bik", "xx"),
        ("bhqd,bhkd->bhqk", "xx"),
        ("ij,jk->ik", "xp"),
        ("bi,bi->b", "xx"),
        ("bij->bji", "x"),
        ("i,j->ij", "xp"),
        ("bsd,de,e->bs", "xpp"),
        ("bij,jk->bik", "xp"),
        ("bik,hkj->bhij", "xp"),
        ("bhij,bij->bhi", "xx"),
        ("bhd,hde->be", "xp"),  # two contracted labels merged into one MatMul K
        ("bij,jk->bk", "xp"),  # i summed out before the MatMul
        ("bs,s->", "xp"),  # scalar output
        ("bj,jk", "xp"),  # implicit output: "bk"
    ],
)
def test_einsum_equations(equation, kinds):
    """Operands marked "x" are inputs whose first label is the (changing) batch size, "p" parameters."""
    subs = equation.split("->")[0].split(",")

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.5))
            self.ws = nn.ParameterList(
                nn.Parameter(torch.randn(*(EINSUM_SIZES[c] for c in s))) for s, kind in zip(subs, kinds) if kind == "p"
            )

        def forward(self, *xs):
            xs, ws = iter(xs), iter(self.ws)
            operands = [next(xs) if kind == "x" else next(ws) for kind in kinds]
            return torch.einsum(equation, *operands) * self.scale

    def inputs(bs, g):
        batch = {subs[0][0]: bs}
        args = tuple(
            torch.randn(*({**EINSUM_SIZES, **batch}[c] for c in s), generator=g).requires_grad_()
            for s, kind in zip(subs, kinds)
            if kind == "x"
        )
        return args, {}

    check_parity(M, inputs)
