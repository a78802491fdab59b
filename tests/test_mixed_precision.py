"""Mixed precision on ORT: torch.autocast around an ORTWrap forward, and half-precision models.

On the CPU, ORT 1.19.2 has no bfloat16 kernels, so the graph computes in float32 between eager's
half-precision boundaries (``passes/half_precision.py``): outputs and gradients have eager's dtypes
and agree with an eager autocast run within half-precision tolerance. With
``half_compute="native"`` the bfloat16 GEMMs run as PyTorch's bf16 GEMMs inside the graph
(``passes/half_matmul.py``); the bf16 tests run both routes on every machine (the native one is
slow where bf16 is emulated: the models are small).
"""

from __future__ import annotations

import copy
import subprocess
import sys

import onnx
import pytest
import torch
from parity import assert_close, check_parity, gemm_op_counts, no_exporter, seq_len, signature_builds
from torch import nn

from ortwrap import ORTWrap, kernels
from ortwrap.engines import is_training_available

pytestmark = pytest.mark.usefixtures("exporter", "one_exporter_on_the_engine")

#: ``engine="onnxruntime"`` resolves here (``ORT_EXTRA=ort make test``): autocast's graphs come from
#: AOTAutograd and compute in float32 between Casts (docs/engines.md, "Autocast"); ``half_compute``,
#: ortwrap's native kernels and ``last_artifacts`` are the training engine's (docs/engines.md).
ON_ENGINE = not is_training_available()
#: the engine's tests that take long there: ``slow`` only in the engine venv
ENGINE_SLOW = pytest.mark.slow if ON_ENGINE else (lambda f: f)
#: the training engine's artifacts and native kernels: absent on ``engine="onnxruntime"``
#: engine=onnxruntime: builds of one input shape under off, bf16 and fp16; bf16 without the cast cache
#: is bf16's build (AOTAutograd traces the same graph: its signature holds the autocast dtype only)
ENGINE_AUTOCAST_BUILDS = 3
training_only = pytest.mark.skipif(ON_ENGINE, reason="engine=onnxruntime: training engine's passes/kernels/artifacts")

#: bfloat16 keeps 8 bits of mantissa (relative spacing 2**-7 ~ 0.8%): eager rounds every autocast
#: result to it and ORT keeps float32 between the boundaries, so the two differ by a few roundings.
BF16 = {"atol": 3e-2, "rtol": 3e-2}
FP16 = {"atol": 5e-3, "rtol": 5e-3}


#: ``Options.half_compute`` values the bf16 tests run with
#: (engine=onnxruntime reads no ``half_compute``: one route there, and
#: ``test_half_compute_is_not_read_on_the_onnxruntime_engine`` asserts that "native" changes nothing)
ROUTES = ["float32"] if ON_ENGINE else ["float32", "native"]


def autocast(dtype: torch.dtype):
    return lambda: torch.autocast("cpu", dtype=dtype)


def assert_route(w: ORTWrap, route: str, *, op: str = "linear", backward: bool = True) -> None:
    """The native route ran the bf16 GEMMs as ortwrap's ops with their own backward ops (no vjp
    recompute); the float32 route has none. (A linear whose input is bf16 in the graph is the
    ``linear_keep_input`` variant: passes/half_values.py.)"""
    if getattr(w, "_engine", None) is not None:  # engine=onnxruntime: no passes, half_compute not read
        return
    counts = gemm_op_counts(w)
    modified = [p.name for p in w.last_artifacts.passes if p.modified]
    if route == "float32":
        assert not counts and "TorchGemmOnCPUPass" not in modified, counts
        return
    assert "TorchGemmOnCPUPass" in modified
    forward = counts.get(f"ortwrap_ops::{op}", 0) + counts.get(f"ortwrap_ops::{op}_keep_input", 0)
    assert forward > 0 and (not backward or counts.get(f"ortwrap_ops::{op}_bf16_backward", 0) > 0), counts
    assert not any(k.startswith("ortwrap_vjp::") and "ortwrap_ops::" in k for k in counts), counts


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 5))


def mlp_inputs(b, g):
    return (torch.randn(b, 12, generator=g),), {}


@pytest.mark.parametrize(
    "dtype,route",
    [(torch.bfloat16, "float32"), (torch.bfloat16, "native"), (torch.float16, "native")],
    ids=["bf16-float32", "bf16-native", "fp16"],
)
def test_mlp_under_autocast(dtype, route):
    tol = BF16 if dtype is torch.bfloat16 else FP16
    w = check_parity(
        mlp, mlp_inputs, autocast=autocast(dtype), wrap_options={"half_compute": route}, **tol
    )  # checks output dtypes too
    assert w.fallback_reason is None
    if ON_ENGINE:  # no passes report there (its graphs compute in float32 between Casts all the same)
        return
    # the half-precision Casts were computed as float32 where ORT's CPU kernels need it
    assert "HalfPrecisionOnCPUPass" in [p.name for p in w.last_artifacts.passes if p.modified]
    # float16 GEMMs compute in float32 on either route
    assert_route(w, route if dtype is torch.bfloat16 else "float32")


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


