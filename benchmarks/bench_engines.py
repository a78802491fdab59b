"""Both engines side by side on the GPT-style LM of bench_lm.py (4 layers, d=256, T=128, batch 8,
SGD, cross-entropy inside the module): eager, ``torch.compile`` (inductor, the default mode;
``--no-compile`` leaves it out) and ORTWrap with each engine installed here
(``ortwrap.available_engines()``: the training build in .venv, the maintained onnxruntime in
.venv-ort; the ``"onnxruntime"`` engine also runs on the training build's InferenceSession).

Prints the first step of compile and of each engine (build + first run) and the median step times
from one interleaved run (``--cpu-time``: CPU seconds of the process, steadier on a shared machine
at 1 thread).

    OMP_NUM_THREADS=1 python benchmarks/bench_engines.py --threads 1 --cpu-time

``--bf16`` adds eager and each engine under ``torch.autocast("cpu", dtype=torch.bfloat16)``.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from _harness import interleaved, report, train_step
from tiny_gpt import GPTConfig, TinyGPT, batch

import ortwrap
from ortwrap import ORTWrap
from ortwrap.engines import onnxruntime_distribution


def main(
    iters: int = 20, cpu_time: bool = False, compile: bool = True, threads: int | None = None, bf16: bool = False
) -> None:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = GPTConfig(layers=4, d=256, heads=4, max_len=128)
    eager = TinyGPT(cfg)
    ids, tgt = batch(cfg, 8, 128, torch.Generator().manual_seed(0))
    print(f"torch {torch.__version__}, {onnxruntime_distribution()}, {torch.get_num_threads()} threads")
    steps = {"eager": train_step(eager, torch.optim.SGD(eager.parameters(), lr=0.01), lambda m: m(ids, tgt)[0])}

    def amp_loss(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(ids, tgt)[0]

    if bf16:
        model = copy.deepcopy(eager)
        steps["eager bf16"] = train_step(model, torch.optim.SGD(model.parameters(), lr=0.01), amp_loss)
    if compile:
        model = copy.deepcopy(eager)
        compiled = torch.compile(model)
        step = train_step(compiled, torch.optim.SGD(model.parameters(), lr=0.01), lambda m: m(ids, tgt)[0])
        t0 = time.perf_counter()
        step()
        print(f"  torch.compile: first step (compile + run) {time.perf_counter() - t0:.2f} s")
        steps["torch.compile"] = step
    for engine in ortwrap.available_engines():
        ours = ORTWrap(copy.deepcopy(eager), fallback=False, engine=engine)
        opt = torch.optim.SGD(ours.parameters(), lr=0.01)
        step = train_step(ours, opt, lambda m: m(ids, tgt)[0])
        t0 = time.perf_counter()
        step()
        print(f"  engine={engine}: first step (build + run) {time.perf_counter() - t0:.2f} s")
        steps[f"ortwrap engine={engine}"] = step
        if bf16:
            ours = ORTWrap(copy.deepcopy(eager), fallback=False, engine=engine)
            step = train_step(ours, torch.optim.SGD(ours.parameters(), lr=0.01), amp_loss)
            t0 = time.perf_counter()
            step()
            print(f"  engine={engine} bf16: first step (build + run) {time.perf_counter() - t0:.2f} s")
            steps[f"ortwrap engine={engine} bf16"] = step
    clock = time.process_time if cpu_time else time.perf_counter
    report("GPT LM 4x256, T=128, batch 8, SGD", interleaved(steps, warmup=3, iters=iters, clock=clock))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--cpu-time", action="store_true", help="CPU seconds of the process instead of wall time")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (and the engines' ORT threads)"
    )
    parser.add_argument("--bf16", action="store_true", help="also eager and each engine under bf16 autocast")
    a = parser.parse_args()
    main(a.iters, a.cpu_time, not a.no_compile, a.threads, a.bf16)
