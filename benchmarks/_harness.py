"""Shared benchmark harness: interleaved timing of eager and ortwrap training steps."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def interleaved(
    steps: dict[str, Callable[[], object]], *, warmup: int, iters: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, list[float]]:
    """Run each named step ``warmup`` times, then ``iters`` rounds in which every step runs once,
    rotating the order each round; return each step's times in seconds.

    ``clock`` is wall time by default. ``time.process_time`` (CPU seconds of this process, all its
    threads) is steadier on a machine that other work shares; it equals wall time times the threads
    in use only when nothing waits, so compare configurations with the same thread count."""
    names = list(steps)
    for _ in range(warmup):
        for n in names:
            steps[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(iters):
        order = names[i % len(names) :] + names[: i % len(names)]
        for n in order:
            t0 = clock()
            steps[n]()
            times[n].append(clock() - t0)
    return times


def median_ms(ts: list[float]) -> float:
    return statistics.median(ts) * 1e3


def report(title: str, times: dict[str, list[float]], baseline: str = "eager") -> None:
    print(f"\n== {title}")
    base = statistics.median(times[baseline])
    for name, ts in times.items():
        med = statistics.median(ts)
        # quantiles() needs two points; one timing (--iters 1) has no spread.
        q1, _, q3 = statistics.quantiles(ts, n=4) if len(ts) > 1 else (med, med, med)
        ratio = f"  ratio {name}/{baseline} = {med / base:.2f}x" if name != baseline else ""
        print(f"  {name:<28} median {med * 1e3:9.3f} ms  (IQR {q1 * 1e3:.3f}-{q3 * 1e3:.3f}){ratio}")


def train_step(model, opt, make_loss: Callable[[object], object]) -> Callable[[], None]:
    def step() -> None:
        loss = make_loss(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


#: glibc's setting that turns its per-thread cache of small freed chunks off (docs/performance.md, "What
#: the gap is: glibc's per-thread cache of small chunks"); read by glibc when a process starts
NO_TCACHE = "glibc.malloc.tcache_count=0"


def malloc_env(setting: str) -> dict:
    """This process's environment with glibc's ``setting`` (a ``GLIBC_TUNABLES`` entry) added."""
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), setting) if t)
    return env


def peak_rss_child(code: str, timeout: int = 1800, env: dict | None = None) -> dict:
    """Run ``code`` (Python source) in a fresh interpreter (``env``: its environment, default this
    process's); its peak RSS in MiB afterwards.

    Returns ``{"peak_rss_mib": ...}``, or ``{"error": <the end of stderr>}`` if it failed."""
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over from the parent across fork+exec.
    code += (
        '\nhwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))'
        '\nprint("RSS " + str(hwm / 1024))\n'
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RSS "):
            return {"peak_rss_mib": json.loads(line[4:])}
    return {"error": proc.stderr[-1500:]}
