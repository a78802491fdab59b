"""The CPU region allocator (runtime/cpu_region.py, _compat/_cpu_region.cpp): while ORT runs a CPU
graph, PyTorch's and ORT's blocks of 1 MiB or more come from one best-fit region; outside the runs
PyTorch's own allocator and the C library serve them again; every block is freed through its own
deleter wherever it dies.

Each test trains a model whose ORT runs allocate PyTorch blocks of several MiB (``gemm="torch"``:
PyTorch's GEMMs run inside the graph, so their outputs and the weight gradients are PyTorch's) and
compares every output and gradient with eager, and with the region turned off (same bits)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from parity import assert_close
from torch import nn

from ortwrap import ORTWrap
from ortwrap.options import Options
from ortwrap.runtime import cpu_region

if cpu_region.library() is None:  # pragma: no cover - a machine without a C++ compiler
    pytest.skip("the region allocator cannot be built here (no C++ compiler)", allow_module_level=True)

BIG = 3 << 20  # bytes: a block the region serves


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # 256 x 1024 fp32 activations are 1 MiB; the 1024 x 1024 weights' gradients 4 MiB
    return nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(384, 512, generator=g), torch.randn(384, 8, generator=g)


def _train(
    module: nn.Module, steps: int = 3, first_step_lock: threading.Lock | None = None
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """AdamW steps; the losses and each step's gradients. ``first_step_lock``: held for the first
    step (the build: exporting is not thread-safe in torch)."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    losses, grads = [], []
    for step in range(steps):
        x, y = _batch(step)
        if step == 0 and first_step_lock is not None:
            with first_step_lock:
                loss = nn.functional.mse_loss(module(x), y)
                loss.backward()
        else:
            loss = nn.functional.mse_loss(module(x), y)
            loss.backward()
        losses.append(loss.detach())
        inner = module.module if isinstance(module, ORTWrap) else module
        grads.append({n: p.grad.clone() for n, p in inner.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _served() -> int:
    return cpu_region.stats()["blocks"]


@pytest.mark.parametrize("native_kernels", [True, False])
def test_runs_take_large_blocks_from_the_region_with_eager_results(native_kernels):
    """With the region (the default), the ORT runs' large blocks come from it: PyTorch's, and ORT's
    or ortwrap's kernels' (GELU's, Tanh's outputs and gradients); losses and every gradient match
    eager, and match a wrapper without the region bit for bit."""
    eager = _model()
    on = ORTWrap(copy.deepcopy(eager), fallback=False, gemm="torch", native_kernels=native_kernels)
    off = ORTWrap(copy.deepcopy(eager), fallback=False, gemm="torch", native_kernels=native_kernels, cpu_region=False)
    ref_losses, ref_grads = _train(eager)

    before = _served()
    off_losses, off_grads = _train(off)
    assert _served() == before, "cpu_region=False must not touch the region"

    ort_before = cpu_region.stats()["hooked_blocks"]
    on_losses, on_grads = _train(on)
    served = _served() - before
    # each step: the forward's two 1.5 MiB GEMM outputs, the backward's weight gradients (2 and 4 MiB)
    # and input gradients; at least 4 blocks a step whatever ORT fuses
    assert served >= 4 * 3, served
    # ORT's float32 graphs allocate from ORT's arena, which extends itself (from the region) in the
    # first step; the kernels' outputs (GELU's) come from the region every step
    hooked = cpu_region.stats()["hooked_blocks"] - ort_before
    assert hooked >= (3 if native_kernels else 1), hooked

    for step in range(3):
        assert_close(on_losses[step], ref_losses[step], f"loss {step}")
        assert torch.equal(on_losses[step], off_losses[step])
        for name, ref in ref_grads[step].items():
            assert_close(on_grads[step][name], ref, f"grad {name} step {step}")
            assert torch.equal(on_grads[step][name], off_grads[step][name]), name


@pytest.mark.parametrize("native_kernels", [False, True])
def test_bf16_native_route_takes_ort_blocks_every_step(native_kernels):
    """On the native bf16 route (PyTorch's bf16 GEMMs inside the graph) ORT allocates each tensor from
    its plain allocator (no arena), so its large blocks (GELU's float32 activations and gradients,
    Tanh's), or the kernels' outputs, come from the region in every step, between PyTorch's; the
    results are those without the region, bit for bit."""
    eager = _model(6)
    options = dict(fallback=False, half_compute="native", native_kernels=native_kernels)
    on = ORTWrap(copy.deepcopy(eager), **options)
    off = ORTWrap(copy.deepcopy(eager), cpu_region=False, **options)
    results = []
    for w in (off, on):
        opt = torch.optim.AdamW(w.parameters(), lr=1e-3)
        steps = []
        for step in range(3):
            x, y = _batch(step)
            before = cpu_region.stats()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = w(x)
            loss = nn.functional.mse_loss(out.float(), y)
            loss.backward()
            after = cpu_region.stats()
            served = (after["blocks"] - before["blocks"], after["hooked_blocks"] - before["hooked_blocks"])
            if w is on:
                assert served[0] >= 4 and served[1] >= (1 if native_kernels else 4), (step, served)
            else:
                assert served == (0, 0)
            steps.append((loss.detach(), [p.grad.clone() for p in w.parameters()]))
            opt.step()
            opt.zero_grad(set_to_none=True)
        results.append(steps)
    for (loss_off, grads_off), (loss_on, grads_on) in zip(*results):
        assert torch.equal(loss_on, loss_off)
        for a, b in zip(grads_on, grads_off):
            assert torch.equal(a, b)


def test_graphs_where_pytorch_computes_nothing_keep_glibc():
    """A graph of ORT's and the kernels' ops alone (``gemm="ort"``) runs without the region (there it
    would cost: runtime/session.py's ``_region``); its large blocks are the C library's."""
    w = ORTWrap(_model(7), fallback=False, gemm="ort")
    before = cpu_region.stats()
    _train(w, steps=2)
    after = cpu_region.stats()
    assert (after["blocks"], after["hooked_blocks"]) == (before["blocks"], before["hooked_blocks"])


def test_outside_the_runs_pytorch_allocates_as_before_and_blocks_come_back():
    """Between runs (the optimizer step, the user's own code) nothing is served by the region; the
    blocks the runs took are given back when their tensors die, wherever that happens."""
    w = ORTWrap(_model(), fallback=False, gemm="torch")
    _train(w, steps=1)
    base = cpu_region.stats()

    before = _served()
    scratch = [torch.empty(BIG // 4), torch.randn(1024, 1024), torch.zeros(2048, 512) + 1]
    eager_out = _model(1)(_batch(0)[0])
    assert _served() == before
    del scratch, eager_out

    x, y = _batch(1)
    loss = nn.functional.mse_loss(w(x), y)
    loss.backward()
    assert _served() > before
    assert cpu_region.stats()["in_use"] > base["in_use"]  # the gradients live in the region
    w.zero_grad(set_to_none=True)
    del loss
    assert cpu_region.stats()["in_use"] == base["in_use"]


def test_a_failing_run_restores_pytorch_allocator():
    """An exception raised inside ORT's run (a Function's forward) reaches the user as itself; the
    allocator is restored, and the wrapper trains on with the region afterwards."""

    class Checked(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            if bool((x > 1e6).any()):
                raise ValueError("Checked: input out of range")
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _model()

        def forward(self, x):
            return self.body(Checked.apply(x))

    eager = Net()
    w = ORTWrap(copy.deepcopy(eager), fallback=False, gemm="torch")
    _train(w, steps=1)
    bad = torch.full((384, 512), 1e7)
    with pytest.raises(ValueError, match="out of range"):
        w(bad)
    before = _served()
    torch.empty(BIG // 4).fill_(1)
    assert _served() == before, "the region stayed installed after a failed run"

    w2 = ORTWrap(copy.deepcopy(eager), fallback=False, gemm="torch")
    ref_losses, ref_grads = _train(eager, steps=2)
    with pytest.raises(ValueError, match="out of range"):
        w2(bad)
    got_losses, got_grads = _train(w2, steps=2)
    assert _served() > before
    for step in range(2):
        assert_close(got_losses[step], ref_losses[step], f"loss {step}")
        for name, ref in ref_grads[step].items():
            assert_close(got_grads[step][name], ref, f"grad {name}")


def test_nested_and_concurrent_brackets():
    """Brackets nest (the region stays installed until the outermost exit) and two threads training
    their own wrappers at once get the results each gets alone (each thread's blocks come and go
    through the one region while the other's runs hold it installed)."""
    enter, leave = cpu_region.bracket()
    before = _served()
    assert enter() == 1 and enter() == 1
    a = torch.empty(BIG // 4)
    assert a.data_ptr() % (64 << 10) == 0  # blocks are 64 KiB granules (posix_memalign may ask for that)
    leave()
    b = torch.empty(BIG // 4)
    assert _served() == before + 2
    leave()
    c = torch.empty(BIG // 4)
    assert _served() == before + 2
    del a, b, c

    eager = [_model(s) for s in (2, 3)]
    alone = [_train(ORTWrap(copy.deepcopy(m), fallback=False, gemm="torch")) for m in eager]
    results: list = [None, None]
    errors: list = []
    build = threading.Lock()

    def run(i: int) -> None:
        try:
            results[i] = _train(ORTWrap(copy.deepcopy(eager[i]), fallback=False, gemm="torch"), first_step_lock=build)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in (0, 1):  # (close, not equal: two threads' GEMMs may split their work differently)
        for step in range(3):
            assert_close(results[i][0][step], alone[i][0][step], f"thread {i} loss {step}")
            for name, g in alone[i][1][step].items():
                assert_close(results[i][1][step][name], g, f"thread {i} grad {name} step {step}")
    before = _served()
    torch.empty(BIG // 4).fill_(0)
    assert _served() == before, "the region stayed installed after both threads finished"


def test_release_returns_free_pages_and_training_goes_on():
    """``release()`` gives the region's free pages back; the next steps fault them in again with the
    same results."""
    eager = _model(4)
    w = ORTWrap(copy.deepcopy(eager), fallback=False, gemm="torch")
    ref = copy.deepcopy(eager)
    ref_losses = _train(ref, steps=2)[0] + _train(ref, steps=2)[0]  # as below: a new AdamW, the same batches
    losses, _ = _train(w, steps=2)
    assert cpu_region.stats()["free"] > 0
    assert cpu_region.release() > 0
    more, _ = _train(w, steps=2)
    for step, loss in enumerate(losses + more):
        assert_close(loss, ref_losses[step], f"loss {step}")


def test_option_and_environment(monkeypatch):
    assert Options.resolve().cpu_region is True
    monkeypatch.setenv("ORTWRAP_CPU_REGION", "0")
    assert Options.resolve().cpu_region is False
    assert Options.resolve(cpu_region=True).cpu_region is True


def test_without_a_cxx_compiler_it_warns_once_and_trains(monkeypatch, tmp_path):
    """No C++ compiler: one warning that names the option to silence it, and the model trains with
    PyTorch's allocator and eager's results."""
    from ortwrap.bridge import _native

    monkeypatch.setenv("ORTWRAP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_region.library.cache_clear()
    _native.load_torch_cxx.cache_clear()
    try:
        eager = _model(5)
        with pytest.warns(UserWarning, match="cpu_region=False"):
            w = ORTWrap(copy.deepcopy(eager), fallback=False, gemm="torch")
            got, _ = _train(w, steps=1)
        assert cpu_region.stats()["blocks"] == 0
        ref, _ = _train(eager, steps=1)
        assert_close(got[0], ref[0], "loss")
    finally:
        cpu_region.library.cache_clear()
        _native.load_torch_cxx.cache_clear()
