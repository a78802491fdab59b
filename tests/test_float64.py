"""float64 models train on ONNX Runtime like eager PyTorch, to float64 precision.

ORT 1.19.2's CPU provider lacks float64 kernels for some ops and for some of their gradients
(ReluGrad, SoftmaxGrad_13, Erf, Conv, ...); ``DoublePrecisionOnCPUPass`` runs those as PyTorch ops.
Every test compares outputs and every parameter gradient with eager at ~1e-10 (a float32 step
anywhere, a float32 constant or attribute, would miss by 1e-8 or more), with both exporters and
changing batch (and sequence) sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import check_parity, no_exporter, seq_len
from torch import nn

from ortwrap import ORTWrap, PassError

pytestmark = pytest.mark.usefixtures("exporter")

ATOL = 1e-10
RTOL = 1e-9


def _double(make):
    def build():
        torch.manual_seed(0)
        return make().double()

    return build


def _vectors(features: int):
    def make(b, g):
        return (torch.randn(b, features, generator=g, dtype=torch.float64),), {}

    return make


def _sequences(features: int, base: int = 6):
    def make(b, g):
        return (torch.randn(b, seq_len(b, base), features, generator=g, dtype=torch.float64),), {}

    return make


class Activations(nn.Module):
    """Each activation on its own branch of a shared projection (a wrong one shows in its gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.out = nn.Linear(16 * 7, 3)

    def forward(self, x):
        h = self.proj(x)
        parts = [
            F.relu(h),
            F.gelu(h),
            F.gelu(h, approximate="tanh"),
            F.silu(h),
            F.leaky_relu(h, 0.01),
            F.softmax(h, dim=-1),
            F.log_softmax(h, dim=-1),
        ]
        return self.out(torch.cat(parts, dim=-1))


class Constants(nn.Module):
    """Python scalars whose float32 rounding would show: 1/3, 0.1, 2**-0.5, a LeakyReLU slope."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x) * (1 / 3) + 0.1
        return F.leaky_relu(y, 0.3) / 7.0 + torch.tanh(y) * (2**-0.5) + y.pow(2) * 0.7


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.norm = nn.LayerNorm(16, eps=1e-6)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, 16)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.norm(self.conv1(x))), 2)
        h = F.avg_pool2d(F.gelu(self.conv2(h)), 2)
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


def _images(b, g):
    return (torch.randn(b, 3, 16, 16, generator=g, dtype=torch.float64),), {}


CASES = {
    "mlp": (
        lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4)),
        _vectors(8),
    ),
    "activations": (Activations, _vectors(8)),
    "constants": (Constants, _vectors(8)),
    "layer_norm": (lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-5), nn.Tanh()), _sequences(8)),
    "sdpa": (Attention, _sequences(16)),
    "transformer_layer": (
        lambda: nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
        _sequences(16),
    ),
    "conv_groupnorm_pools": (ConvNet, _images),
}


@pytest.mark.parametrize("case", list(CASES))
def test_float64_model_trains_like_eager(case):
    make_model, make_inputs = CASES[case]
    w = check_parity(_double(make_model), make_inputs, atol=ATOL, rtol=RTOL)
    assert w.fallback_reason is None
    assert len(w.programs()) == 1  # the changing batch and sequence sizes reuse one graph


@pytest.mark.parametrize("case", list(CASES))
def test_float64_inference_matches_eager(case, exporter):
    """Graphs without a backward (eval mode, ``torch.no_grad()``) get ORT's inference fusions
    (FastGelu, FusedMatMul) and the forward ops' float attributes: float64 results stay eager's."""
    import copy

    from parity import assert_close

    make_model, make_inputs = CASES[case]
    eager = _double(make_model)().eval()
    w = ORTWrap(copy.deepcopy(eager), fallback=False, exporter=exporter)
    g = torch.Generator().manual_seed(1)
    for b in (4, 7, 3):
        (x,), _ = make_inputs(b, g)
        with torch.no_grad():
            assert_close(w(x), eager(x), f"batch {b}", atol=1e-12, rtol=1e-12)


def test_float64_llama_trains_like_eager():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip

    def inputs(b, g):
        ids = torch.randint(0, 64, (b, seq_len(b, 9)), generator=g)
        return (), {"input_ids": ids, "labels": ids}

    # transformers computes the loss in float32 (logits.float()): its rounding bounds the agreement.
    w = check_parity(
        _double(lambda: transformers.LlamaForCausalLM(config)),
        inputs,
        loss_fn=lambda out: out.loss,
        atol=1e-6,
        rtol=1e-5,
    )
    assert w.fallback_reason is None


def test_float32_graphs_are_untouched(exporter):
    """The pass acts on float64 graphs only: a float32 build records it as not modifying anything."""
    torch.manual_seed(0)
    w = ORTWrap(
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8)), fallback=False, build_cache=False, exporter=exporter
    )
    w(torch.randn(3, 8)).sum().backward()
    records = {r.name: r.modified for r in w.last_artifacts.passes}
    assert records["DoublePrecisionOnCPUPass"] is False


@no_exporter
def test_float64_op_without_a_replacement_is_refused_before_the_session():
    """An op ORT cannot run in float64 (ReduceL2, in an inference graph) and ortwrap has no PyTorch equivalent for fails in
    the passes, naming it and what ORT lacks: never at session creation."""
    import onnx_ir as ir

    from ortwrap.passes.double_precision import DoublePrecisionOnCPUPass

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.DOUBLE), shape=ir.Shape([2, 3]))
    node = ir.node("ReduceL2", [x], {"axes": [1], "keepdims": 0}, name="norm")
    node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = "y", ir.DataType.DOUBLE, ir.Shape([2])
    model = ir.Model(ir.Graph([x], [node.outputs[0]], nodes=[node], opset_imports={"": 17}), ir_version=8)
    with pytest.raises(PassError, match=r"ReduceL2\) cannot be run in float64.*ReduceL2\(13\)"):
        DoublePrecisionOnCPUPass(with_backward=False)(model)


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))).mean((2, 3))


def test_float64_batchnorm_in_training_mode_is_refused_with_a_clear_error(exporter):
    torch.manual_seed(0)
    w = ORTWrap(ConvBN().double(), fallback=False, exporter=exporter)
    with pytest.raises(PassError, match=r"BatchNorm in training mode cannot be trained in float64.*eval\(\)"):
        w(torch.randn(2, 3, 6, 6, dtype=torch.float64))


def test_float64_batchnorm_in_eval_mode_trains_like_eager():
    def make():
        m = ConvBN()
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
        return m

    class Frozen(nn.Module):  # check_parity puts the whole model in train mode: BatchNorm stays in eval
        def __init__(self) -> None:
            super().__init__()
            self.inner = make()

        def train(self, mode: bool = True):
            super().train(mode)
            self.inner.bn.eval()
            return self

        def forward(self, x):
            return self.inner(x)

    check_parity(
        _double(Frozen),
        lambda b, g: ((torch.randn(b, 3, 6, 6, generator=g, dtype=torch.float64),), {}),
        atol=ATOL,
        rtol=RTOL,
    )
