"""Mixed precision on ORT: torch.autocast around an ORTWrap forward, and half-precision models.

On the CPU, ORT 1.19.2 has no bfloat16 kernels, so the graph computes in float32 between eager's
half-precision boundaries (``passes/half_precision.py``): outputs and gradients have eager's dtypes
and agree with an eager autocast run within half-precision tolerance.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from parity import check_parity, seq_len
from torch import nn

from ortwrap import ORTWrap

pytestmark = pytest.mark.usefixtures("exporter")

#: bfloat16 keeps 8 bits of mantissa (relative spacing 2**-7 ~ 0.8%): eager rounds every autocast
#: result to it and ORT keeps float32 between the boundaries, so the two differ by a few roundings.
BF16 = {"atol": 3e-2, "rtol": 3e-2}
FP16 = {"atol": 5e-3, "rtol": 5e-3}


def autocast(dtype: torch.dtype):
    return lambda: torch.autocast("cpu", dtype=dtype)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 5))


def mlp_inputs(b, g):
    return (torch.randn(b, 12, generator=g),), {}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mlp_under_autocast(dtype):
    tol = BF16 if dtype is torch.bfloat16 else FP16
    w = check_parity(mlp, mlp_inputs, autocast=autocast(dtype), **tol)  # checks output dtypes too
    assert w.fallback_reason is None
    # the half-precision Casts were computed as float32 where ORT's CPU kernels need it
    assert "HalfPrecisionOnCPUPass" in [p.name for p in w.last_artifacts.passes if p.modified]


class ScaledTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        ctx.a = a
        return y * a

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * ctx.a * (1 - y * y), None


class GPTBlockWithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)
        self.fc = nn.Linear(16, 32)
        self.out = nn.Linear(32, 16)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, 2, 8).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(ScaledTanh.apply(self.fc(x), 1.5))  # a Function inside, under autocast


def test_gpt_block_with_a_function_under_autocast():
    def inputs(b, g):
        return (torch.randn(b, seq_len(b, 6), 16, generator=g),), {}

    # (lr small enough that training does not diverge: with check_parity's default 0.05 the
    # gradients grow 100x in three steps and bf16 rounding dominates eager's own results: measured,
    # ortwrap stays closer to a float32 run than eager autocast does)
    w = check_parity(GPTBlockWithFunction, inputs, autocast=autocast(torch.bfloat16), lr=0.005, **BF16)
    assert w.fallback_reason is None


def test_hf_model_under_autocast():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip

    def inputs(b, g):
        ids = torch.randint(0, 64, (b, seq_len(b, 9)), generator=g)
        return (), {"input_ids": ids, "labels": ids}

    w = check_parity(
        lambda: transformers.LlamaForCausalLM(cfg), inputs, loss_fn=lambda o: o.loss, autocast=autocast(torch.bfloat16),
        **BF16,
    )  # fmt: skip
    assert w.fallback_reason is None


def test_autocast_state_selects_the_graph():
    """Entering or leaving autocast (or changing its dtype or cache flag) selects the matching
    graph, never a stale one: outputs have eager's dtype every time."""
    torch.manual_seed(0)
    m = mlp()
    w = ORTWrap(copy.deepcopy(m), fallback=False)
    x = torch.randn(4, 12)
    seen = []
    for state in ["off", torch.bfloat16, "off", torch.float16, torch.bfloat16, ("nocache", torch.bfloat16)]:
        if state == "off":
            out_o, out_e = w(x), m(x)
        else:
            cache = not isinstance(state, tuple)
            dtype = state[1] if isinstance(state, tuple) else state
            with torch.autocast("cpu", dtype=dtype, cache_enabled=cache):
                out_o, out_e = w(x), m(x)
        assert out_o.dtype == out_e.dtype, (state, out_o.dtype, out_e.dtype)
        torch.testing.assert_close(out_o.float(), out_e.float(), **BF16)
        seen.append(w.export_count)
    # fp32, bf16, (fp32 again: reused), fp16, (bf16 again: reused), bf16 without the cast cache
    assert len(w.programs()) == 4, seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_model(dtype):
    """model.to(dtype): ORT computes in float32 inside, and gradients come back in the
    parameters' dtype, as in eager."""
    tol = {"atol": 5e-2, "rtol": 5e-2} if dtype is torch.bfloat16 else {"atol": 1e-2, "rtol": 1e-2}

    def make():
        return mlp().to(dtype)

    def inputs(b, g):
        return (torch.randn(b, 12, generator=g).to(dtype),), {}

    w = check_parity(make, inputs, lr=0.01, **tol)
    assert all(p.grad is None or p.grad.dtype == dtype for p in w.parameters())