@pytest.mark.parametrize("route", ROUTES)
def test_native_route_computes_as_eager_autocast(exporter, route):
    """One Linear under autocast: on the native route ORT's output and gradients are eager
    autocast's bit for bit (the same bf16 GEMMs, rounded where eager rounds); the float32 route
    keeps float32 products and differs in the last bits."""
    torch.manual_seed(0)
    eager = nn.Linear(64, 48)
    ours = ORTWrap(copy.deepcopy(eager), fallback=False, half_compute=route, exporter=exporter)
    x = torch.randn(16, 64)
    results = []
    for model in (eager, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        (y.float() * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        results.append([y, *(p.grad for p in model.parameters())])
    same = [torch.equal(a, b) for a, b in zip(*results)]
    # engine=onnxruntime rounds each autocast result where eager does: eager's bits (docs/engines.md, "Autocast")
    assert same == ([True] * 3 if route == "native" or ON_ENGINE else [False] * 3), same
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **BF16)


@pytest.mark.parametrize(
    ("x_dtype", "result"),
    [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
    ids=["bf16-x-f32-result", "bf16-x-bf16-result", "f32-x"],
)
@no_exporter
@pytest.mark.parametrize("recast", [False, True], ids=["weight-copy", "recast"])
def test_linear_ops_compute_as_eager_autocast(x_dtype, result, recast):
    """ortwrap's bf16 linear op and its backward op, called as the graph calls them, give eager
    autocast's output and gradients bit for bit, each in eager's dtype: a float32 output gradient
    (a residual add read the result) gives a bf16 dx where x is bf16, a float32 one where x is.
    ``recast`` (recompute="cheap"/"layers", grad/recompute.py): the forward returns no weight copy
    (an empty tensor) and the backward op reads the float32 weight itself, with the same results."""
    from ortwrap.ops import NO_WEIGHT_COPY, define_ops

    define_ops()
    torch.manual_seed(0)
    x = torch.randn(3, 40, 96).to(x_dtype).requires_grad_()
    w, b = nn.Parameter(torch.randn(64, 96) / 10), nn.Parameter(torch.randn(64))
    grad = torch.randn(3, 40, 64, dtype=result)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, w, b)
    y.to(result).backward(grad)
    codes = {torch.bfloat16: 15, torch.float32: 6}
    dtypes = [15, codes[result], codes[x_dtype], 6, 6]
    forward_dtypes = [*dtypes, NO_WEIGHT_COPY] if recast else dtypes
    ops = torch.ops.ortwrap_ops
    with torch.no_grad():
        if x_dtype is torch.bfloat16:  # passes/half_values.py: the backward reads x itself
            ours, wc = ops.linear_keep_input(x, w, b, forward_dtypes)
            xc = x
        else:
            ours, xc, wc = ops.linear(x, w, b, forward_dtypes)
        if recast:
            assert wc.numel() == 0
            wc = w.detach()
        else:
            assert wc.dtype == torch.bfloat16 and wc.shape == w.shape
        grads = ops.linear_bf16_backward(grad, xc, wc, dtypes, [True, True, True])
    for a, e in zip((ours, *grads), (y.to(result), x.grad, w.grad, b.grad)):
        assert a.dtype == e.dtype and torch.equal(a, e), (a.dtype, e.dtype, (a.float() - e.float()).abs().max())


@no_exporter
def test_linear_half_result_computes_as_eager_autocast():
    """The LM head's op (its float32 result read by the loss, its bf16 result returned, as eager
    autocast's logits): both results and every gradient, with a gradient on each result, are eager
    autocast's bit for bit; its backward sums the two in bf16 as eager's autograd does."""
    from ortwrap.ops import define_ops

    define_ops()
    torch.manual_seed(0)
    x = torch.randn(3, 40, 96).bfloat16().requires_grad_()
    w = nn.Parameter(torch.randn(64, 96) / 10)
    grad, grad_half = torch.randn(3, 40, 64), torch.randn(3, 40, 64).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, w)
    torch.autograd.backward([y.float(), y], [grad, grad_half])
    dtypes = [15, 6, 15, 6, 6]
    ops = torch.ops.ortwrap_ops
    with torch.no_grad():
        ours, wc, half = ops.linear_keep_input_half(x, w, None, dtypes)
        grads = ops.linear_bf16_backward_half(grad, grad_half, x, wc, dtypes, [True, True, False])
    for a, e in zip((ours, half, *grads[:2]), (y.float(), y, x.grad, w.grad)):
        assert a.dtype == e.dtype and torch.equal(a, e), (a.dtype, e.dtype, (a.float() - e.float()).abs().max())


