"""ORT's thread settings follow the rule of docs/performance.md ("Threads"): as many intra-op threads
as PyTorch's ``torch.get_num_threads()`` when the session is created (or ``intra_op_threads``), but one
for a CPU training graph of small kernels (``gemm_choice.decide_pool``), one inter-op thread, and
ORT's idle threads sleeping rather than spinning unless ``allow_spinning``."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import assert_close, no_exporter
from torch import nn

from ortwrap import ORTWrap
from ortwrap.engines.onnxruntime import session as engine_session
from ortwrap.options import Options
from ortwrap.runtime import session as runtime_session

pytestmark = pytest.mark.usefixtures("exporter")

SPIN_KEYS = ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


def _train_and_compare(exporter: str, **options) -> ORTWrap:
    """One training step of the model on eager and on ORTWrap; loss and every gradient must agree."""
    eager = _model()
    w = ORTWrap(copy.deepcopy(eager), fallback=False, exporter=exporter, **options)
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(1))
    ref, got = eager(x), w(x)
    (ref * torch.arange(3.0)).sum().backward()
    (got * torch.arange(3.0)).sum().backward()
    assert_close(got, ref, "output")
    for (name, p), q in zip(eager.named_parameters(), w.module.parameters(), strict=True):
        assert_close(q.grad, p.grad, f"grad {name}")
    assert w.programs()
    return w


def _session_options(w: ORTWrap) -> list:
    return [p.runner._session.get_session_options() for p in w.programs()]


@pytest.fixture
def torch_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [1, 3])
def test_intra_op_threads_follow_torch_and_ort_threads_do_not_spin(exporter, torch_threads, threads):
    """Default options: ORT's intra-op pool is as large as PyTorch's at session creation (3 is more
    than this machine's cores: the rule is torch's count, not the core count), one inter-op thread,
    spinning off in both pools. An inference graph and a training graph with a large value."""
    torch.set_num_threads(threads)
    eager = _model()
    w = ORTWrap(copy.deepcopy(eager), fallback=False, exporter=exporter, build_cache=False)
    x = torch.randn(1 << 16, 12, generator=torch.Generator().manual_seed(1))  # [65536, 16] activations
    ref, got = eager(x), w(x)
    (ref * torch.arange(3.0)).mean().backward()
    (got * torch.arange(3.0)).mean().backward()
    assert_close(got, ref, "output")
    for (name, p), q in zip(eager.named_parameters(), w.module.parameters(), strict=True):
        # sums over 65536 rows in another order: float32 rounding ~1e-3 of the largest element
        assert_close(q.grad, p.grad, f"grad {name}", atol=2e-3, rtol=2e-3)
    assert w.last_artifacts.gemm_choice.largest_elements >= 1 << 20
    with torch.no_grad():
        assert_close(w(x), eager(x), "no_grad output")
    assert len(w.programs()) == 2
    for so in _session_options(w):
        assert so.intra_op_num_threads == threads
        assert so.inter_op_num_threads == 1
        assert [so.get_session_config_entry(k) for k in SPIN_KEYS] == ["0", "0"]


def test_a_training_graph_of_small_kernels_runs_on_one_ort_thread(exporter, torch_threads):
    """A CPU training graph whose GEMMs are small and whose values are small runs on one ORT thread
    (and ortwrap's kernels in it on the running thread) at 3 torch threads; the results are eager's.
    (The choice is the graph's, made on the first call's sizes: a build cache entry keeps it.)"""
    torch.set_num_threads(3)
    w = _train_and_compare(exporter, build_cache=False)
    (program,) = w.programs()
    assert program.runner.graph.ort_threads == 1
    assert _session_options(w)[0].intra_op_num_threads == 1
    ops = [n.attribute[0].s.decode() for n in program.runner.graph.model().graph.node if n.op_type == "ATen"]
    if any(op.startswith("ortwrap_cpu::") for op in ops):  # LayerNorm/GELU as ortwrap's kernels
        assert program.runner._serial is not None
    choice = w.last_artifacts.gemm_choice
    assert choice.how == "small" and choice.ort_matrix_seconds() == 0.0
    x = torch.randn(7, 12)
    for _ in range(2):  # later steps, another batch size
        w(x).sum().backward()
    assert len(w.programs()) == 1


def test_explicit_threads_and_spinning_options_win(exporter, torch_threads):
    """``intra_op_threads`` overrides torch's count; ``allow_spinning=True`` turns ORT's spinning on."""
    torch.set_num_threads(1)
    w = _train_and_compare(exporter, intra_op_threads=2, allow_spinning=True)
    for so in _session_options(w):
        assert so.intra_op_num_threads == 2
        assert [so.get_session_config_entry(k) for k in SPIN_KEYS] == ["1", "1"]


@no_exporter
@pytest.mark.parametrize(
    "make", [runtime_session.session_options, engine_session.session_options], ids=["training", "engine"]
)
def test_both_engines_session_options_follow_the_rule(exporter, torch_threads, make):
    """The same rule for the training engine's sessions and the onnxruntime engine's."""
    torch.set_num_threads(3)
    so = make(Options.resolve(intra_op_threads=0, allow_spinning=False))
    assert (so.intra_op_num_threads, so.inter_op_num_threads) == (3, 1)
    assert [so.get_session_config_entry(k) for k in SPIN_KEYS] == ["0", "0"]
    so = make(Options.resolve(intra_op_threads=2, allow_spinning=True))
    assert so.intra_op_num_threads == 2
    assert [so.get_session_config_entry(k) for k in SPIN_KEYS] == ["1", "1"]


@no_exporter
def test_decide_pool_prices_matrix_work_per_node(exporter):
    """``decide_pool`` (pure): the pool where ORT's GEMMs and convolutions take >= POOL_MIN_NODE_S a
    node or a value is large; one thread below; the pool where nothing says (None). The estimate
    scales the timed GEMM shapes to the step's FLOPs and leaves out what PyTorch's route runs."""
    from ortwrap import gemm_choice as gc

    per = gc.POOL_MIN_NODE_S
    assert gc.decide_pool(None, 500, 0)
    assert not gc.decide_pool(0.0, 500, 1000)
    assert not gc.decide_pool(0.9 * per * 500, 500, 1000)
    assert gc.decide_pool(1.1 * per * 500, 500, 1000)
    assert gc.decide_pool(0.0, 500, gc.POOL_BIG_ELEMENTS)
    g = gc.Gemm(256, 256, 256, count=2)
    rate = gc.Rate(g, g, ort=1e11, torch=5e10)
    ort_s = g.flops * g.count / rate.ort
    chosen = gc.GemmChoice(False, False, "gemm", "cached", (rate,), ort_s, 2 * ort_s, step_flops=4 * g.flops * g.count)
    assert chosen.ort_matrix_seconds() == pytest.approx(4 * ort_s)
    routed = gc.GemmChoice(True, False, "gemm", "measured", (rate,), ort_s, ort_s / 2, step_flops=g.flops * g.count)
    assert routed.ort_matrix_seconds() == 0.0
    conv = gc.Conv(4, 32, 20, 20, 16, 3, 3, pads=(1, 1), count=3)
    slow_torch, fast_torch = gc.ConvRate(conv, 1e-3, 5e-3), gc.ConvRate(conv, 1e-3, 1e-4)
    small = dict(torch_gemm=False, native_bf16=False, option="gemm", how="small", conv_how="cached")
    assert gc.GemmChoice(**small, conv_rates=(slow_torch,)).ort_matrix_seconds() == pytest.approx(3e-3)
    assert gc.GemmChoice(**small, conv_rates=(fast_torch,)).ort_matrix_seconds() == 0.0
    assert gc.GemmChoice(False, False, "gemm").ort_matrix_seconds() is None  # the option given: no rates
    assert gc.GemmChoice(**{**small, "conv_how": "measurement failed"}).ort_matrix_seconds() is None
