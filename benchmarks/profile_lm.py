"""Where the time of a (b) GPT LM training step goes: ORT kernels by op type next to eager's ATen ops.

    python benchmarks/profile_lm.py [steps] [rows] [--size lm|small|gpt2] [--gemm torch] [--bf16 [--half-compute float32]]

ORT's profiler (enabled for this script's session only) gives each kernel's time; torch.profiler
gives eager's self CPU time per ATen op. Both are per step, over ``steps`` steady-state steps after
warm-up. The two columns are not an op-for-op match (ORT fuses and splits differently), but the
totals and the big rows (GEMMs, GELU, LayerNorm, embedding, attention) compare directly. Run on an
idle machine: other processes on the 2 cores inflate both sides unevenly. ``--bf16`` runs both
under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (ortwrap's route: ``--half-compute``).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import tempfile

import _harness  # noqa: F401  (puts examples/ on sys.path)
import torch
from tiny_gpt import GPTConfig, TinyGPT, batch

import ortwrap.runtime.session as ort_session
from ortwrap import ORTWrap


def _autocast(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _ort_profile(
    model, ids, tgt, steps: int, bf16: bool = False, half_compute: str = "auto", gemm: str = "ort"
) -> dict[str, float]:
    prefix = os.path.join(tempfile.mkdtemp(), "ortwrap_profile")
    plain = ort_session.session_options

    def profiled(options):
        so = plain(options)
        so.enable_profiling = True
        so.profile_file_prefix = prefix
        return so

    ort_session.session_options = profiled
    try:
        wrapped = ORTWrap(copy.deepcopy(model), fallback=False, half_compute=half_compute, gemm=gemm)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
        warmup = 3
        for _ in range(warmup + steps):
            with _autocast(bf16):
                loss, _ = wrapped(ids, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        ort_session.session_options = plain
    runner = wrapped.programs()[0].runner
    # ATen nodes are listed by their operator (ortwrap's CPU kernels: ortwrap_cpu::gelu, ...).
    operators = {
        n.name: a.s.decode() for n in runner.graph.model().graph.node for a in n.attribute if a.name == "operator"
    }
    with open(runner._session.end_profiling()) as f:
        events = [e for e in json.load(f) if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    # Each step runs every kernel once in the same order: skip the warm-up steps' events.
    per_step = len(events) // (warmup + steps)
    by_op: dict[str, float] = collections.defaultdict(float)
    for e in events[warmup * per_step :]:
        op = e["args"]["op_name"]
        if op == "ATen":
            op = operators.get(e["name"].removesuffix("_kernel_time"), op)
        by_op[op] += e["dur"] / 1e3 / steps
    return dict(by_op)


def _eager_profile(model, ids, tgt, steps: int, bf16: bool = False) -> dict[str, float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        with _autocast(bf16):
            loss, _ = model(ids, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    with torch.profiler.profile() as prof:
        for _ in range(steps):
            step()
    return {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages() if e.key.startswith("aten::")}


def main(
    steps: int = 10, rows: int = 16, size: str = "lm", bf16: bool = False, half_compute: str = "auto", gemm: str = "ort"
) -> None:
    if size == "lm":
        torch.manual_seed(0)
        cfg = GPTConfig(layers=4, d=256, heads=4, max_len=128)
        model = TinyGPT(cfg)
        ids, tgt = batch(cfg, 8, 128, torch.Generator().manual_seed(0))
    else:  # the scale benchmark's models (bench_scale.py --size)
        import bench_scale

        model, ids, tgt = bench_scale.make(size)
    ours = sorted(_ort_profile(model, ids, tgt, steps, bf16, half_compute, gemm).items(), key=lambda kv: -kv[1])
    eager = sorted(_eager_profile(copy.deepcopy(model), ids, tgt, steps, bf16).items(), key=lambda kv: -kv[1])
    what = f", bf16 autocast (half_compute={half_compute})" if bf16 else f", gemm={gemm}"
    print(
        f"\n== GPT LM {size}{what}, ms per step over {steps} steps: ORT kernels by op type | eager ATen ops (self CPU)"
    )
    print(f"  {'total':<28} {sum(v for _, v in ours):8.2f}   | {'total':<36} {sum(v for _, v in eager):8.2f}")
    for i in range(rows):
        left = f"{ours[i][0]:<28} {ours[i][1]:8.2f}" if i < len(ours) else " " * 37
        right = f"{eager[i][0]:<36} {eager[i][1]:8.2f}" if i < len(eager) else ""
        print(f"  {left}   | {right}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("steps", nargs="?", type=int, default=10)
    parser.add_argument("rows", nargs="?", type=int, default=16)
    parser.add_argument(
        "--size", choices=["lm", "small", "gpt2"], default="lm", help="lm: (b); small/gpt2: bench_scale's"
    )
    parser.add_argument("--bf16", action="store_true", help="both under torch.autocast(cpu, bfloat16)")
    parser.add_argument("--half-compute", default="auto", help="ortwrap's half_compute option (with --bf16)")
    parser.add_argument("--gemm", default="ort", help="ortwrap's gemm option (float32 GEMMs: ort, torch, auto)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (and ORT's); 0: torch's default")
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    main(a.steps, a.rows, a.size, a.bf16, a.half_compute, a.gemm)