class HeadAndArgmax(nn.Module):
    """A head whose float32 logits only a non-differentiable op reads (argmax), its bf16 logits
    returned: the head's backward gets only the bf16 logits' gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        y = self.head(self.ln(x))
        return y, y.float().argmax(-1)


def test_linear_half_result_with_one_gradient(exporter):
    """The head returns bf16 logits and their argmax (of the float32 logits): ORT's gradient builder
    names no gradient of the float32 result, the backward op gets it as absent (not as a value
    nothing produces, which ORT rejects), and outputs and gradients match eager autocast."""
    torch.manual_seed(0)
    eager = HeadAndArgmax()
    ours = ORTWrap(copy.deepcopy(eager), fallback=False, half_compute="native", exporter=exporter)
    x = torch.randn(4, 5, 16)
    results = []
    for model in (eager, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, idx = model(x)
        (y.float() * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        results.append([y, idx, *(p.grad for p in model.parameters())])
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **BF16)
    if ON_ENGINE:  # the graph check below reads the training engine's programs
        return
    graph = next(iter(ours.programs())).graph.model().graph
    backward = [n for n in graph.node if any(a.s == b"ortwrap_ops::linear_bf16_backward_half" for a in n.attribute)]
    assert len(backward) == 1 and backward[0].input[0] == "", [list(n.input) for n in backward]


@ENGINE_SLOW
@pytest.mark.parametrize("route", ROUTES)
def test_tiny_gpt_logits_and_loss_under_autocast(route):
    """The LM returns its loss and its logits (bf16 under autocast, as eager's) and the caller's loss
    reads both: every gradient matches eager autocast. On the native route the head's linear returns
    its bf16 logits itself (no Cast of the float32 ones the loss reads) and its backward takes both
    gradients."""
    sys.path.insert(0, "examples")
    from tiny_gpt import GPTConfig, TinyGPT

    cfg = GPTConfig(vocab=40, d=16, heads=2, layers=2, max_len=32)

    def inputs(b, g):
        data = torch.randint(0, 40, (b, seq_len(b, 10) + 1), generator=g)
        return (data[:, :-1], data[:, 1:]), {}

    def loss_fn(out):
        assert out[1].dtype == torch.bfloat16
        return out[0] + out[1].float().square().sum()

    w = check_parity(
        lambda: TinyGPT(cfg), inputs, loss_fn=loss_fn, autocast=autocast(torch.bfloat16), lr=0.01,
        wrap_options={"half_compute": route}, **BF16,
    )  # fmt: skip
    assert_route(w, route)
    if ON_ENGINE:  # the graph checks below read the training engine's programs
        return
    counts = gemm_op_counts(w)
    if route == "native":
        assert counts.get("ortwrap_ops::linear_keep_input_half") == 1, counts
        assert counts.get("ortwrap_ops::linear_bf16_backward_half") == 1, counts
        graph = next(iter(w.programs())).graph.model().graph
        assert not [n for n in graph.node if n.op_type == "Cast" and n.output[0] == graph.output[1].name]


@pytest.mark.parametrize("route", ROUTES)
def test_inference_under_autocast(exporter, route):
    """Under no_grad (an inference graph: the GEMM ops return no operand copies) and in eval mode
    outputs match eager autocast."""
    torch.manual_seed(0)
    eager = GPTBlockWithFunction().eval()
    ours = ORTWrap(copy.deepcopy(eager), fallback=False, half_compute=route, exporter=exporter)
    x = torch.randn(3, 7, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = ours(x), eager(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, **BF16)
    assert_route(ours, route, backward=False)


@ENGINE_SLOW
@pytest.mark.parametrize("route", ROUTES)
def test_gpt_block_with_a_function_under_autocast(route):
    def inputs(b, g):
        return (torch.randn(b, seq_len(b, 6), 16, generator=g),), {}

    # (lr small enough that training does not diverge: with check_parity's default 0.05 the
    # gradients grow 100x in three steps and bf16 rounding dominates eager's own results: measured,
    # ortwrap stays closer to a float32 run than eager autocast does)
    w = check_parity(
        GPTBlockWithFunction, inputs, autocast=autocast(torch.bfloat16), lr=0.005,
        wrap_options={"half_compute": route}, **BF16,
    )  # fmt: skip
    assert w.fallback_reason is None
    assert_route(w, route)


@ENGINE_SLOW
@pytest.mark.parametrize(
    "route,recompute",
    [("float32", "none"), ("native", "none"), ("native", "cheap"), ("native", "layers")],
    ids=["float32", "native", "native-cheap", "native-recompute"],
)
def test_tiny_gpt_under_autocast(route, recompute):
    """The benchmark's LM (tied head, attention matmuls, loss inside): every linear and the
    attention's matmuls run as bf16 GEMMs on the native route (also with activation recompute,
    which copies them into the backward)."""
    sys.path.insert(0, "examples")
    from tiny_gpt import GPTConfig, TinyGPT

    cfg = GPTConfig(vocab=40, d=16, heads=2, layers=2, max_len=32)

    def inputs(b, g):
        data = torch.randint(0, 40, (b, seq_len(b, 10) + 1), generator=g)
        return (data[:, :-1], data[:, 1:]), {}

    w = check_parity(
        lambda: TinyGPT(cfg), inputs, loss_fn=lambda out: out[0], autocast=autocast(torch.bfloat16), lr=0.01,
        wrap_options={"half_compute": route, "recompute": recompute}, **BF16,
    )  # fmt: skip
    assert_route(w, route)
    if ON_ENGINE:  # the graph checks below read the training engine's programs
        return
    # GELU's constants, exported in bf16, still match ortwrap's GELU kernel (float32, exact constants);
    # on the native route, between two bf16 GEMMs, it is PyTorch's bf16 GELU (passes/half_values.py)
    graph = next(iter(w.programs())).graph.model().graph
    operators = {a.s.decode() for n in graph.node for a in n.attribute if a.name == "operator"}
    gelu = "ortwrap_ops::gelu" if route == "native" else "ortwrap_cpu::gelu"
    assert gelu in operators and f"{gelu}_backward" in operators, sorted(operators)
    from parity import EXPORTER

    if route == "native" and EXPORTER == "dynamo":  # the head reshapes read and write bf16, as in eager
        bf16 = {v.name for v in graph.value_info if v.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16}
        layout = [n for n in graph.node if n.op_type in ("Transpose", "Split", "Concat") and n.output[0] in bf16]
        assert len(layout) >= 4, sorted(bf16)
    if route == "native":
        if EXPORTER == "dynamo":  # (the TorchScript exporter writes SDPA's matmuls in float32 under autocast)
            # q, k^T, v reach attention in bf16: ortwrap's bf16 attention kernel and its backward
            # (passes/native_attention.py), reading q, k, v in the projections' [B, T, H, D] layout
            # (no Transposes into heads and back), else flash attention's variant that reads them, not copies
            if kernels.attention_available():
                assert {"ortwrap_cpu::attention_bthd_bf16", "ortwrap_cpu::attention_bthd_bf16_backward"} <= operators
                assert not any(op.startswith("ortwrap_ops::attention") for op in operators), sorted(operators)
            else:
                assert_route(w, route, op="attention_keep_inputs", backward=False)
                assert gemm_op_counts(w).get("ortwrap_ops::attention_bf16_backward", 0) > 0


@training_only
@pytest.mark.parametrize("recompute", ["cheap", "layers"])
def test_recompute_on_the_native_route(exporter, recompute):
    """Activation recompute copies ortwrap's own PyTorch ops (``ortwrap_ops::``) as it copies its
    CPU kernels: ``"cheap"`` recomputes the bf16 GELU from its input (stashed anyway for its
    backward: eager keeps both) and never a GEMM or an attention (before, it recomputed each
    attention to drop its log-sum-exp); ``"layers"`` recomputes the bf16 GEMMs too (their bf16
    copies of the weights included), so that no GEMM's output or weight copy stays stashed."""
    sys.path.insert(0, "examples")
    from tiny_gpt import GPTConfig, TinyGPT

    from ortwrap.grad.recompute import SUFFIX, stashed_values

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=40, d=32, heads=2, layers=2, max_len=32)
    data = torch.randint(0, 40, (2, 17))
    w = ORTWrap(
        TinyGPT(cfg), fallback=False, build_cache=False, half_compute="native", recompute=recompute, exporter=exporter
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = w(data[:, :-1], data[:, 1:])[0]
    loss.float().backward()
    graph = w.last_artifacts.graph.model().graph

    def operator(n: onnx.NodeProto) -> str:
        return next((a.s.decode() for a in n.attribute if a.name == "operator"), n.op_type)

    copied = {operator(n) for n in graph.node if n.name.endswith(SUFFIX)}
    producer = {o: operator(n) for n in graph.node for o in n.output}
    stashed = {producer.get(x, "") for x in stashed_values(w.last_artifacts.graph.model())}
    heavy = {op for op in copied if any(k in op for k in ("linear", "matmul", "attention"))}
    assert "ortwrap_ops::gelu" in copied and "ortwrap_ops::gelu" not in stashed, (copied, stashed)
    # No bf16 weight copy is kept: every GEMM's backward reads its float32 weight (a parameter)
    # and casts it again, and the forward returns an empty copy (ORT keeps an output nothing reads
    # until the end of the run).
    from ortwrap.ops import NO_WEIGHT_COPY

    params = {i.name for i in graph.input} & {n for n, _ in w.named_parameters()} | {
        i.name for i in graph.input if "weight" in i.name
    }
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    gemms = [n for n in graph.node if operator(n).startswith("ortwrap_ops::linear") and SUFFIX not in n.name]
    forward_gemms = [n for n in gemms if "backward" not in operator(n)]
    backward_gemms = [n for n in gemms if "backward" in operator(n)]
    assert forward_gemms and backward_gemms
    for n in forward_gemms:
        assert n.input[1] in params and inits[n.input[-1]][-1] == NO_WEIGHT_COPY, n
    for n in backward_gemms:
        assert n.input[3 if operator(n).endswith("_half") else 2] in params, n
    if recompute == "cheap":
        assert not heavy, copied
        assert any(op.startswith("ortwrap_ops::linear") for op in stashed), stashed
    else:
        assert any(op.startswith("ortwrap_ops::linear") for op in heavy), copied
        assert not any(op.startswith("ortwrap_ops::") for op in stashed), stashed


def _uses_env_allocator(session) -> bool:
    try:
        return session.get_session_options().get_session_config_entry("session.use_env_allocators") == "1"
    except Exception:  # ORT raises when the entry is not set
        return False


@training_only
@pytest.mark.parametrize("route", ROUTES)
def test_native_route_sessions_run_without_the_cpu_arena(exporter, route):
    """Sessions of graphs with PyTorch's bf16 GEMMs inside (the native route) allocate from the
    plain CPU allocator registered with ORT's environment, as those GEMMs' tensors come from glibc,
    not from ORT's CPU arena (runtime/session.py ``uses_cpu_arena``, ``plain_cpu_allocator``);
    other graphs keep the CPU provider's arena. The training still matches eager autocast.
    (What each allocator does in a process where another session came first:
    test_arena_choice_holds_whichever_session_came_first.)"""
    w = check_parity(mlp, mlp_inputs, autocast=autocast(torch.bfloat16), wrap_options={"half_compute": route}, **BF16)
    runners = [p.runner for p in w.programs()]
    assert runners
    for runner in runners:
        assert _uses_env_allocator(runner._session) is (route == "native")
    plain = ORTWrap(mlp(), fallback=False, exporter=exporter)
    plain(torch.randn(4, 12)).sum().backward()
    assert not any(_uses_env_allocator(p.runner._session) for p in plain.programs())


_ARENA_PROBE = r"""
import sys
import numpy as np
import onnx.helper as h
import torch
from torch import nn
from ortwrap import ORTWrap
from ortwrap._ort import C, ort

# A session with ORT's default options (the CPU arena on), created before any of ortwrap's: the
# training build keeps one CPU execution provider per process, made by the first session.
g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g", [h.make_tensor_value_info("x", 1, [2])],
                 [h.make_tensor_value_info("y", 1, [2])])
first = ort.InferenceSession(h.make_model(g, ir_version=8, opset_imports=[h.make_opsetid("", 17)]).SerializeToString(),
                             providers=["CPUExecutionProvider"])
first.run(None, {"x": np.ones(2, np.float32)})

class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))

    def forward(self, x):
        return x + self.inner(x)  # float32 + bf16: ORT's Add, float32, allocated by the session


for route in ("native", "float32"):
    torch.manual_seed(0)
    w = ORTWrap(Residual(), fallback=False, build_cache=False, half_compute=route)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w(torch.randn(4, 256)).float().sum().backward()  # the build, and a small first step
    # ORT's arena logs each region it adds at INFO: a batch 1024x larger than the first step's
    # makes an arena add regions, and a session without one logs nothing.
    C.set_default_logger_severity(0)
    sys.stderr.write(f"PROBE-START {route}\n")
    sys.stderr.flush()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w(torch.randn(4096, 256)).float().sum().backward()
    sys.stderr.flush()
    C.set_default_logger_severity(3)
    sys.stderr.write(f"PROBE-END {route}\n")
    sys.stderr.flush()
"""


@training_only
@no_exporter
def test_arena_choice_holds_whichever_session_came_first():
    """In a process where a session with ORT's CPU arena came first (the user's, one of the build's
    helpers, an earlier model), a native-route training graph still allocates without the arena
    (it used to get the first session's arena: ~265 MiB of regions kept between GPT-2 small's steps),
    and a float32 graph still gets the arena it asks for. Observed in ORT's own log, in a fresh
    process."""
    proc = subprocess.run([sys.executable, "-c", _ARENA_PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    extended = {}
    for route in ("native", "float32"):
        part = proc.stderr.split(f"PROBE-START {route}\n", 1)[1].split(f"PROBE-END {route}\n", 1)[0]
        extended[route] = part.count("Extending BFCArena for Cpu")
    assert extended["native"] == 0, extended
    assert extended["float32"] > 0, extended


class MaskedAttention(nn.Module):
    """Self-attention with a key-padding mask given as an input (bool, or additive float), whose
    head dim (12) is no power of two: SDPA's scale is then no power of two either."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(24, 72)
        self.proj = nn.Linear(24, 24)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, 2, 12).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.proj(a.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masked_attention_under_autocast(kind):
    """A padding mask (one batch element with its last keys masked) under autocast on the native
    route: outputs and every gradient as eager autocast's; the dynamo export's attention runs on
    ortwrap's bf16 kernel (passes/native_attention.py)."""

    def inputs(b, g):
        t = seq_len(b, 9)
        keep = torch.ones(b, 1, 1, t, dtype=torch.bool)
        keep[0, ..., t // 2 :] = False
        mask = keep if kind == "bool" else torch.where(keep, 0.0, -1e4) + torch.randn(b, 1, t, t, generator=g)
        return (torch.randn(b, t, 24, generator=g), mask), {}

    w = check_parity(
        MaskedAttention, inputs, autocast=autocast(torch.bfloat16), lr=0.005,
        wrap_options={"half_compute": "native"}, **BF16,
    )  # fmt: skip
    assert w.fallback_reason is None
    if ON_ENGINE:  # the kernel check below reads the training engine's programs
        return
    from parity import EXPORTER

    operators = {
        a.s.decode() for p in w.programs() for n in p.graph.model().graph.node for a in n.attribute
        if a.name == "operator"
    }  # fmt: skip
    # (an additive float mask input: passes/half_matmul.py keeps SDPA's decomposed matmuls and softmax)
    if EXPORTER == "dynamo" and kind == "bool" and kernels.attention_available():
        assert {"ortwrap_cpu::attention_bthd_bf16", "ortwrap_cpu::attention_bthd_bf16_backward"} <= operators, operators


class BatchedMatMuls(nn.Module):
    """Batched matmuls with broadcasting (no softmax between): the generic bf16 matmul op."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 6) / 3)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2)  # (b, t, t)
        return (s.tanh() @ x) @ self.w  # (b, t, 8) @ (8, 6): a weight read without a transpose


@pytest.mark.parametrize("route", ROUTES)
def test_batched_matmuls_under_autocast(route):
    def inputs(b, g):
        return (torch.randn(b, seq_len(b, 5), 8, generator=g) / 2,), {}

    w = check_parity(
        BatchedMatMuls,
        inputs,
        autocast=autocast(torch.bfloat16),
        lr=0.005,
        wrap_options={"half_compute": route},
        **BF16,
    )
    assert_route(w, route, op="matmul")


@ENGINE_SLOW
@pytest.mark.parametrize("route", ROUTES)
def test_hf_model_under_autocast(route):
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
        wrap_options={"half_compute": route}, **BF16,
    )  # fmt: skip
    assert w.fallback_reason is None
    assert_route(w, route)


def test_autocast_state_selects_the_graph(exporter):
    """Entering or leaving autocast (or changing its dtype or cache flag) selects the matching
    graph, never a stale one: outputs have eager's dtype every time."""
    torch.manual_seed(0)
    m = mlp()
    w = ORTWrap(copy.deepcopy(m), fallback=False, exporter=exporter)
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
    if ON_ENGINE:  # its builds, one per autocast state (docs/engines.md, test_autocast_state_keys_the_build)
        assert signature_builds(w)[0] == ENGINE_AUTOCAST_BUILDS, seen
        return
    assert len(w.programs()) == 4, seen


class T5Attention(nn.Module):
    """T5's attention: an in-place add of the position bias to the scores, a view after a transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48, bias=False)
        self.o = nn.Linear(16, 16, bias=False)
        self.bias = nn.Parameter(torch.randn(1, 2, 1, 1))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 2, 8).transpose(1, 2) for z in self.qkv(x).split(16, -1))
        scores = torch.matmul(q, k.transpose(3, 2))
        scores += self.bias
        w = torch.softmax(scores.float(), dim=-1).type_as(scores)
        return self.o(torch.matmul(w, v).transpose(1, 2).contiguous().view(b, -1, 16))


def test_in_place_ops_under_autocast():
    """torch.export puts an autocast region in a submodule (``wrap_with_autocast``): its in-place
    ops must be functionalized and its views re-run as reshapes like the top graph's (the dynamo
    translation failed with "Tensor dtype mismatch", T5 with "Cannot view a tensor")."""
    w = check_parity(
        T5Attention,
        lambda b, g: ((torch.randn(b, 5 + b, 16, generator=g),), {}),
        autocast=autocast(torch.bfloat16),
        lr=0.005,
        **BF16,
    )
    assert w.fallback_reason is None


@pytest.mark.parametrize("model, user_forward", [("ResNetish", False), ("ConvNeXtish", True)])
def test_capture_ignores_autocast_cast_cache(exporter, model, user_forward):
    """Autocast caches the bf16 copy of each weight it casts until the outermost autocast region
    exits. Copies made before a capture in the same region must not reach it: the TorchScript
    exporter failed on them ("Cannot insert a Tensor that requires grad as a constant"). They came
    from the user's own eager forward of the wrapped module (ConvNeXtish), or from the first
    capture of a graph that is captured again with static image sizes (ResNetish: MaxPool). Loss
    and every gradient as eager autocast's, at the conv tolerance of tests/test_coverage_amp.py
    (eager runs BatchNorm in bf16, ORT in float32)."""
    import model_zoo

    torch.manual_seed(0)
    m = getattr(model_zoo, model)()
    eager = copy.deepcopy(m)
    # build_cache=False: the captures are what is tested (an earlier test of the session may have
    # cached the same graph)
    w = ORTWrap(m, fallback=False, exporter=exporter, build_cache=False)
    x, y = model_zoo.image_inputs(2, torch.Generator().manual_seed(1))[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if user_forward:
            m(x, y)  # fills autocast's cast cache with m's weights
        loss_e = eager(x, y)
        loss_o = w(x, y)
    assert w.fallback_reason is None
    if not ON_ENGINE:  # the training engine's export count (the engine's graphs come from AOTAutograd)
        assert w.export_count == (1 if user_forward else 2)
    loss_e.backward()
    loss_o.backward()
    assert loss_o.dtype == loss_e.dtype
    assert_close(loss_o, loss_e, "loss", **BF16)
    for (name, p_o), (_, p_e) in zip(m.named_parameters(), eager.named_parameters()):
        assert_close(p_o.grad, p_e.grad, f"grad of {name}", atol=0.1, rtol=0.1)


@pytest.mark.parametrize(
    "dtype,route",
    [(torch.bfloat16, "float32"), (torch.bfloat16, "native"), (torch.float16, "native")],
    ids=["bf16-float32", "bf16-native", "fp16"],
)
def test_half_precision_model(dtype, route):
    """model.to(dtype): ORT computes in float32 inside (bf16 GEMMs in bf16 on the native route),
    and gradients come back in the parameters' dtype, as in eager."""
    tol = {"atol": 5e-2, "rtol": 5e-2} if dtype is torch.bfloat16 else {"atol": 1e-2, "rtol": 1e-2}

    def make():
        return mlp().to(dtype)

    def inputs(b, g):
        return (torch.randn(b, 12, generator=g).to(dtype),), {}

    w = check_parity(make, inputs, lr=0.01, wrap_options={"half_compute": route}, **tol)
    assert all(p.grad is None or p.grad.dtype == dtype for p in w.parameters())
    assert_route(w, route if dtype is torch.bfloat16 else "float32")


@ENGINE_SLOW
def test_half_precision_gpt():
    """A small GPT in float16 (the model that failed with SliceGrad in float16 before)."""
    sys.path.insert(0, "examples")
    from tiny_gpt import GPTConfig, TinyGPT

    cfg = GPTConfig(vocab=50, d=16, heads=2, layers=2, max_len=32)

    def inputs(b, g):
        data = torch.randint(0, 50, (b, seq_len(b, 10) + 1), generator=g)
        return (data[:, :-1], data[:, 1:]), {}

    check_parity(lambda: TinyGPT(cfg).half(), inputs, loss_fn=lambda out: out[0], lr=0.01, atol=2e-2, rtol=2e-2)


def test_grad_scaler_through_the_wrapper(exporter):
    """torch.amp.GradScaler on CPU: scaled loss, unscale, inf/nan detection and skipped steps
    behave as in eager."""
    torch.manual_seed(0)
    eager = mlp()
    ours = ORTWrap(copy.deepcopy(eager), fallback=False, exporter=exporter)
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
    if ON_ENGINE:  # the feed checks below read the training engine's programs (its graphs: AOTAutograd's)
        return
    program = next(iter(w.programs()))
    # base1/base2 weights and biases, and the buffer
    assert len(program.graph.float_feeds) == (5 if fuse else 0), program.graph.float_feeds
    inputs_cast = [n for n in program.graph.model().graph.node if n.name.endswith("/ortwrap_to_float")]
    assert bool(inputs_cast) != fuse  # without the pass, each frozen half input has its per-step Cast


def test_fuse_initializers_remakes_a_copy_when_the_weight_changes(exporter):
    """A frozen weight written in place (a new base checkpoint, an EMA update) is converted again:
    its version counter moved."""
    torch.manual_seed(0)
    eager = AdaptedBF16Base()
    ours = ORTWrap(copy.deepcopy(eager), fallback=False, fuse_initializers=True, exporter=exporter)
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


# ------------------------------------------------------------------ the native route's rewrite, as ONNX text
def _aten_ops(model) -> list[tuple[str, list[str], int]]:
    """(operator, tensor inputs, compute dtype) of each ATen node; the dtypes are the last input, a
    Constant holding torch's ScalarType codes (compute, result, each float input)."""
    constants = {
        n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node if n.op_type == "Constant"
    }
    return [
        (
            next(a.s.decode() for a in n.attribute if a.name == "operator"),
            list(n.input[:-1]),
            int(constants[n.input[-1]][0]),
        )
        for n in model.graph.node
        if n.op_type == "ATen"
    ]


@no_exporter
def test_half_matmul_pass_writes_linears_and_matmuls():
    """A Linear (MatMul of W^T, then the bias Add) becomes one linear reading W itself; a batched
    MatMul becomes matmul; float32 and 1-D MatMuls stay as they are."""
    import onnx_text

    from ortwrap.passes.half_matmul import TorchGemmOnCPUPass

    body = """
    agraph (bfloat16[2, 5, 8] x, bfloat16[6, 8] w, bfloat16[6] b, bfloat16[2, 3, 5, 4] q, bfloat16[2, 3, 4, 5] k,
            float[5, 8] f, float[8, 2] g, bfloat16[8] v) => (bfloat16[2, 5, 6] y, bfloat16[2, 3, 5, 5] s,
            float[5, 2] z, bfloat16[2, 5] u) {
        wt = Transpose <perm = [1, 0]> (w)
        mm = MatMul (x, wt)
        y = Add (mm, b)
        s = MatMul (q, k)
        z = MatMul (f, g)
        u = MatMul (x, v)
    }
    """
    p = TorchGemmOnCPUPass()
    result, after = onnx_text.run_pass(p, body)
    assert result.modified and p.rewritten == {"linear": 1, "matmul": 1, "attention": 0}
    bf16 = 15  # torch's ScalarType code
    assert _aten_ops(after) == [
        ("ortwrap_ops::linear", ["x", "w", "b"], bf16),
        ("ortwrap_ops::matmul", ["q", "k"], bf16),
    ]
    ops = sorted(n.op_type for n in after.graph.node if n.op_type != "Constant")
    assert ops == ["ATen", "ATen", "MatMul", "MatMul"]  # no Transpose, no Add


@no_exporter
def test_half_matmul_pass_writes_attention():
    """The dynamo exporter's SDPA (q and k^T each scaled by sqrt(scale) rounded to bf16, a mask
    computed from no float input added, softmax, times v) becomes one attention node at SDPA's own
    scale, 1/sqrt(head dim)."""
    import onnx_text

    from ortwrap.passes.half_matmul import TorchGemmOnCPUPass

    body = """
    agraph (bfloat16[2, 3, 5, 64] q, bfloat16[2, 3, 64, 5] kt, bfloat16[2, 3, 5, 64] v, bool[5, 5] keep)
            => (bfloat16[2, 3, 5, 64] y) {
        zero = Constant <value = float {0.0}> ()
        minus = Constant <value = float {-10000.0}> ()
        additive = Where (keep, zero, minus)
        mask = Cast <to = 16> (additive)
        c32 = Constant <value = float {0.353515625}> ()
        c = Cast <to = 16> (c32)
        qs = Mul (q, c)
        ks = Mul (kt, c)
        s = MatMul (qs, ks)
        m = Add (s, mask)
        p = Softmax <axis = -1> (m)
        y = MatMul (p, v)
    }
    """
    p = TorchGemmOnCPUPass()
    result, after = onnx_text.run_pass(p, body)
    assert result.modified and p.rewritten == {"linear": 0, "matmul": 0, "attention": 1}
    assert [n.op_type for n in after.graph.node if n.op_type not in ("Constant", "Cast", "Where")] == ["ATen"]
    node = next(n for n in after.graph.node if n.op_type == "ATen")
    assert list(node.input[:4]) == ["q", "kt", "v", "mask"] and len(node.output) == 5
    constants = {
        n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in after.graph.node if n.op_type == "Constant"
    }
    assert float(constants[node.input[4]]) == 0.125  # 1/sqrt(64), not 0.353515625**2


@no_exporter
def test_half_matmul_pass_leaves_attention_with_a_learned_bias():
    """Scores plus a bias computed from a parameter (T5's relative positions) keep their
    decomposed form: the bias's gradient flows through the scores."""
    import onnx_text

    from ortwrap.passes.half_matmul import TorchGemmOnCPUPass

    body = """
    agraph (bfloat16[2, 3, 5, 8] q, bfloat16[2, 3, 8, 5] kt, bfloat16[2, 3, 5, 8] v, float[5, 5] bias)
            => (bfloat16[2, 3, 5, 8] y) {
        b = Cast <to = 16> (bias)
        s = MatMul (q, kt)
        m = Add (s, b)
        p = Softmax <axis = -1> (m)
        y = MatMul (p, v)
    }
    """
    p = TorchGemmOnCPUPass()
    onnx_text.run_pass(p, body)
    assert p.rewritten == {"linear": 0, "matmul": 2, "attention": 0}


def _attention_model(op: str, q: str, kt: str, mask: str | None, out: str = "bfloat16") -> onnx.ModelProto:
    """One ``ortwrap_ops::<op>`` attention node (``attention_keep_inputs`` as passes/half_values.py
    leaves it: out, k, lse; ``attention``: out, q, k, v, lse) on inputs of these types."""
    mask_input = f", {mask} mask" if mask else ""
    outputs = "y, kc, lse" if op == "attention_keep_inputs" else "y, qc, kc, vc, lse"
    text = f"""
    <ir_version: 8, opset_import: ["" : 17, "org.pytorch.aten" : 1]>
    agraph ({q} q, {kt} kt, bfloat16[2, 3, 5, 8] v{mask_input}) => ({out}[2, 3, 5, 8] y) {{
        scale = Constant <value = float {{0.35}}> ()
        dtypes = Constant <value = int64[5] {{15, 15, 15, 15, 15}}> ()
        {outputs} = org.pytorch.aten.ATen <operator = "ortwrap_ops::{op}", overload_name = "">
            (q, kt, v, {"mask" if mask else ""}, scale, dtypes)
    }}
    """
    return onnx.parser.parse_model(text)


@training_only
@pytest.mark.skipif(ON_ENGINE or not kernels.attention_available(), reason="no MKL bf16 GEMM in PyTorch's library")
@pytest.mark.parametrize(
    "op,q,kt,mask,out,rewritten",
    [
        ("attention_keep_inputs", "bfloat16[2, 3, 5, 8]", "bfloat16[2, 3, 8, 5]", "float[5, 5]", "bfloat16", True),
        ("attention_keep_inputs", "bfloat16[2, 3, 5, 8]", "bfloat16[2, 3, 8, 5]", None, "bfloat16", True),
        ("attention", "float[2, 3, 5, 8]", "float[2, 3, 8, 5]", None, "float", True),  # Casts around the kernel
        ("attention_keep_inputs", "bfloat16[2, 3, 5, 8]", "bfloat16[2, 3, 8, 5]", "bfloat16[5, 5]", "bfloat16", False),
        ("attention_keep_inputs", "bfloat16[2, 3, 5, 8]", "bfloat16[1, 3, 8, 5]", None, "bfloat16", False),
        ("attention_keep_inputs", "bfloat16[2, 3, 5, 8]", "bfloat16[2, 3, 6, 5]", None, "bfloat16", False),
        ("attention", "double[2, 3, 5, 8]", "bfloat16[2, 3, 8, 5]", None, "bfloat16", False),
    ],
    ids=["masked", "unmasked", "float32-operands", "bf16-mask", "broadcast-k", "bad-head-dim", "float64-q"],
)
@no_exporter
def test_native_attention_pass_conditions(op, q, kt, mask, out, rewritten):
    """ortwrap's flash attention ops on bf16 or float32 q, k^T, v (and a float32 mask, if any) become
    ortwrap's ``attention_bf16`` kernel on the same inputs, rounded to bf16 by a Cast where they
    are float32 (as the op rounds them), the output keeping its name (widened by a Cast where it
    was float32); anything else keeps PyTorch's flash attention."""
    import onnx_ir as ir

    from ortwrap.passes.native_attention import NativeAttentionPass

    model = ir.serde.deserialize_model(_attention_model(op, q, kt, mask, out))
    p = NativeAttentionPass()
    result = p(model)
    after = ir.serde.serialize_model(result.model)
    node = next(n for n in after.graph.node if n.op_type == "ATen")
    operator = next(a.s.decode() for a in node.attribute if a.name == "operator")
    assert result.modified == rewritten and p.rewritten == int(rewritten)
    if not rewritten:
        assert operator == f"ortwrap_ops::{op}"
        return
    assert operator == "ortwrap_cpu::attention_bf16" and len(node.output) == 2
    producers = {o: n for n in after.graph.node for o in n.output}
    operands = [producers[i].input[0] if i in producers and producers[i].op_type == "Cast" else i for i in node.input]
    assert operands == ["q", "kt", "v", "mask" if mask else "", "scale"]
    casts = sorted(n.input[0] for n in after.graph.node if n.op_type == "Cast")
    assert casts == (sorted(["q", "kt", node.output[0]]) if out == "float" else [])
    assert after.graph.output[0].name == "y" and "y" in {o for n in after.graph.node for o in n.output}


@no_exporter
@training_only
@pytest.mark.skipif(ON_ENGINE or not kernels.attention_available(), reason="no MKL bf16 GEMM in PyTorch's library")
def test_native_attention_pass_reads_the_heads_layout():
    """q, k^T and v moved into heads by Transposes from [B, T, H, D] tensors, and the output moved
    back: the kernel variant that reads and writes that layout takes the originals, and the
    Transposes go (a Shape of a moved value then reads its source)."""
    import onnx_ir as ir

    from ortwrap.passes.native_attention import NativeAttentionPass

    text = """
    <ir_version: 8, opset_import: ["" : 17, "org.pytorch.aten" : 1]>
    agraph (bfloat16[2, 5, 3, 8] q4, bfloat16[2, 5, 3, 8] k4, bfloat16[2, 5, 3, 8] v4, float[5, 5] mask)
            => (bfloat16[2, 5, 3, 8] y4, int64[1] n) <bfloat16[2, 3, 5, 8] y> {
        q = Transpose <perm = [0, 2, 1, 3]> (q4)
        kt = Transpose <perm = [0, 2, 3, 1]> (k4)
        v = Transpose <perm = [0, 2, 1, 3]> (v4)
        n = Shape <start = 1, end = 2> (q)
        scale = Constant <value = float {0.35}> ()
        dtypes = Constant <value = int64[5] {15, 15, 15, 15, 15}> ()
        y, kc, lse = org.pytorch.aten.ATen <operator = "ortwrap_ops::attention_keep_inputs", overload_name = "">
            (q, kt, v, mask, scale, dtypes)
        y4 = Transpose <perm = [0, 2, 1, 3]> (y)
    }
    """
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(onnx.parser.parse_model(text)))
    p = NativeAttentionPass()
    result = p(model)
    after = ir.serde.serialize_model(result.model)
    assert result.modified and p.rewritten == 1
    (node,) = [n for n in after.graph.node if n.op_type == "ATen"]
    assert next(a.s.decode() for a in node.attribute if a.name == "operator") == "ortwrap_cpu::attention_bthd_bf16"
    assert list(node.input) == ["q4", "k4", "v4", "mask", "scale"] and node.output[0] == "y4"
    assert not [n for n in after.graph.node if n.op_type == "Transpose"]


@no_exporter
def test_half_matmul_pass_then_float32_keeps_the_gemms_in_bf16():
    """After HalfPrecisionOnCPUPass the GEMM (computing in bf16 inside) reads and writes float32
    like the ops around it; no Cast is left but the graph output's, which keeps its dtype."""
    import onnx_ir as ir
    import onnx_text

    from ortwrap.passes.half_matmul import TorchGemmOnCPUPass
    from ortwrap.passes.half_precision import HalfPrecisionOnCPUPass

    body = """
    agraph (float[4, 8] x, float[6, 8] w) => (bfloat16[4, 6] r) {
        xh = Cast <to = 16> (x)
        wh = Cast <to = 16> (w)
        wt = Transpose <perm = [1, 0]> (wh)
        y = MatMul (xh, wt)
        r = Relu (y)
    }
    """
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(onnx_text.parse(body)))
    for p in (TorchGemmOnCPUPass(), HalfPrecisionOnCPUPass()):
        model = p(model).model
    after = ir.serde.serialize_model(model)
    ops = [n.op_type for n in after.graph.node if n.op_type != "Constant"]
    assert ops == ["ATen", "Relu", "Cast"], ops
    assert _aten_ops(after) == [("ortwrap_ops::linear", ["x", "w", ""], 15)]
    assert after.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16


_TWO_LINEARS = """
    agraph (float[4, 8] x, float[16, 8] w1, float[16] b1, float[8, 16] w2) => (float[4, 8] y{extra_out}) {{
        xh = Cast <to = 16> (x)
        w1h = Cast <to = 16> (w1)
        w1t = Transpose <perm = [1, 0]> (w1h)
        b1h = Cast <to = 16> (b1)
        m1 = MatMul (xh, w1t)
        h = Add (m1, b1h)
        shape = Constant <value = int64[2] {{4, 16}}> ()
        hr = Reshape (h, shape)
        w2h = Cast <to = 16> (w2)
        w2t = Transpose <perm = [1, 0]> (w2h)
        m2 = MatMul (hr, w2t)
        y = Cast <to = 1> (m2){extra}
    }}
"""


@no_exporter
@pytest.mark.parametrize("read_twice", [False, True], ids=["chain", "read-twice"])
def test_half_values_pass_keeps_bf16_between_gemms(read_twice):
    """After the native route's passes, the first GEMM's result and its Reshape are bf16 (the
    second GEMM narrows them anyway) and the GEMMs' dtypes say so; a result that two nodes read
    (their gradients would be summed in bf16) stays float32."""
    import onnx_ir as ir
    import onnx_text

    from ortwrap.passes.half_matmul import TorchGemmOnCPUPass
    from ortwrap.passes.half_precision import HalfPrecisionOnCPUPass
    from ortwrap.passes.half_values import HalfValuesOnCPUPass

    extra = "\n        r = Relu (h)" if read_twice else ""
    body = _TWO_LINEARS.format(extra=extra, extra_out=", bfloat16[4, 16] r" if read_twice else "")
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(onnx_text.parse(body)))
    last = HalfValuesOnCPUPass()
    for p in (TorchGemmOnCPUPass(), HalfPrecisionOnCPUPass(), last):
        model = p(model).model
    after = ir.serde.serialize_model(model)
    constants = {
        n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in after.graph.node if n.op_type == "Constant"
    }
    gemms = [n for n in after.graph.node if n.op_type == "ATen"]
    dtypes = [constants[n.input[-1]].tolist() for n in gemms]
    types = {v.name: v.type.tensor_type.elem_type for v in after.graph.value_info}
    if read_twice:
        assert last.narrowed == 0 and dtypes == [[15, 6, 6, 6, 6]] * 2, dtypes
        return
    # [compute, result, x, w, b]: bf16 = 15, float32 = 6
    assert last.narrowed == 2 and dtypes == [[15, 15, 6, 6, 6], [15, 6, 15, 6, 6]], dtypes
    reshape = next(n for n in after.graph.node if n.op_type == "Reshape")
    assert types[reshape.input[0]] == types[reshape.output[0]] == onnx.TensorProto.BFLOAT16


