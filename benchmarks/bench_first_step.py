"""First-step time of each exporter: export + passes + gradient build + session + the first run.

Each (model, exporter) runs in two fresh processes sharing a new, empty build cache directory:

- ``cold``: the first ortwrap build of the first process (imports of the exporter's machinery
  included, the native helpers already compiled); it fills the build cache;
- ``warm``: a second model of the same kind built in the same process afterwards, cache off;
- ``cached``: the first step of the second process, which loads the graph from the build cache
  (what a restarted job pays: ``build_cache``, docs/user-guide.md).

Each row gives wall time and the CPU seconds of the process (``time.process_time``, all threads),
and per stage group both (``StageRecord.cpu_seconds``): the build is mostly one thread, so on a
shared, busy machine CPU seconds are the steadier figure.

Models: the GPT-style LM of ``bench_lm.py``, a small HF GPT-2 (random weights) and bench_scale's
GPT-2-small-sized LM (``gpt2``, 98M parameters). Prints the stage times ortwrap records
(``last_artifacts.seconds``) and the ratio dynamo / TorchScript.

    python benchmarks/bench_first_step.py            # lm and hf-gpt2
    python benchmarks/bench_first_step.py --model gpt2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {examples!r})
sys.path.insert(0, {here!r})
import torch
torch.set_num_threads(2)
t_import = time.perf_counter()
from ortwrap import ORTWrap
t_import = time.perf_counter() - t_import

def make(kind):
    torch.manual_seed(0)
    if kind == "lm":
        from tiny_gpt import GPTConfig, TinyGPT, batch
        cfg = GPTConfig(layers=4, d=256, heads=4, max_len=128)
        ids, tgt = batch(cfg, 8, 128, torch.Generator().manual_seed(0))
        return TinyGPT(cfg), (ids, tgt), {{}}, lambda out: out[0]
    if kind == "gpt2":
        import bench_scale
        model, ids, tgt = bench_scale.make("gpt2")
        return model, (ids, tgt), {{}}, lambda out: out[0]
    import transformers
    cfg = transformers.GPT2Config(vocab_size=1000, n_embd=128, n_layer=4, n_head=4, n_positions=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 1000, (4, 64))
    return transformers.GPT2LMHeadModel(cfg), (), {{"input_ids": ids, "labels": ids}}, lambda out: out.loss

results = []
for phase in {phases!r}:
    model, args, kwargs, loss_of = make({kind!r})
    w = ORTWrap(model, fallback=False, exporter={exporter!r}, build_cache=phase != "warm")
    t0, c0 = time.perf_counter(), time.process_time()
    loss_of(w(*args, **kwargs)).backward()
    first, cpu = time.perf_counter() - t0, time.process_time() - c0
    stages_cpu = {{}}
    for r in w.last_artifacts.stages:
        stages_cpu[r.group] = stages_cpu.get(r.group, 0.0) + getattr(r, "cpu_seconds", 0.0)
    results.append(dict(phase=phase, first=first, cpu=cpu, stages=w.last_artifacts.seconds, stages_cpu=stages_cpu,
                        imp=t_import))
print("RESULT " + json.dumps(results))
"""


def _child(kind: str, exporter: str, phases: tuple[str, ...], cache_dir: str) -> list[dict]:
    code = _CHILD.format(
        examples=os.path.join(HERE, "..", "examples"), here=HERE, kind=kind, exporter=exporter, phases=phases
    )
    env = {**os.environ, "ORTWRAP_BUILD_CACHE_DIR": cache_dir}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{kind}/{exporter} failed:\n{proc.stderr[-3000:]}")


def measure(kind: str, exporter: str) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="ortwrap-bench-cache-") as cache_dir:
        return _child(kind, exporter, ("cold", "warm"), cache_dir) + _child(kind, exporter, ("cached",), cache_dir)


def main(models: list[str] | None = None) -> None:
    import torch

    from ortwrap._compat.torch import default_exporter

    print(f"\n== first step (fresh process per row), torch {torch.__version__}, default exporter {default_exporter()}")
    for kind in models or ["lm", "hf-gpt2"]:
        first: dict[tuple[str, str], float] = {}
        cpu_of: dict[tuple[str, str], float] = {}
        for exporter in ("torchscript", "dynamo"):
            for r in measure(kind, exporter):
                first[(exporter, r["phase"])] = r["first"]
                cpu_of[(exporter, r["phase"])] = r["cpu"]
                cpu = r.get("stages_cpu", {})
                stages = ", ".join(f"{k} {v:.2f}/{cpu.get(k, 0.0):.2f}" for k, v in r["stages"].items())
                print(
                    f"  {kind:<8} {exporter:<12} {r['phase']:<6} first step {r['first']:6.2f} s, "
                    f"{r['cpu']:6.2f} CPU s  (import ortwrap {r['imp']:.2f} s; stage wall/CPU s: {stages})"
                )
        for phase in ("cold", "warm"):
            ratio = first[("dynamo", phase)] / first[("torchscript", phase)]
            ratio_cpu = cpu_of[("dynamo", phase)] / cpu_of[("torchscript", phase)]
            print(f"  {kind:<8} dynamo / torchscript, {phase}: {ratio:.2f}x wall, {ratio_cpu:.2f}x CPU")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["lm", "hf-gpt2", "gpt2"], action="append")
    main(parser.parse_args().model)
