"""``gemm="auto"`` and ``half_compute="auto"``: each graph's GEMM library chosen by timing its own GEMM
shapes through ONNX Runtime's MLAS and PyTorch, once per machine (``ortwrap/gemm_choice.py``).

The decision is a pure function of measured rates (tested with given rates); the real tests build
models above ``MIN_STEP_FLOPS``, check that a build measures once and later builds reuse the record
(in the process, then from the disk), that the route the graph takes is the one the rates choose,
and that training matches eager on it."""

from __future__ import annotations

import json

import onnx
import onnx_ir as ir
import pytest
import torch
from onnx_text import parse
from parity import check_parity, gemm_op_counts, no_exporter, seq_len
from torch import nn

from ortwrap import ORTWrap
from ortwrap import gemm_choice as gc
from ortwrap.gemm_choice import Gemm, Rate, decide
from ortwrap.options import Options

pytestmark = pytest.mark.usefixtures("exporter")

VOCAB = 512
#: bf16 autocast tolerance (test_mixed_precision.py's)
BF16 = {"atol": 3e-2, "rtol": 3e-2}


def gpt() -> nn.Module:
    from tiny_gpt import GPTConfig, TinyGPT

    return TinyGPT(GPTConfig(vocab=VOCAB, d=128, heads=4, layers=2))


def gpt_inputs(b, g):
    ids = torch.randint(0, VOCAB, (b, seq_len(b, 32)), generator=g)
    return (ids, ids), {}


def gpt_loss(out):
    return out[0]


def _one_step(w: ORTWrap, b: int = 4) -> None:
    args, _ = gpt_inputs(b, torch.Generator().manual_seed(0))
    gpt_loss(w(*args)).backward()


def _torch_route(w: ORTWrap) -> bool:
    counts = gemm_op_counts(w)
    return any(k.endswith("_f32") for k in counts)


# ------------------------------------------------------------------------------------ the decision


@no_exporter
def test_decide_picks_the_faster_route():
    big = Gemm(1000, 1000, 1000, count=2)
    assert decide([Rate(big, big, ort=100e9, torch=200e9)])[0]
    assert not decide([Rate(big, big, ort=200e9, torch=100e9)])[0]
    _, ort_s, torch_s = decide([Rate(big, big, ort=100e9, torch=200e9)], crossing_s=0.0)
    assert ort_s == pytest.approx(2 * 2e9 / 100e9) and torch_s == pytest.approx(2 * 2e9 / 200e9)


@no_exporter
def test_decide_keeps_mlas_on_a_tie_and_for_many_tiny_gemms():
    big = Gemm(1000, 1000, 1000)
    assert not decide([Rate(big, big, ort=100e9, torch=102e9)])[0]  # within the margin
    tiny = Gemm(16, 16, 16, count=1000)  # 2x faster GEMMs, but each call crosses into PyTorch
    assert not decide([Rate(tiny, tiny, ort=10e9, torch=20e9)])[0]
    assert decide([Rate(tiny, tiny, ort=10e9, torch=20e9)], crossing_s=0.0)[0]
    assert not decide([])[0]


@no_exporter
def test_decide_weighs_shapes_by_their_time():
    """One shape faster through each library: the one that takes the longer share of the step wins."""
    heavy, light = Gemm(2048, 2048, 2048, count=3), Gemm(256, 256, 256, count=3)
    rates = [Rate(heavy, heavy, ort=100e9, torch=150e9), Rate(light, light, ort=150e9, torch=50e9)]
    assert decide(rates)[0]
    rates = [Rate(heavy, heavy, ort=150e9, torch=100e9), Rate(light, light, ort=50e9, torch=150e9)]
    assert not decide(rates)[0]


@no_exporter
def test_measurements_under_load_are_kept_only_at_one_thread():
    assert gc.keep_on_disk(one_thread=True, load=9.0, cpus=2)
    assert gc.keep_on_disk(one_thread=False, load=1.5, cpus=2)
    assert not gc.keep_on_disk(one_thread=False, load=9.0, cpus=2)