@no_exporter
def test_half_values_pass_writes_a_bf16_result_for_a_bf16_output():
    """A GEMM whose result the graph returns in bf16 (eager autocast's dtype; here through an
    Identity) writes it in bf16 (``dtypes``' result code): no float32 result and Cast after it."""
    import onnx_ir as ir
    import onnx_text

    from ortwrap.passes.half_matmul import TorchGemmOnCPUPass
    from ortwrap.passes.half_precision import HalfPrecisionOnCPUPass
    from ortwrap.passes.half_values import HalfValuesOnCPUPass

    body = _TWO_LINEARS.format(extra="", extra_out="").replace(
        "(float[4, 8] y)", "(bfloat16[4, 8] y)").replace("y = Cast <to = 1> (m2)", "y = Identity (m2)")  # fmt: skip
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(onnx_text.parse(body)))
    last = HalfValuesOnCPUPass()
    for p in (TorchGemmOnCPUPass(), HalfPrecisionOnCPUPass(), last):
        model = p(model).model
    after = ir.serde.serialize_model(model)
    constants = {
        n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in after.graph.node if n.op_type == "Constant"
    }
    gemms = [n for n in after.graph.node if n.op_type == "ATen"]
    # [compute, result, x, w, b]: bf16 = 15, float32 = 6
    assert [constants[n.input[-1]].tolist() for n in gemms] == [[15, 15, 6, 6, 6], [15, 15, 15, 6, 6]]
    assert last.casts == 1 and not [n for n in after.graph.node if n.op_type == "Cast"]
    assert after.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16


