"""Distributed training: export-safe collective stubs, Functions that call collectives, DDP, DeepSpeed ZeRO.

The stub tests run in this process (with a one-rank gloo group where a real collective must run).
The training tests launch real two-rank runs (``torchrun --nproc_per_node=2``, gloo, CPU) of the
scripts in ``tests/dist/``; each rank writes what it saw to a JSON file and the tests here compare:
ORTWrap against eager PyTorch (Functions, DDP) or against plain DeepSpeed (ZeRO 1/2/3), on data that
differs between the ranks, so a collective that did not run would change the numbers. The same
workers run on ``engine="onnxruntime"`` (``ORTWRAP_ENGINE`` in the launch): DDP and ZeRO 1/2/3, in
``ORT_EXTRA=ort make test`` (slow beside the training build, where that engine is the second one).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from parity import ATOL, RTOL
from torch import nn

from ortwrap import ExportError, FallbackWarning, ORTWrap, UnsupportedInputError
from ortwrap.bridge.intercept import in_function
from ortwrap.engines import is_onnxruntime_available, is_training_available
from ortwrap.integrations.distributed import DoneWork, collective_stubs, stubs_active

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)
needs_training = pytest.mark.skipif(
    not is_training_available(), reason="engine='training': onnxruntime-training is not installed here"
)
needs_engine = pytest.mark.skipif(not is_onnxruntime_available(), reason="engine='onnxruntime': no onnxruntime")
#: engine="onnxruntime"'s two-rank runs: in ``ORT_EXTRA=ort make test``; slow where the training build
#: is installed (this engine is the second one there).
ENGINE_SLOW = pytest.mark.slow if is_training_available() else (lambda f: f)
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not importable (install the dev extra: DS_BUILD_OPS=0 pip install deepspeed==0.19.8)",
)


# ------------------------------------------------------------------------------------ helpers


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-process gloo group, so that the real collectives can run in this process."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


SEEN: list[tuple[bool, bool]] = []  # (stubs active, the collective is a stub) at each forward


class Gather(torch.autograd.Function):
    """All-gathers rows over the default group; records what it saw; backward keeps this rank's rows x3."""

    @staticmethod
    def forward(ctx, x):
        SEEN.append((stubs_active(), getattr(dist.all_gather_into_tensor, "__ortwrap_stub__", False)))
        out = torch.empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size())[dist.get_rank()] * 3


class GatherNet(nn.Module):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.fail = fail

    def forward(self, x):
        y = Gather.apply(self.fc(x))
        if self.fail:
            raise ValueError("this forward fails after its collective")
        return y


def _collectives() -> dict[str, object]:
    return {
        "dist.all_reduce": dist.all_reduce,
        "dist.all_gather_into_tensor": dist.all_gather_into_tensor,
        "dist.broadcast": dist.broadcast,
        "c10d.all_gather_into_tensor": c10d.all_gather_into_tensor,
        "c10d.reduce_scatter_tensor": c10d.reduce_scatter_tensor,
        "dist._all_gather_base": dist._all_gather_base,
        "dist.barrier": dist.barrier,
    }


# ------------------------------------------------------------------------------------ stubs, in process


@needs_gloo
def test_stubs_replace_every_collective_and_restore_them():
    before = _collectives()
    with collective_stubs():
        assert stubs_active()
        for name in ("all_gather_into_tensor", "all_gather", "all_reduce", "reduce_scatter_tensor", "reduce_scatter"):
            assert getattr(getattr(dist, name), "__ortwrap_stub__", False), name
            assert getattr(getattr(c10d, name), "__ortwrap_stub__", False), name
        for name in ("broadcast", "all_to_all_single", "barrier", "_all_gather_base", "_reduce_scatter_base"):
            assert getattr(getattr(dist, name), "__ortwrap_stub__", False), name
        with collective_stubs():  # nested: still installed
            assert dist.all_reduce is not before["dist.all_reduce"]
        assert dist.all_reduce is not before["dist.all_reduce"]
    assert not stubs_active()
    assert _collectives() == before


@needs_deepspeed
def test_stubs_cover_deepspeed_comm():
    import deepspeed.comm as ds_comm
    import deepspeed.comm.comm as ds_comm_impl

    names = ("all_gather_into_tensor", "allgather_fn", "all_reduce", "reduce_scatter_fn", "broadcast", "barrier")
    before = {n: getattr(ds_comm, n) for n in names}
    with collective_stubs():
        for n in names:
            assert getattr(getattr(ds_comm, n), "__ortwrap_stub__", False), n
            assert getattr(getattr(ds_comm_impl, n), "__ortwrap_stub__", False), n
    assert {n: getattr(ds_comm, n) for n in names} == before
    assert {n: getattr(ds_comm_impl, n) for n in names} == before


