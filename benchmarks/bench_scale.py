"""A GPT-2-small-sized LM at training scale: eager, torch.compile and ortwrap, against the GEMM limit.

    python benchmarks/bench_scale.py                 # --size gpt2: 12 layers, d=768, 12 heads, vocab 8192,
                                                     #   seq 256, batch 4 (98M parameters), AdamW
    python benchmarks/bench_scale.py --size small    # 4 layers, d=256: a quick run of the same script
    python benchmarks/bench_scale.py --no-compile --iters 5
    python benchmarks/bench_scale.py --batch 16      # a larger batch: activations dominate memory
    python benchmarks/bench_scale.py --no-recompute  # skip the ortwrap recompute="layers" variant
    python benchmarks/bench_scale.py --threads 1 --cpu-time --only "ortwrap,ortwrap torch-gemm" --no-compile
    python benchmarks/bench_scale.py --fused-adamw   # torch.optim.AdamW(fused=True) on every variant

Prints, from one interleaved run (each step: forward, loss.backward, AdamW step, zero_grad):

- the median step of eager, torch.compile (default mode), ortwrap (its default,
  ``recompute="cheap"``, ``gemm="auto"``: the route it measured and chose is printed, with the rates),
  ortwrap with ``gemm="ort"`` (MLAS) and with ``gemm="torch"`` (PyTorch's float32 GEMMs and flash
  attention inside the graph), with ``recompute="none"`` and with ``recompute="layers"``
  (activation recompute), and the ratios to eager;
- the GEMM limit: the time 6 * N * tokens FLOPs take at the best float32 GEMM rate this machine
  reaches on the model's own matmul shapes (each shape of the forward and both backward GEMMs,
  through torch and through ONNX Runtime's MatMul, measured in the same run), and each variant's
  fraction of it (limit / step);
- the first ortwrap step (build + run) and ortwrap's stage times;
- the peak RSS (VmHWM) of each variant over three steps, each in its own fresh process with a
  cold build (no build cache; ``--no-rss`` skips), and the ratio to eager's.

Run on an otherwise idle machine, and name the CPU (printed from /proc/cpuinfo) with the numbers.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable

import _harness  # noqa: F401  (puts examples/ on sys.path)
import numpy as np
import torch
from _harness import interleaved, median_ms, peak_rss_child, report

SIZES = {
    "gpt2": dict(vocab=8192, d=768, heads=12, layers=12, seq=256, batch=4),
    "small": dict(vocab=8192, d=256, heads=4, layers=4, seq=128, batch=4),
}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    feats = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{name} ({os.cpu_count()} cores; {' '.join(feats) or 'no AVX2'})"


#: ORTWrap options of the ortwrap variants.
ORTWRAP_VARIANTS = {
    "ortwrap": {},  # the default (recompute="cheap", gemm="auto": measured, gemm_choice.py)
    "ortwrap ort-gemm": {"gemm": "ort"},  # float32 GEMMs as ONNX Runtime's (MLAS)
    "ortwrap torch-gemm": {"gemm": "torch"},  # float32 GEMMs and attention as PyTorch's (MKL/oneDNN)
    "ortwrap none": {"recompute": "none"},
    "ortwrap recompute": {"recompute": "layers"},
}


def make(size: str, batch_size: int | None = None):
    from tiny_gpt import GPTConfig, TinyGPT, batch

    s = dict(SIZES[size], **({"batch": batch_size} if batch_size else {}))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=s["vocab"], d=s["d"], heads=s["heads"], layers=s["layers"], max_len=s["seq"])
    model = TinyGPT(cfg)
    ids, tgt = batch(cfg, s["batch"], s["seq"], torch.Generator().manual_seed(0))
    return model, ids, tgt


#: torch.optim.AdamW's keyword arguments for every variant (``--fused-adamw``: ``fused=True``, PyTorch's
#: one-kernel CPU AdamW, ~3x faster than its default one-tensor-at-a-time loop; the same on every side)
OPTIM: dict = {}


def step_fn(model, ids, tgt):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **OPTIM)

    def step() -> None:
        loss, _ = model(ids, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def matmul_shapes(size: str, batch_size: int | None = None) -> list[tuple[int, int, int]]:
    """(M, K, N) of every parameter GEMM of one training step: forward, input grad, weight grad."""
    s = dict(SIZES[size], **({"batch": batch_size} if batch_size else {}))
    rows = s["batch"] * s["seq"]
    d = s["d"]
    linears = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * s["layers"] + [(d, s["vocab"])]
    shapes = []
    for k, n in linears:
        shapes += [(rows, k, n), (rows, n, k), (k, rows, n)]
    return shapes


def _best_rate(
    shapes: list[tuple[int, int, int]], reps: int = 3, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """FLOP/s of the whole list of GEMMs (one after the other, as a step runs them), best of
    ``reps``, through torch and through ONNX Runtime, timed with ``clock`` (the steps' clock)."""
    from ortwrap._ort import ort

    flops = sum(2 * m * k * n for m, k, n in shapes)
    unique = sorted(set(shapes))
    mats = {s: (torch.randn(s[0], s[1]), torch.randn(s[1], s[2])) for s in unique}
    best_torch = float("inf")
    for _ in range(reps):
        t0 = clock()
        for s in shapes:
            a, b = mats[s]
            torch.mm(a, b)
        best_torch = min(best_torch, clock() - t0)
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        "mm",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", "k"]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["k", "n"]),
        ],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["m", "n"])],
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString(), so
    )
    np_mats = {s: (a.numpy(), b.numpy()) for s, (a, b) in mats.items()}
    best_ort = float("inf")
    for _ in range(reps):
        t0 = clock()
        for s in shapes:
            a, b = np_mats[s]
            sess.run(None, {"a": a, "b": b})
        best_ort = min(best_ort, clock() - t0)
    return flops / best_torch, flops / best_ort