@no_exporter
def test_shrunk_problem_fits_the_call_budget():
    g = Gemm(4096, 3072, 768, batch=1)
    s = g.shrunk(gc.MAX_CALL_FLOPS)
    assert s.flops <= gc.MAX_CALL_FLOPS and min(s.m, s.n, s.k) >= 64
    b = Gemm(256, 256, 64, batch=48).shrunk(gc.MAX_CALL_FLOPS)
    assert (b.m, b.n, b.k) == (256, 256, 64) and b.batch < 48  # the batch goes first
    assert Gemm(64, 64, 64).shrunk(gc.MAX_CALL_FLOPS) == Gemm(64, 64, 64)


GRAPH = """
    agraph (float[B, T, 16] x, float[24, 16] w, float[24, 16] w2, float[B, 4, T, 8] q, float[B, 4, 8, T] kt)
            => (float[B, T, 24] y, float[B, T, 24] y2, float[B, 4, T, T] s) {
        wt = Transpose <perm = [1, 0]> (w)
        y = MatMul (x, wt)
        w2t = Transpose <perm = [1, 0]> (w2)
        y2 = MatMul (x, w2t)
        s = MatMul (q, kt)
    }
"""


def _typed(body: str) -> ir.Model:
    return ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(parse(body)))


@no_exporter
def test_gemm_problems_of_a_training_graph():
    """Two Linears of one shape (forward, dX, dW each counted twice) and a batched q k^T, with the
    first call's batch and length."""
    model = _typed(GRAPH)
    leaves = [torch.empty(2, 5, 16), torch.empty(24, 16), torch.empty(24, 16), torch.empty(2, 4, 5, 8),
              torch.empty(2, 4, 8, 5)]  # fmt: skip
    dims = gc.input_dims(model, ["x", "w", "w2", "q", "kt"], leaves)
    assert dims == {"B": 2, "T": 5}
    problems = gc.gemm_problems(model, dims, ir.DataType.FLOAT, with_backward=True)
    assert len(problems) == 6 and set(problems) == {
        Gemm(10, 24, 16, 1, False, True, count=2),  # x @ W^T
        Gemm(10, 16, 24, 1, False, False, count=2),  # dX = dY @ W
        Gemm(24, 16, 10, 1, True, False, count=2),  # dW = dY^T @ x
        Gemm(5, 5, 8, batch=8),  # q @ k^T
        Gemm(5, 8, 5, batch=8),
        Gemm(8, 5, 5, batch=8),
    }
    assert gc.gemm_problems(model, dims, ir.DataType.FLOAT, with_backward=False) == [
        Gemm(10, 24, 16, 1, False, True, count=2),
        Gemm(5, 5, 8, batch=8),
    ]
    assert gc.gemm_problems(model, dims, ir.DataType.BFLOAT16, with_backward=True) == []
    assert gc.gemm_problems(model, {"B": 2}, ir.DataType.FLOAT, with_backward=True) is None  # T unknown


@no_exporter
def test_build_cache_key_names_the_machine_only_for_auto():
    assert gc.schema_key(Options(gemm="ort", half_compute="float32"))[2] is None
    assert gc.schema_key(Options())[2] == gc.schema_key(Options())[2] is not None
    torch.set_num_threads(1)
    try:
        one = gc.schema_key(Options())
    finally:
        torch.set_num_threads(2)
    assert one != gc.schema_key(Options())  # measured at another thread count


# ------------------------------------------------------------------------------------ real builds


def test_auto_measures_once_per_machine_and_trains_like_eager(gemm_dir, exporter):
    """A GPT above MIN_STEP_FLOPS: the first build times its GEMM shapes (once), the graph takes the
    route the rates choose, training matches eager; a second build reuses the record, and so does a
    build after the in-process record is gone (from the disk)."""
    before = gc.measurements
    w = check_parity(gpt, gpt_inputs, loss_fn=gpt_loss, lr=0.01, wrap_options={"build_cache": False})
    assert gc.measurements == before + 1
    choice = w.last_artifacts.gemm_choice
    assert choice.option == "gemm" and choice.how in ("measured", "cached"), choice.summary()
    assert len(choice.rates) == gc.MAX_SHAPES and all(r.ort > 0 and r.torch > 0 for r in choice.rates)
    assert choice.torch_gemm == decide(choice.rates)[0]
    assert _torch_route(w) == choice.torch_gemm
    assert len(list(gemm_dir.glob("*.json"))) == 1

    torch.manual_seed(0)
    again = ORTWrap(gpt(), fallback=False, build_cache=False, exporter=exporter)
    _one_step(again)
    assert again.last_artifacts.gemm_choice.how == "cached" and gc.measurements == before + 1
    gc._memo.clear()  # a new process: the record comes from the disk
    again = ORTWrap(gpt(), fallback=False, build_cache=False, exporter=exporter)
    _one_step(again)
    assert again.last_artifacts.gemm_choice.how == "cached" and gc.measurements == before + 1
    assert again.last_artifacts.gemm_choice.torch_gemm == choice.torch_gemm