@needs_gloo
def test_stub_returns_completed_work_and_leaves_outputs_as_allocated():
    results = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = torch.full((2 * x.shape[0], x.shape[1]), 7.0)
            results["sync"] = dist.all_gather_into_tensor(out, x)
            work = dist.all_gather_into_tensor(out, x, async_op=True)
            results["work"] = work
            results["waited"] = work.wait()
            results["reduce"] = dist.all_reduce(x, async_op=False)
            results["recv"] = dist.recv(x, src=1)
            results["batch"] = dist.batch_isend_irecv([object(), object()])
            return out

        @staticmethod
        def backward(ctx, g):
            return g[: g.shape[0] // 2]

    x = torch.ones(3, 2)
    # No process group needed: nothing is communicated. (An export sets the "inside a bridged
    # Function" state itself; here the test does.)
    with collective_stubs(), in_function(Probe, bridged=True):
        out = Probe.apply(x)
    assert out.shape == (6, 2) and bool((out == 7).all()), "the stub wrote into the output"
    assert bool((x == 1).all())
    assert results["sync"] is None and results["reduce"] is None
    work = results["work"]
    assert isinstance(work, DoneWork) and isinstance(work, dist.Work)
    assert results["waited"] is True and work.is_completed() and work.is_success() and work.exception() is None
    assert work.get_future().done()
    assert results["recv"] == 1
    assert len(results["batch"]) == 2 and all(w.is_completed() for w in results["batch"])


@needs_gloo
def test_other_threads_keep_the_real_collectives(one_rank_group):
    works = []

    def other_thread():
        t = torch.ones(2)
        works.append(dist.all_reduce(t, async_op=True))  # outside any Function: a stub would refuse it

    with collective_stubs():
        assert getattr(dist.all_reduce, "__ortwrap_stub__", False)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert len(works) == 1 and not isinstance(works[0], DoneWork), works
    assert works[0].wait()


@needs_gloo
def test_export_runs_stubs_and_run_time_runs_real_collective(one_rank_group):
    SEEN.clear()
    torch.manual_seed(0)
    model = GatherNet()
    wrapped = ORTWrap(model, fallback=False, exporter="torchscript")  # one export: the collective runs once
    x = torch.randn(5, 3)
    out = wrapped(x)
    out.sum().backward()
    # The export ran the Function's forward once with the stubs; ORT's run ran it with the real collective.
    assert SEEN == [(True, True), (False, False)]
    assert not stubs_active()
    expected = model.fc(x)
    torch.testing.assert_close(out, expected.detach(), atol=ATOL, rtol=RTOL)
    grad_w = torch.autograd.grad((model.fc(x) * 3).sum(), model.fc.weight)[0]
    torch.testing.assert_close(model.fc.weight.grad, grad_w, atol=ATOL, rtol=RTOL)


@pytest.mark.slow
@needs_gloo
def test_dynamo_exporter_runs_stubs_too(one_rank_group):
    SEEN.clear()
    torch.manual_seed(0)
    model = GatherNet()
    wrapped = ORTWrap(model, fallback=False, exporter="dynamo")
    x = torch.randn(5, 3)
    out = wrapped(x)
    out.sum().backward()
    assert SEEN and all(seen == (True, True) for seen in SEEN[:-1]), SEEN  # the capture ran it with stubs
    assert SEEN[-1] == (False, False)  # ORT's run: the real collective
    torch.testing.assert_close(out, model.fc(x).detach(), atol=ATOL, rtol=RTOL)
    assert not stubs_active()


@needs_gloo
def test_stubs_restored_when_export_fails(one_rank_group):
    before = _collectives()
    SEEN.clear()
    # eager raises too, so the user gets eager's own exception (issue 13), not an ExportError
    with pytest.raises(ValueError, match="this forward fails after its collective"):
        ORTWrap(GatherNet(fail=True), fallback=False, exporter="torchscript")(torch.randn(4, 3))
    # the export reached the collective under the stubs; the eager run that followed ran it for real
    assert SEEN == [(True, True), (False, False)], SEEN
    assert _collectives() == before
    assert not stubs_active()


@needs_gloo
def test_collective_outside_a_function_is_refused(one_rank_group):
    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            y = self.fc(x)
            dist.all_reduce(y)  # traced, this would vanish from the graph
            return y

    model = Direct()
    with pytest.raises(ExportError, match=r"torch\.distributed\.all_reduce .*outside the forward of a torch\.autograd"):
        ORTWrap(model, fallback=False)(torch.randn(2, 3))
    wrapped = ORTWrap(model)
    x = torch.randn(2, 3)
    with pytest.warns(FallbackWarning, match="all_reduce"):
        out = wrapped(x)
    torch.testing.assert_close(out, model.fc(x).detach() * dist.get_world_size())
    assert not stubs_active()


@needs_gloo
def test_collective_in_an_inlined_function_is_refused(one_rank_group):
    qualname = f"{Gather.__module__}.{Gather.__qualname__}"
    with pytest.raises(ExportError, match=f"{qualname}, which inline_functions lists"):
        ORTWrap(GatherNet(), fallback=False, inline_functions=[qualname])(torch.randn(2, 3))


@needs_gloo
def test_data_parallel_inside_ortwrap_is_refused(one_rank_group):
    with pytest.raises(UnsupportedInputError, match=r"DistributedDataParallel\(ORTWrap\(model\)"):
        ORTWrap(nn.parallel.DistributedDataParallel(nn.Linear(2, 2)))
    with pytest.raises(UnsupportedInputError, match="DataParallel"):
        ORTWrap(nn.DataParallel(nn.Linear(2, 2)))
    assert issubclass(UnsupportedInputError, TypeError)


def test_zero3_gather_option_is_checked():
    with pytest.raises(ValueError, match="zero3_gather='layer' is invalid; allowed: module, submodule"):
        ORTWrap(nn.Linear(2, 2), zero3_gather="layer")


# ------------------------------------------------------------------------------------ two real ranks


def _launch(
    script: str,
    cases: list[str],
    out_dir: str,
    timeout: int = 300,
    cache_dir: str | None = None,
    engine: str = "training",
) -> dict[str, list[dict]]:
    """Run ``tests/dist/<script>`` on 2 ranks with torchrun; return each case's per-rank results.

    Every ORTWrap of the workers runs on ``engine`` (``ORTWRAP_ENGINE``). The build cache is off (these
    workers check what happens during an export: always export) unless ``cache_dir`` names one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTWRAP_")}
    env.update(
        ORTWRAP_ENGINE=engine,
        ORTWRAP_DIST_OUT=out_dir,
        ORTWRAP_BUILD_CACHE="0" if cache_dir is None else "1",
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]),
    )
    if cache_dir is not None:
        env["ORTWRAP_CACHE_DIR"] = cache_dir
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [os.path.join(HERE, "dist", script), *cases]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    results: dict[str, list[dict]] = {}
    for case in cases:
        ranks = []
        for rank in range(2):
            path = os.path.join(out_dir, f"{case}.rank{rank}.json")
            if not os.path.exists(path):
                pytest.fail(
                    f"{script} {case}: rank {rank} wrote no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
                )
            with open(path) as f:
                ranks.append(json.load(f))
        results[case] = ranks
    return results


def _ok(ranks: list[dict]) -> list[dict]:
    for r in ranks:
        assert "error" not in r, f"rank {r['rank']} of {r['case']} failed:\n{r['error']}"
    return ranks


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    if not is_training_available():
        pytest.skip("engine='training': onnxruntime-training is not installed here")
    return _launch("torch_worker.py", ["functions", "ddp", "logging"], str(tmp_path_factory.mktemp("torch_dist")))


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    cases = ["zero1", "zero2", "zero3", "zero3_init", "zero3_accum", "zero3_partial", "zero3_fallback"]
    cases += ["zero3_evalfallback"]
    cases += ["deepspeed_comm", "zero3_leaf", "zero3_submodule", "zero3_submodule_dynamo"]
    cases += ["zero3_submodule_gpt"]
    if not is_training_available():
        pytest.skip("engine='training': onnxruntime-training is not installed here")
    return _launch("deepspeed_worker.py", cases, str(tmp_path_factory.mktemp("deepspeed_dist")))


@pytest.fixture(scope="module")
def engine_torch_runs(tmp_path_factory):
    return _launch("torch_worker.py", ["ddp"], str(tmp_path_factory.mktemp("engine_dist")), engine="onnxruntime")


@pytest.fixture(scope="module")
def engine_deepspeed_runs(tmp_path_factory):
    cases = ["zero1", "zero2", "zero3", "zero3_submodule"]
    return _launch("deepspeed_worker.py", cases, str(tmp_path_factory.mktemp("engine_ds")), engine="onnxruntime")


@pytest.mark.slow
@needs_gloo
def test_functions_calling_collectives_train_like_eager_on_two_ranks(torch_runs):
    # Inside the run, tests/parity.py checked outputs and every gradient against eager over 3 steps.
    ranks = _ok(torch_runs["functions"])
    for r in ranks:
        calls = r["calls"]
        # One training export + one no-grad export, each ran the Function with the stubs; the 3 eager
        # steps, 3 ORT steps and 1 no-grad ORT run gathered for real.
        assert r["export_count"] == 2 and calls["gather_during_export"] == 2
        assert calls["gather_forward"] == 7
        assert calls["reduce_backward"] == 6  # 3 eager + 3 ORT backwards all-reduced
        assert r["peer_rows_differ"], "both ranks had the same rows: the gather test proves nothing"
    assert ranks[0]["output_sum"] == pytest.approx(ranks[1]["output_sum"], rel=1e-5)


@pytest.mark.slow
@needs_gloo
def test_only_rank_zero_logs_below_warning(torch_runs):
    rank0, rank1 = _ok(torch_runs["logging"])
    assert rank0["export_count"] == rank1["export_count"] == 1
    assert any(m.startswith("built ") for m in rank0["info"]), rank0["info"]
    assert rank1["info"] == [], rank1["info"]
    assert rank0["warnings"] == ["a warning on rank 0"] and rank1["warnings"] == ["a warning on rank 1"]


@pytest.mark.slow
@needs_gloo
def test_ddp_of_ortwrap_matches_eager_ddp(torch_runs):
    # Inside the run: outputs and every gradient equal eager DDP's at each of 4 steps.
    for r in _ok(torch_runs["ddp"]):
        assert r["fallback"] is None and r["export_count"] == 1
        assert r["params_equal_across_ranks"]
        assert r["allreduced_grad_differs_from_local"] == [True] * 4


def _assert_deepspeed_parity(ranks: list[dict], stage: int, fallback: bool = False, engine: str = "training") -> None:
    for r in _ok(ranks):
        plain, ours = r["plain"], r["ortwrap"]
        assert ours["engine"] == engine
        if fallback:
            assert ours["fallback"] and "ScaleAndCount" in ours["fallback"], ours["fallback"]
        else:
            assert ours["fallback"] is None
            assert ours["export_count"] == 1, "ORTWrap exported more than once for the training steps"
            # DeepSpeed's ZeRO-3 swaps F.linear for an autograd Function; the export uses torch's own
            # (a PythonOp per Linear would cost a Python call each step and keep the graph uncacheable).
            assert ours["python_ops"] == 0, f"{ours['python_ops']} PythonOps in the graph"
        before, after = ours["deepspeed_hooks"]
        assert before == after, "DeepSpeed's module hooks were not restored after the export"
        assert stage < 3 or before > 0
        torch.testing.assert_close(
            torch.tensor(ours["losses"]),
            torch.tensor(plain["losses"]),
            atol=ATOL,
            rtol=RTOL,
            msg=lambda m: f"losses: {m}",
        )
        for name, value in plain["params"].items():
            torch.testing.assert_close(
                torch.tensor(ours["params"][name]),
                torch.tensor(value),
                atol=ATOL * 10,
                rtol=RTOL * 10,
                msg=lambda m, name=name: f"parameter {name} after training: {m}",
            )
        if stage == 3:
            n = len(plain["losses"])
            assert plain["partitioned_after_backward"] == [True] * n, "the ZeRO-3 test config does not partition"
            assert ours["partitioned_after_backward"] == [True] * n, "ORTWrap left ZeRO-3 parameters gathered"
            if not fallback:  # after a fallback, DeepSpeed's hooks manage the parameters
                assert ours["gathered_after_no_grad"] == [], "ORTWrap left parameters gathered after a no-grad run"
            assert ours["eval_out_shape"] == [4, 3]
    assert ranks[0]["ortwrap"]["losses"] != ranks[1]["ortwrap"]["losses"], "the ranks saw the same data"


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize(
    "case,stage",
    [("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero3_init", 3), ("zero3_accum", 3), ("zero3_partial", 3)],
    ids=["zero1", "zero2", "zero3", "zero3-zero.Init", "zero3-grad-accumulation", "zero3-ortwrap-submodule"],
)
def test_deepspeed_zero_matches_plain_deepspeed(deepspeed_runs, case, stage):
    _assert_deepspeed_parity(deepspeed_runs[case], stage)


@pytest.mark.slow
@needs_deepspeed
def test_zero3_second_process_starts_from_the_build_cache(tmp_path):
    # A ZeRO-3 run (zero.Init, module gather) stores its build; a second process with the same
    # cache directory trains from it without exporting, with the same losses on each rank.
    cache = str(tmp_path / "cache")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _launch("deepspeed_worker.py", ["zero3_cached"], str(tmp_path / "a"), cache_dir=cache)["zero3_cached"]
    second = _launch("deepspeed_worker.py", ["zero3_cached"], str(tmp_path / "b"), cache_dir=cache)["zero3_cached"]
    for a, b in zip(_ok(first), _ok(second)):
        assert a["ortwrap"]["export_count"] == 1 and a["ortwrap"]["fallback"] is None
        assert b["ortwrap"]["export_count"] == 0, "the second process exported again instead of loading the cache"
        assert b["ortwrap"]["fallback"] is None
        assert a["ortwrap"]["losses"] == b["ortwrap"]["losses"]


@pytest.mark.slow
@needs_deepspeed
def test_zero3_fallback_to_pytorch_matches_plain_deepspeed(deepspeed_runs):
    # The export fails (a Function with an int output); ORTWrap runs the module in PyTorch, where
    # DeepSpeed's own hooks gather the parameters again.
    _assert_deepspeed_parity(deepspeed_runs["zero3_fallback"], 3, fallback=True)


@pytest.mark.slow
@needs_deepspeed
def test_zero3_inference_fallback_leaves_training_on_ort(deepspeed_runs):
    # Only the eval-mode path cannot be built: that no-grad call (mid-training, and after training)
    # runs in PyTorch; every training step before and after it runs the one ORT training program, and
    # ZeRO-3's parameters are partitioned again after each backward and after each no-grad call.
    ranks = deepspeed_runs["zero3_evalfallback"]
    for r in _ok(ranks):
        plain, ours = r["plain"], r["ortwrap"]
        assert ours["fallback"] and "ScaleAndCount" in ours["fallback"], ours["fallback"]
        # one training program; it ran every step and the forward dropped without a backward
        assert ours["program_runs"] == [len(plain["losses"]) + 1], ours["program_runs"]
        assert ours["python_ops"] == 0
        assert ours["gathered_after_no_grad"] == [], "ORTWrap left parameters gathered after a no-grad fallback"
    _assert_deepspeed_parity(ranks, 3, fallback=True)


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize(
    "case,exporter",
    [("zero3_submodule", "torchscript"), ("zero3_submodule_dynamo", "dynamo")],
    ids=["torchscript", "dynamo-default"],
)
def test_zero3_per_submodule_gathers_one_layer_at_a_time(deepspeed_runs, case, exporter):
    # zero3_gather="submodule": losses and parameters equal to plain DeepSpeed ZeRO-3 (eager), and,
    # recorded by the gather nodes over three training steps and a no-grad run: each layer is
    # gathered when ORT reaches it, in the forward and again in the backward, and released before
    # the next one, so that the whole parameters alive never exceed the largest layer's. With either
    # exporter: the dynamo case runs the default exporter and checks it was the dynamo one (the fetch
    # op reaches ONNX through the ATen fallback there, through a symbolic under TorchScript).
    ranks = deepspeed_runs[case]
    _assert_deepspeed_parity(ranks, 3)
    for r in ranks:
        ours = r["ortwrap"]
        assert ours["exporter"] == exporter
        n = ours["n_layers"]
        assert n == 5
        kinds: list[str] = []  # consecutive events of one kind, collapsed
        for kind, _ in ours["gathers"]:
            if not kinds or kinds[-1] != kind:
                kinds.append(kind)
        forward = [layer for kind, layer in ours["gathers"] if kind == "forward"]
        backward = [layer for kind, layer in ours["gathers"] if kind == "backward"]
        # The dropped run and 3 training steps (steps 1-3), then the no-grad run: each gathers every
        # layer in order. Each backward gathers what its gradient nodes read, in reverse: every
        # layer's weight but the first layer's (no input gradient there).
        assert kinds == ["forward", "backward"] * 3 + ["forward"], kinds
        assert forward == list(range(n)) * 5, forward
        assert backward == [4, 3, 2, 1] * 3, backward
        assert ours["live_layers_peak"] == 1, "two layers' parameters were whole at the same time"
        largest = 16 * 16 + 16  # fc2
        assert ours["live_numel_peak"] == largest < ours["model_numel"]
        assert ours["handed_alive_after"] == 0, "ORT kept gathered parameters after the step"


@pytest.mark.slow
@needs_deepspeed
def test_zero3_per_submodule_trains_a_gpt_like_plain_deepspeed(deepspeed_runs):
    # A small GPT (embedding gathers anchored on int64 ids, SDPA attention, LayerNorm, GELU MLP) with
    # zero3_gather="submodule": the losses of 4 steps equal plain DeepSpeed ZeRO-3's, with the default
    # (dynamo) exporter and with TorchScript, one layer's parameters whole at a time.
    for r in _ok(deepspeed_runs["zero3_submodule_gpt"]):
        for exporter in ("dynamo", "torchscript"):
            ours = r[exporter]
            assert ours["fallback"] is None and ours["exporter"] == exporter
            assert ours["live_layers_peak"] == 1, f"{exporter}: two layers' parameters were whole at the same time"
            torch.testing.assert_close(
                torch.tensor(ours["losses"]),
                torch.tensor(r["plain"]["losses"]),
                atol=ATOL,
                rtol=RTOL,
                msg=lambda m, exporter=exporter: f"{exporter} losses: {m}",
            )


@pytest.mark.slow
@needs_deepspeed
def test_function_calling_deepspeed_comm_trains_like_eager(deepspeed_runs):
    for r in _ok(deepspeed_runs["deepspeed_comm"]):
        assert r["export_count"] == 1


@pytest.mark.slow
@needs_deepspeed
def test_zero3_leaf_module_and_engine_inside_ortwrap_are_refused(deepspeed_runs):
    for r in _ok(deepspeed_runs["zero3_leaf"]):
        assert r["raised"] == UnsupportedInputError.__name__
        assert "ZeRO-3 leaf modules" in r["message"] and "norm" in r["message"]
        assert "deepspeed.initialize(model=ORTWrap(model)" in r["engine_inside"]


# ------------------------------------------------------------------------------------ engine="onnxruntime"


@ENGINE_SLOW
@needs_gloo
@needs_engine
def test_ddp_of_ortwrap_on_the_onnxruntime_engine_matches_eager_ddp(engine_torch_runs):
    # DDP's gradient hooks fire on the gradients AOTAutograd's backward hands to autograd: inside the
    # run, outputs and every gradient equal eager DDP's at each of 4 steps, all-reduced over the ranks.
    for r in _ok(engine_torch_runs["ddp"]):
        assert r["engine"] == "onnxruntime" and r["fallback"] is None
        assert r["export_count"] == 1  # (the engine's build count: one shape, one build)
        assert r["params_equal_across_ranks"]
        assert r["allreduced_grad_differs_from_local"] == [True] * 4


@ENGINE_SLOW
@needs_engine
@needs_deepspeed
@pytest.mark.parametrize("case,stage", [("zero1", 1), ("zero2", 2), ("zero3", 3)])
def test_deepspeed_zero_on_the_onnxruntime_engine_matches_plain_deepspeed(engine_deepspeed_runs, case, stage):
    # ZeRO-3 with the whole-module gather (zero3_gather="module"): the integration gathers the wrapped
    # module's parameters around the engine's call and partitions them after the backward, as for
    # the training engine; AOTAutograd's graph reads the parameters whole.
    _assert_deepspeed_parity(engine_deepspeed_runs[case], stage, engine="onnxruntime")


@ENGINE_SLOW
@needs_engine
@needs_deepspeed
def test_zero3_per_submodule_gather_is_refused_on_the_onnxruntime_engine(engine_deepspeed_runs):
    # zero3_gather="submodule" is a rewrite of the training engine's ORT gradient graph: refused, naming
    # the option and the engine that has it (plain DeepSpeed ran first, in the same case).
    for r in engine_deepspeed_runs["zero3_submodule"]:
        assert "plain" in r and len(r["plain"]["losses"]) == 4
        assert "UnsupportedInputError" in r["error"], r["error"][-2000:]
        assert "zero3_gather='submodule'" in r["error"] and "needs engine='training'" in r["error"]
