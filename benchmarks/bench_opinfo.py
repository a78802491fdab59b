"""Per-op build and step time of PyTorch's OpInfo samples through ortwrap, against eager (issue 24 §4).

The cases are ``tests/opinfo_sweep.py``'s (same ops, same samples, same module per sample: its
functions are imported, not copied). For each case that builds, one JSON line:

- ``build_s``: the first ortwrap forward+backward (export, passes, gradient build, session, the run)
  minus the median later step; ``stages_s``: the sum of ``last_artifacts.stage_seconds``;
- ``eager_ms`` / ``ortwrap_ms``: median forward+backward step over ``--iters`` interleaved rounds
  (after ``--warmup``), wall clock, and ``ratio`` = ortwrap / eager;
- ``nodes``: the pre-gradient graph's node count, ``aten``: its ATen nodes, ``top``: its most
  frequent op types (to see what a slow op became).

A case that ortwrap refuses gets ``{"key": ..., "error": ...}``; outcomes are the sweep's business.
Each op runs in a forked child (a crash or ``--timeout`` costs that op only). Timing only: nothing
is asserted. On a shared machine run it with ``nice`` and ``OMP_NUM_THREADS=1``::

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/bench_opinfo.py --exporters dynamo \\
        --out /tmp/opinfo_timing.jsonl [--ops abs,std] [--shard 0/4] [--samples 1]
    python benchmarks/bench_opinfo.py --summary /tmp/opinfo_timing.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import warnings
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import opinfo_sweep as sw  # noqa: E402
from _harness import interleaved  # noqa: E402

#: the thresholds of issue 24 §4 (and the eager step below which ortwrap's per-call cost dominates)
BUILD_S = 5.0
RATIO = 2.0
TINY_MS = 0.2


def time_case(op, sample_index: int, sample, exporter: str, *, warmup: int, iters: int) -> dict:
    import torch

    from ortwrap import ORTWrap

    key = sw.case_key(sw.op_name(op), sample_index, exporter)
    spec, leaves, slots, tensors = sw._prepare(sample)
    if any(t.layout != torch.strided for t in tensors):
        return {"key": key, "skip": "sparse input"}
    post = sample.output_process_fn_grad or (lambda x: x)
    module = sw._make_module(op.op, spec, leaves, slots, post)
    try:
        e_outs, _, _, weights = sw._run(module, sw._fresh(tensors))
    except Exception as e:
        return {"key": key, "skip": f"eager fails: {sw._reason(e)}"}
    if not e_outs or any(t.layout != torch.strided for t in e_outs):
        return {"key": key, "skip": "no dense tensor output"}
    wrapped = ORTWrap(module, fallback=False, exporter=exporter, build_cache=False)
    args_e, args_o = sw._fresh(tensors), sw._fresh(tensors)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            sw._run(wrapped, args_o, weights)
            first = time.perf_counter() - t0
    except Exception as e:
        return {"key": key, "error": sw._reason(e)}
    art = wrapped.last_artifacts
    times = interleaved(
        {"eager": lambda: sw._run(module, args_e, weights), "ortwrap": lambda: sw._run(wrapped, args_o, weights)},
        warmup=warmup,
        iters=iters,
    )
    eager, ours = statistics.median(times["eager"]), statistics.median(times["ortwrap"])
    out = {
        "key": key,
        "build_s": round(first - ours, 3),
        "eager_ms": round(eager * 1e3, 4),
        "ortwrap_ms": round(ours * 1e3, 4),
        "ratio": round(ours / eager, 2) if eager > 0 else None,
    }
    if art is not None:
        nodes = art.pre_grad.graph.node
        out["stages_s"] = round(sum(art.stage_seconds.values()), 3)
        out["slowest_stage"] = max(art.stage_seconds.items(), key=lambda kv: kv[1], default=("", 0))[0]
        out["nodes"] = len(nodes)
        out["aten"] = sum(n.op_type == "ATen" for n in nodes)
        out["top"] = Counter(n.op_type for n in nodes).most_common(3)
    return out


def _child(op, exporters, samples, warmup, iters, out_path):
    import torch

    torch.set_num_threads(1)
    try:
        ss = sw._samples(op, samples)
    except Exception:
        return
    with open(out_path, "a", buffering=1) as f:
        for i, s in enumerate(ss):
            for exp in exporters:
                try:
                    r = time_case(op, i, s, exp, warmup=warmup, iters=iters)
                except Exception as e:
                    r = {"key": sw.case_key(sw.op_name(op), i, exp), "error": f"harness: {sw._reason(e)}"}
                f.write(json.dumps(r) + "\n")


def bench_op(op, exporters, samples, warmup, iters, timeout, out_path, log) -> None:
    """One op's cases in a forked child; a crash or timeout is written as that op's error line."""
    sys.stdout.flush()
    sys.stderr.flush()
    before = os.path.getsize(out_path) if os.path.exists(out_path) else 0
    pid = os.fork()
    if pid == 0:
        try:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            warnings.filterwarnings("ignore")
            _child(op, exporters, samples, warmup, iters, out_path)
        finally:
            os._exit(0)
    started = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - started > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = None
            break
        time.sleep(0.05)
    if status is None or os.WIFSIGNALED(status):
        what = "timeout" if status is None else f"crash {signal.Signals(os.WTERMSIG(status)).name}"
        with open(out_path, "a") as f:
            f.write(json.dumps({"key": sw.op_name(op), "error": f"{what} after the cases above"}) + "\n")
    with open(out_path) as f:
        f.seek(before)
        for line in f:
            print(line.rstrip(), flush=True)


def summary(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    timed = [r for r in rows if "build_s" in r]
    print(f"{len(rows)} cases, {len(timed)} timed, {sum('error' in r for r in rows)} not built")
    if not timed:
        return
    for exp in sorted({r["key"].rsplit("|", 1)[1] for r in timed}):
        rs = [r for r in timed if r["key"].endswith("|" + exp)]
        b = sorted(r["build_s"] for r in rs)
        q = sorted(r["ratio"] for r in rs if r["ratio"])
        print(
            f"{exp}: {len(rs)} timed; build median {statistics.median(b):.2f} s, p90 {b[int(0.9 * (len(b) - 1))]:.2f},"
            f" max {b[-1]:.2f}; step ratio median {statistics.median(q):.2f}x, p90 {q[int(0.9 * (len(q) - 1))]:.2f}x;"
            f" eager step median {statistics.median(r['eager_ms'] for r in rs):.3f} ms,"
            f" ortwrap {statistics.median(r['ortwrap_ms'] for r in rs):.3f} ms"
        )

    def show(title, sel):
        print(f"\n{title}: {len(sel)}")
        for r in sel:
            print(
                f"  {r['key']:<48} build {r['build_s']:6.2f}s  eager {r['eager_ms']:8.3f} ms  ortwrap"
                f" {r['ortwrap_ms']:8.3f} ms  {r['ratio']}x  nodes {r.get('nodes')} aten {r.get('aten')} {r.get('top')}"
            )

    show("build > 5 s", sorted((r for r in timed if r["build_s"] > BUILD_S), key=lambda r: -r["build_s"]))
    show(
        f"step > {RATIO}x eager (eager step >= {TINY_MS} ms)",
        sorted((r for r in timed if r["eager_ms"] >= TINY_MS and r["ratio"] > RATIO), key=lambda r: -r["ratio"]),
    )
    tiny = [r for r in timed if r["eager_ms"] < TINY_MS and r["ratio"] > RATIO]
    print(
        f"\nstep > {RATIO}x eager with eager below {TINY_MS} ms (per-call overhead): {len(tiny)} cases, ortwrap step"
        f" median {statistics.median(r['ortwrap_ms'] for r in tiny) if tiny else 0:.3f} ms"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="comma-separated op names (op or op.variant); default: all")
    p.add_argument("--exporters", default="dynamo")
    p.add_argument("--samples", type=int, default=sw.SAMPLES)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per op (all its cases)")
    p.add_argument("--shard", default="0/1", help="K/N: every N-th op from the K-th")
    p.add_argument("--out", default="opinfo_timing.jsonl", help="JSON lines, appended")
    p.add_argument("--log", default=os.devnull, help="children's stdout/stderr")
    p.add_argument("--summary", metavar="JSONL", help="only summarise a finished run")
    a = p.parse_args(argv)
    if a.summary:
        summary(a.summary)
        return 0
    if os.environ.get("PYTHONHASHSEED") != "0":  # the sweep's sample order (see opinfo_sweep)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    ops = sw.op_db()
    if a.ops:
        wanted = set(a.ops.split(","))
        ops = [o for o in ops if sw.op_name(o) in wanted or o.name in wanted]
    k, n = (int(v) for v in a.shard.split("/"))
    for op in ops[k::n]:
        bench_op(op, tuple(a.exporters.split(",")), a.samples, a.warmup, a.iters, a.timeout, a.out, a.log)
    summary(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
