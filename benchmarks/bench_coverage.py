"""The coverage table: each architecture of ``tests/model_zoo.py`` under each exporter, its
outcome, its first-step time and its steady step time against eager.

For each (model, exporter): the first ORTWrap step (export, passes, gradient build, session, the
run; build cache off) is timed once, then eager and ortwrap training steps (AdamW) are timed
interleaved at the model's first input shape. The outcome is ``ok``, ``fallback`` (with the
reason) or the error. Run it on an otherwise idle machine: on the 2-core machines here step times
vary by 10-30% between runs.

    python benchmarks/bench_coverage.py                    # every model, both exporters
    python benchmarks/bench_coverage.py --models bert,t5 --exporters dynamo
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from _harness import interleaved, median_ms  # noqa: E402

from ortwrap import ORTWrap  # noqa: E402


def _loss(case, out):
    from parity import default_loss

    return (case.loss or default_loss)(out)


def run(case, exporter: str, *, warmup: int, iters: int) -> dict:
    torch.manual_seed(0)
    eager = case.make_model()
    ours = copy.deepcopy(eager)
    wrapped = ORTWrap(ours, exporter=exporter, fallback=True, build_cache=False)
    args, kwargs = case.make_inputs(2, torch.Generator().manual_seed(1))
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, eps=1e-5)
    opt_o = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, eps=1e-5)

    def step(model, opt):
        def f():
            _loss(case, model(*args, **kwargs)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return f

    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(wrapped, opt_o)()
    except Exception as e:  # the table reports it
        return {"outcome": f"error: {type(e).__name__}: {str(e)[:120]}"}
    first = time.perf_counter() - t0
    if wrapped.fallback_reason is not None:
        return {"outcome": f"fallback: {str(wrapped.fallback_reason)[:120]}", "first_s": first}
    times = interleaved({"eager": step(eager, opt_e), "ortwrap": step(wrapped, opt_o)}, warmup=warmup, iters=iters)
    e, o = median_ms(times["eager"]), median_ms(times["ortwrap"])
    return {"outcome": "ok", "first_s": first, "eager_ms": e, "ortwrap_ms": o, "ratio": o / e}


def main() -> None:
    from model_zoo import CASES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="", help="comma-separated case names (default: all)")
    p.add_argument("--exporters", default="torchscript,dynamo")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    torch.set_num_threads(2)
    wanted = set(a.models.split(",")) if a.models else None
    print(
        f"{'model':<20} {'exporter':<12} {'outcome':<10} {'ratio':>6} {'eager ms':>9} {'ortwrap ms':>10} {'first s':>8}"
    )
    for case in CASES:
        if wanted and case.name not in wanted:
            continue
        for exporter in a.exporters.split(","):
            r = run(case, exporter, warmup=a.warmup, iters=a.iters)
            if r["outcome"] == "ok":
                print(
                    f"{case.name:<20} {exporter:<12} {'ok':<10} {r['ratio']:>5.2f}x {r['eager_ms']:>9.2f} "
                    f"{r['ortwrap_ms']:>10.2f} {r['first_s']:>8.2f}",
                    flush=True,
                )
            else:
                print(f"{case.name:<20} {exporter:<12} {r['outcome']}", flush=True)


if __name__ == "__main__":
    main()