def test_half_precision_gpt():
    """A small GPT in float16 (the model that failed with SliceGrad in float16 before)."""
    sys.path.insert(0, "examples")
    from tiny_gpt import GPTConfig, TinyGPT

    cfg = GPTConfig(vocab=50, d=16, heads=2, layers=2, max_len=32)

    def inputs(b, g):
        data = torch.randint(0, 50, (b, seq_len(b, 10) + 1), generator=g)
        return (data[:, :-1], data[:, 1:]), {}

    check_parity(lambda: TinyGPT(cfg).half(), inputs, loss_fn=lambda out: out[0], lr=0.01, atol=2e-2, rtol=2e-2)


def test_grad_scaler_through_the_wrapper():
    """torch.amp.GradScaler on CPU: scaled loss, unscale, inf/nan detection and skipped steps
    behave as in eager."""
    torch.manual_seed(0)
    eager = mlp()
    ours = ORTWrap(copy.deepcopy(eager), fallback=False)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.1)
    sc_e = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    sc_o = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(5, 12, generator=g)
        if step == 2:
            x[0, 0] = float("inf")  # an overflow: the step is skipped and the scale halves
        for model, opt, sc in ((eager, opt_e, sc_e), (ours, opt_o, sc_o)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
        assert sc_o.get_scale() == sc_e.get_scale(), (step, sc_o.get_scale(), sc_e.get_scale())
    for p_o, p_e in zip(ours.parameters(), eager.parameters()):
        torch.testing.assert_close(p_o, p_e, **BF16)


class AdaptedBF16Base(nn.Module):
    """A frozen bfloat16 base with trainable float32 low-rank adapters (the fuse_initializers case)."""

    def __init__(self) -> None:
        super().__init__()
        self.base1 = nn.Linear(12, 32).to(torch.bfloat16).requires_grad_(False)
        self.base2 = nn.Linear(32, 5).to(torch.bfloat16).requires_grad_(False)
        self.register_buffer("shift", torch.linspace(-1, 1, 32).to(torch.bfloat16))
        self.a = nn.Linear(12, 4, bias=False)
        self.b = nn.Linear(4, 32, bias=False)

    def forward(self, x):
        h = (self.base1(x.to(torch.bfloat16)) + self.shift).float() + self.b(self.a(x))
        return self.base2(torch.relu(h).to(torch.bfloat16)).float()


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "cast"])
def test_fuse_initializers_feeds_frozen_half_weights_as_float_copies(fuse):
    """fuse_initializers: the frozen bf16 weights and buffer enter the graph as float32, fed from
    copies made once; training the adapters matches eager either way."""
    w = check_parity(AdaptedBF16Base, mlp_inputs, wrap_options={"fuse_initializers": fuse}, **BF16)
    program = next(iter(w.programs()))
    # base1/base2 weights and biases, and the buffer
    assert len(program.graph.float_feeds) == (5 if fuse else 0), program.graph.float_feeds
    inputs_cast = [n for n in program.graph.model().graph.node if n.name.endswith("/ortwrap_to_float")]
    assert bool(inputs_cast) != fuse  # without the pass, each frozen half input has its per-step Cast


def test_fuse_initializers_remakes_a_copy_when_the_weight_changes():
    """A frozen weight written in place (a new base checkpoint, an EMA update) is converted again:
    its version counter moved."""
    torch.manual_seed(0)
    eager = AdaptedBF16Base()
    ours = ORTWrap(copy.deepcopy(eager), fallback=False, fuse_initializers=True)
    x = torch.randn(6, 12)
    torch.testing.assert_close(ours(x), eager(x), **BF16)
    for model in (eager, ours.module):
        with torch.no_grad():
            model.base1.weight.mul_(-2.0)
            model.shift.add_(3.0)
    torch.testing.assert_close(ours(x), eager(x), **BF16)
    state = copy.deepcopy(eager.state_dict())
    state["base2.weight"].mul_(-1.0)
    eager.load_state_dict(state)
    ours.load_state_dict(state)
    torch.testing.assert_close(ours(x), eager(x), **BF16)
