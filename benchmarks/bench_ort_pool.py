"""ORT's intra-op pool against one ORT thread, per graph (docs/performance.md, "ORT's pool per graph").

For each model: eager, ortwrap with its default (the build's choice: ``TrainingGraph.ort_threads``),
ortwrap with ORT's pool at torch's thread count (``intra_op_threads=N``) and with one ORT thread
(``intra_op_threads=1``), training steps with AdamW interleaved in one process (the order alternating
each round); median step and ratio to eager, the default's choice, and the graph's GEMM + convolution
time per node that the choice reads (``GemmChoice.ort_matrix_seconds``). Wall time: run it on an idle
machine.

    python benchmarks/bench_ort_pool.py                                  # zoo UNets, gpt2, bert; TinyGPTs
    python benchmarks/bench_ort_pool.py --models unet_resize --tiny ""   # one zoo model
    python benchmarks/bench_ort_pool.py --tiny 128x4x128x8 --models ""   # TinyGPT d x layers x T x batch
    python benchmarks/bench_ort_pool.py --probe                          # how long libgomp's worker spins
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")]
os.environ.setdefault("ORTWRAP_BUILD_CACHE", "0")  # every variant builds (and measures) its own graph

import torch  # noqa: E402


def _zoo(name: str, amp: bool):
    import bench_zoo

    case = bench_zoo._case(name)
    args, kwargs = case.make_inputs(4, torch.Generator().manual_seed(1))

    def make(path: str, options: dict | None):
        model = bench_zoo.build(case, path, options=options)
        return model, bench_zoo.make_step(case, model, args, kwargs, amp)

    return make


def _tiny(spec: str, amp: bool):
    from tiny_gpt import GPTConfig, TinyGPT, batch

    from ortwrap import ORTWrap

    d, layers, t, b = (int(v) for v in spec.split("x"))
    cfg = GPTConfig(layers=layers, d=d, max_len=t)
    x, y = batch(cfg, b, t, torch.Generator().manual_seed(0))

    def make(path: str, options: dict | None):
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        if path == "ortwrap":
            model = ORTWrap(model, **(options or {}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                out = model(x, y)
            (out if torch.is_tensor(out) else out[0]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return model, step

    return make


def run(label: str, make, iters: int, warmup: int) -> None:
    threads = torch.get_num_threads()
    variants = {
        "eager": ("eager", None),
        "default": ("ortwrap", None),
        f"pool({threads})": ("ortwrap", {"intra_op_threads": threads}),
        "one": ("ortwrap", {"intra_op_threads": 1}),
    }
    built = {k: make(path, options) for k, (path, options) in variants.items()}
    for _ in range(warmup):
        for _, step in built.values():
            step()
    times: dict[str, list[float]] = {k: [] for k in built}
    for i in range(iters):
        items = list(built.items())
        for k, (_, step) in items if i % 2 else items[::-1]:
            t = time.perf_counter()
            step()
            times[k].append(time.perf_counter() - t)
    eager = statistics.median(times["eager"])
    artifacts = built["default"][0].last_artifacts
    choice = artifacts.gemm_choice
    seconds = choice.ort_matrix_seconds() if choice is not None else None
    nodes = len(artifacts.graph.model().graph.node)
    per_node = "-" if seconds is None else f"{seconds / nodes * 1e6:.1f}"
    chosen = artifacts.graph.ort_threads or threads
    ratios = "  ".join(f"{k} {statistics.median(v) / eager:.2f}" for k, v in times.items() if k != "eager")
    print(
        f"{label:28s} thr={threads} eager {eager * 1e3:8.2f} ms  {ratios}  "
        f"(default: {chosen} ORT thread(s); {per_node} us of GEMMs+convs per node, {nodes} nodes)",
        flush=True,
    )


def probe() -> None:
    """How long PyTorch's OpenMP worker keeps spinning: a parallel op after idle gaps of growing length."""
    x = torch.randn(1 << 18)
    y = torch.empty_like(x)
    for _ in range(100):
        torch.mul(x, 1.01, out=y)
    for gap_us in (0, 100, 400, 1600, 3200, 6400, 12800, 25600):
        samples = []
        for _ in range(40):
            end = time.perf_counter() + gap_us * 1e-6
            while time.perf_counter() < end:
                pass
            t = time.perf_counter()
            torch.mul(x, 1.01, out=y)
            samples.append(time.perf_counter() - t)
        print(f"after {gap_us:6d} us idle: a 256K-element mul takes {statistics.median(samples) * 1e6:6.1f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="unet_resize,unet_convtranspose,gpt2,bert", help="zoo case names")
    p.add_argument("--tiny", default="128x2x64x4,128x4x128x4,128x4x128x8", help="TinyGPT d x layers x T x batch")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--probe", action="store_true", help="only the OpenMP spin probe")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.probe:
        probe()
        return
    for name in filter(None, a.models.split(",")):
        run(name + (" bf16" if a.bf16 else ""), _zoo(name, a.bf16), a.iters, a.warmup)
    for spec in filter(None, a.tiny.split(",")):
        run(f"TinyGPT {spec}" + (" bf16" if a.bf16 else ""), _tiny(spec, a.bf16), max(8, a.iters // 3), a.warmup)


if __name__ == "__main__":
    main()