@training_only
@pytest.mark.parametrize("route", ["native"])
def test_half_values_match_eager_on_a_gelu_mlp(route):
    """Linear -> GELU -> Linear under autocast: GELU runs as PyTorch's bf16 GELU between the two bf16
    GEMMs (its input and output bf16, as in eager); loss and every gradient match eager autocast."""

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 12), nn.LayerNorm(12), nn.Linear(12, 3))

    w = check_parity(make, mlp_inputs, autocast=autocast(torch.bfloat16), wrap_options={"half_compute": route}, **BF16)
    assert_route(w, route)
    graph = next(iter(w.programs())).graph.model().graph
    operators = {a.s.decode() for n in graph.node for a in n.attribute if a.name == "operator"}
    assert {"ortwrap_ops::gelu", "ortwrap_ops::gelu_backward"} <= operators, sorted(operators)


@no_exporter
def test_half_compute_option():
    from ortwrap import Options

    assert Options.resolve().native_bf16 is None  # "auto": each build measures (test_gemm_choice.py)
    assert Options.resolve(half_compute="native").native_bf16
    assert not Options.resolve(half_compute="float32").native_bf16
    with pytest.raises(ValueError, match="auto, float32, native"):
        Options.resolve(half_compute="bf16")


@pytest.mark.skipif(not ON_ENGINE, reason="the training engine reads half_compute (test_mlp_under_autocast)")
def test_half_compute_is_not_read_on_the_onnxruntime_engine():
    """engine=onnxruntime does not read ``half_compute`` (docs/engines.md: the GEMM choice is the
    training engine's): under bf16 autocast ``"native"`` builds the graphs of ``"float32"``, so output
    and every gradient are the same bits, and they match eager autocast."""
    torch.manual_seed(0)
    base = mlp()
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(1))
    runs = {}
    for route in ("float32", "native"):
        w = ORTWrap(copy.deepcopy(base), fallback=False, half_compute=route)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = w(x)
        out.float().square().sum().backward()
        runs[route] = (out, {n: p.grad for n, p in w.named_parameters()})
    eager = copy.deepcopy(base)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = eager(x)
    ref.float().square().sum().backward()
    (out32, g32), (outn, gn) = runs["float32"], runs["native"]
    assert outn.dtype == ref.dtype == torch.bfloat16 and torch.equal(outn, out32)
    assert_close(outn.float(), ref.float(), "output", **BF16)
    for name, p in eager.named_parameters():
        assert torch.equal(gn[name], g32[name]), name
        assert_close(gn[name], p.grad, f"grad of {name}", **BF16)
