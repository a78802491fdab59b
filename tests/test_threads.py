"""ORT's thread settings follow the rule of docs/performance.md ("Threads"): as many intra-op threads
as PyTorch's ``torch.get_num_threads()`` when the session is created (or ``intra_op_threads``), one
inter-op thread, and ORT's idle threads sleeping rather than spinning unless ``allow_spinning``."""

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
    spinning off in both pools."""
    torch.set_num_threads(threads)
    w = _train_and_compare(exporter)
    for so in _session_options(w):
        assert so.intra_op_num_threads == threads
        assert so.inter_op_num_threads == 1
        assert [so.get_session_config_entry(k) for k in SPIN_KEYS] == ["0", "0"]


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
