"""(f) Aggressive CPU fallback (``aggressive_cpu_fallback=True``): nodes moved and step time, on CPU.

For the GPT-style LM and a llama-style block (RMSNorm, rotary embeddings, causal attention, SwiGLU),
prints how many shape-related nodes the split moved off the training graph (into the host shape
program, or replaced by python feeds from ``tensor.shape``), how many it kept and why, the cost of
the host program per step (a cache hit, and a run of its InferenceSession on a new shape), and
the eager / ortwrap (flag off) / ortwrap (flag on) median step times from one interleaved run.

On a CPU-only machine the flag cannot save a device round trip (there is none): the step times
show what the pass costs, which should be nothing measurable. The GPU numbers the issue asks for
(Memcpy nodes in the ORT-optimized graph, step time on and off) need a CUDA machine.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import Counter

import torch
from _harness import interleaved, median_ms, report, train_step
from tiny_gpt import GPTConfig, TinyGPT, batch
from tiny_llama import LlamaBlock, LlamaConfig

from ortwrap import ORTWrap


def _placements(model: ORTWrap) -> str:
    split = model.last_artifacts.host_shapes
    moved = Counter(p.op_type for p in split.moved.values())
    counts = Counter(p.placement for p in split.placements.values())
    kept_why = Counter(
        "Shape of an activation (or downstream of one)"
        if "intermediate" in p.why or "stays in the main" in p.why
        else p.why
        for p in split.kept.values()
    )
    return (
        f"  shape-related nodes: {len(split.placements)}; moved {len(split.moved)} "
        f"({counts['host']} into the shape program, {counts['python']} Shape/Size as python feeds: "
        f"{', '.join(f'{k} {v}' for k, v in sorted(moved.items()))}); constant-only {counts['constant']}; "
        f"kept {len(split.kept)} ({'; '.join(f'{v}: {k}' for k, v in kept_why.items()) or '-'}); "
        f"{len(split.feeds)} new graph inputs"
    )


def _host_cost(model: ORTWrap, leaves: list[torch.Tensor], iters: int = 2000) -> str:
    runner = model.programs()[0].host_shapes_runner
    hits = []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner(leaves)
        hits.append(time.perf_counter() - t0)
    misses = []
    for _ in range(200):
        t0 = time.perf_counter()
        runner._compute(leaves, {})
        misses.append(time.perf_counter() - t0)
    return (
        f"  host program per step: cache hit {statistics.median(hits) * 1e6:.1f} us, "
        f"new shape (session run) {statistics.median(misses) * 1e6:.1f} us"
    )


def _bench(title: str, eager, make_loss, leaves, iters: int) -> None:
    off = ORTWrap(copy.deepcopy(eager), fallback=False)
    on = ORTWrap(copy.deepcopy(eager), fallback=False, aggressive_cpu_fallback=True)
    steps = {}
    for name, model in (("eager", eager), ("ortwrap flag off", off), ("ortwrap flag on", on)):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        steps[name] = train_step(model, opt, make_loss)
        steps[name]()  # build
    print(f"\n== {title}: what moved")
    print(_placements(on))
    print(_host_cost(on, leaves))
    times = interleaved(steps, warmup=3, iters=iters)
    report(title, times)
    print(
        f"  ratio flag on / flag off = {median_ms(times['ortwrap flag on']) / median_ms(times['ortwrap flag off']):.2f}x"
    )


def main(iters: int = 20) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(layers=4, d=256, heads=4, max_len=128)
    ids, tgt = batch(cfg, 8, 128, torch.Generator().manual_seed(0))
    _bench("(f) GPT LM 4x256, T=128, batch 8", TinyGPT(cfg), lambda m: m(ids, tgt)[0], [ids, tgt], iters)

    torch.manual_seed(0)
    lcfg = LlamaConfig(d=256, heads=4, hidden=688, max_len=128)
    x = torch.randn(8, 128, lcfg.d)
    w = torch.randn(8, 128, lcfg.d)
    _bench("(f) llama-style block d=256, T=128, batch 8", LlamaBlock(lcfg), lambda m: (m(x) * w).mean(), [x], iters)

    # What a dynamo capture moves (dims arrive as Shape(x) slices): counts only.
    try:
        dyn = ORTWrap(LlamaBlock(lcfg), fallback=False, aggressive_cpu_fallback=True, exporter="dynamo")
        (dyn(x) * w).mean().backward()
    except Exception as e:  # the dynamo exporter is optional
        print(f"\n== (f) llama-style block, exporter='dynamo': not measured ({type(e).__name__}: {e})")
    else:
        print("\n== (f) llama-style block, exporter='dynamo': what moved")
        print(_placements(dyn))


if __name__ == "__main__":
    main()