def _rss_child(size: str, variant: str, steps: int, batch_size: int | None = None) -> dict:
    code = f"""
import json, sys, time
sys.path.insert(0, {os.path.join(os.path.dirname(__file__))!r})
import bench_scale as b
import torch
b.OPTIM.update({OPTIM!r})
torch.set_num_threads({torch.get_num_threads()})
model, ids, tgt = b.make({size!r}, {batch_size!r})
if {variant!r} == "compile":
    model = torch.compile(model)
elif {variant!r} in b.ORTWRAP_VARIANTS:
    from ortwrap import ORTWrap
    # A cold build (no build cache): a cache hit skips the export and never loads its modules.
    model = ORTWrap(model, fallback=False, build_cache=False, **b.ORTWRAP_VARIANTS[{variant!r}])
step = b.step_fn(model, ids, tgt)
for _ in range({steps}):
    step()
"""
    return {"variant": variant, **peak_rss_child(code)}


def main(
    size: str = "gpt2",
    iters: int = 6,
    compile_: bool = True,
    rss: bool = True,
    batch_size: int | None = None,
    recompute: bool = True,
    cpu_time: bool = False,
    only: list[str] | None = None,
) -> None:
    from ortwrap import ORTWrap

    s = dict(SIZES[size], **({"batch": batch_size} if batch_size else {}))
    print(
        f"\n== scale: {size} {s}, AdamW{'(fused=True)' if OPTIM.get('fused') else ''}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"   CPU: {cpu_name()}; {'CPU seconds of this process' if cpu_time else 'wall time'}")
    eager, ids, tgt = make(size, batch_size)
    n_params = sum(p.numel() for p in eager.parameters())
    tokens = s["batch"] * s["seq"]
    steps = {"eager": step_fn(eager, ids, tgt)}
    if compile_:
        compiled = torch.compile(copy.deepcopy(eager))
        t0 = time.perf_counter()
        steps["torch.compile"] = step_fn(compiled, ids, tgt)
        steps["torch.compile"]()
        print(f"   torch.compile first step {time.perf_counter() - t0:.1f} s")
    variants = {k: v for k, v in ORTWRAP_VARIANTS.items() if recompute or v.get("recompute") != "layers"}
    variants = {k: v for k, v in variants.items() if not only or k in only}
    for name, options in variants.items():
        ours = ORTWrap(copy.deepcopy(eager), fallback=False, **options)
        steps[name] = step_fn(ours, ids, tgt)
        t0 = time.perf_counter()
        steps[name]()
        first = time.perf_counter() - t0
        stages = ", ".join(f"{k} {v:.2f}" for k, v in ours.last_artifacts.seconds.items())
        print(f"   {name} first step {first:.2f} s ({stages}; exporter {ours.last_artifacts.exporter})")
        if ours.last_artifacts.gemm_choice is not None:
            print(f"   {name}: {ours.last_artifacts.gemm_choice.summary()}")
        elif ours.last_artifacts.cached:
            print(f"   {name}: loaded from the build cache (GEMM route as measured when it was built)")
        if ours.last_artifacts.recompute is not None:
            print(f"   {name}: {ours.last_artifacts.recompute.summary()}")
    clock = time.process_time if cpu_time else time.perf_counter
    times = interleaved(steps, warmup=1, iters=iters, clock=clock)
    rate_torch, rate_ort = _best_rate(matmul_shapes(size, batch_size), clock=clock)
    rate = max(rate_torch, rate_ort)
    limit = 6 * n_params * tokens / rate
    report(f"scale {size}: {n_params / 1e6:.1f}M parameters, {tokens} tokens/step", times)
    print(
        f"  GEMM rate on the model's shapes: torch {rate_torch / 1e9:.1f} GFLOP/s, ORT {rate_ort / 1e9:.1f} GFLOP/s; "
        f"GEMM limit (6*N*tokens at the best) {limit * 1e3:.0f} ms"
    )
    for name, ts in times.items():
        print(f"  {name:<16} {median_ms(ts):9.0f} ms = {limit * 1e3 / median_ms(ts) * 100:5.1f}% of the GEMM limit")
    if rss:
        rss_report(size, batch_size, compile_, recompute, only)
    np.set_printoptions()  # (numpy imported for ORT's inputs)


def rss_report(
    size: str, batch_size: int | None, compile_: bool, recompute: bool, only: list[str] | None = None
) -> dict[str, dict]:
    """Peak RSS of each variant, each in its own fresh process (3 steps); printed and returned."""
    s = dict(SIZES[size], **({"batch": batch_size} if batch_size else {}))
    print(f"\n== peak RSS (VmHWM), each variant in its own process (3 steps): {size} {s}")
    variants = [k for k, v in ORTWRAP_VARIANTS.items() if recompute or v.get("recompute") != "layers"]
    variants = [k for k in variants if not only or k in only]
    names = ["eager", *variants] + (["compile"] if compile_ else [])
    results = {r["variant"]: r for r in (_rss_child(size, v, 3, batch_size) for v in names)}
    base = results["eager"].get("peak_rss_mib")
    for v, r in results.items():
        if "error" in r:
            print(f"  {v:<18} failed: {r['error'][-300:]}")
        else:
            ratio = f"  ({r['peak_rss_mib'] / base:.2f}x eager)" if base else ""
            print(f"  {v:<18} {r['peak_rss_mib']:8.0f} MiB{ratio}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpt2")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--no-recompute", action="store_true", help="skip the recompute='layers' variant")
    parser.add_argument("--batch", type=int, default=None, help="batch size instead of the size's own")
    parser.add_argument(
        "--rss-only", action="store_true", help="only the peak RSS of each variant (no timing, no GEMM limit)"
    )
    parser.add_argument(
        "--cpu-time", action="store_true", help="time CPU seconds, not wall time (steadier on a shared machine)"
    )
    parser.add_argument(
        "--fused-adamw", action="store_true", help="torch.optim.AdamW(fused=True) for every variant (eager too)"
    )
    parser.add_argument("--only", default="", help="comma-separated ortwrap variants to run (default: all)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (and ORT's); 0: torch's default")
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    only = [v.strip() for v in a.only.split(",") if v.strip()] or None
    if a.fused_adamw:
        OPTIM["fused"] = True
    if a.rss_only:
        rss_report(a.size, a.batch, not a.no_compile, not a.no_recompute, only)
    else:
        main(a.size, a.iters, not a.no_compile, not a.no_rss, a.batch, not a.no_recompute, a.cpu_time, only)