def _set_rates(gemm_dir, torch_faster: bool) -> None:
    """Rewrite the recorded rates: one library 2x the other's on every shape."""
    (path,) = gemm_dir.glob("*.json")
    data = json.loads(path.read_text())
    for r in data["rates"].values():
        slow = min(r["ort"], r["torch"])
        r["ort"], r["torch"] = (slow, 2 * slow) if torch_faster else (2 * slow, slow)
    path.write_text(json.dumps(data))
    gc._memo.clear()


@pytest.mark.parametrize("torch_faster", [True, False], ids=["torch-faster", "mlas-faster"])
def test_recorded_rates_choose_the_route(gemm_dir, exporter, torch_faster):
    """Whichever library the machine's record says is faster runs the GEMMs (PyTorch's: the float32
    linear and flash attention ops; MLAS's: MatMul/Gemm), training matches eager either way, and an
    explicit ``gemm`` is followed whatever the record says."""
    torch.manual_seed(0)
    _one_step(ORTWrap(gpt(), fallback=False, build_cache=False, exporter=exporter))  # records the rates
    _set_rates(gemm_dir, torch_faster)
    before = gc.measurements
    w = check_parity(gpt, gpt_inputs, loss_fn=gpt_loss, lr=0.01, wrap_options={"build_cache": False})
    choice = w.last_artifacts.gemm_choice
    assert (choice.how, choice.torch_gemm, _torch_route(w)) == ("cached", torch_faster, torch_faster)
    explicit = "ort" if torch_faster else "torch"
    torch.manual_seed(0)
    w = ORTWrap(gpt(), fallback=False, build_cache=False, exporter=exporter, gemm=explicit)
    _one_step(w)
    assert w.last_artifacts.gemm_choice.how == "option" and _torch_route(w) == (explicit == "torch")
    assert gc.measurements == before


def wide_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 8))


def wide_inputs(b, g):
    return (torch.randn(64 * b, 256, generator=g),), {}


def test_auto_half_compute_measures_bf16_gemms(gemm_dir):
    """Under bf16 autocast the choice is ``half_compute``'s: PyTorch's bf16 GEMMs against MLAS's float32
    ones on the graph's bf16 GEMM shapes (or float32 without measuring where the CPU has no bf16
    instructions); the graph takes that route and training matches eager autocast."""
    from ortwrap.cpu import cpu_has_native_bf16

    w = check_parity(
        wide_mlp, wide_inputs, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        wrap_options={"build_cache": False}, **BF16,
    )  # fmt: skip
    choice = w.last_artifacts.gemm_choice
    assert choice.option == "half_compute", choice.summary()
    if cpu_has_native_bf16():
        assert choice.how in ("measured", "cached") and choice.rates and choice.native_bf16 == decide(choice.rates)[0]
    else:
        assert choice.how == "no bf16 instructions" and not choice.native_bf16
    assert bool(gemm_op_counts(w)) == choice.native_bf16


def test_small_graph_keeps_mlas_without_measuring(gemm_dir):
    before = gc.measurements
    w = check_parity(lambda: nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 5)),
                     lambda b, g: ((torch.randn(b, 12, generator=g),), {}))  # fmt: skip
    choice = w.last_artifacts.gemm_choice
    assert (choice.how, choice.torch_gemm, gc.measurements) == ("small", False, before)
    assert not gemm_op_counts(w) and not list(gemm_dir.glob("*.json"))
