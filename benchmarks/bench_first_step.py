"""First-step time of each exporter: export + passes + gradient build + session + the first run.

Each (model, exporter) runs in its own fresh process, twice:

- ``cold``: the first ortwrap build of the process (imports of the exporter's machinery included,
  the native helpers already compiled in the cache);
- ``warm``: a second model of the same kind built in the same process afterwards.

Models: the GPT-style LM of ``bench_lm.py`` and a small HF GPT-2 (random weights). Prints the
stage times ortwrap records (``last_artifacts.seconds``) and the ratio dynamo / TorchScript.

    python benchmarks/bench_first_step.py            # all
    python benchmarks/bench_first_step.py --model lm
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

_CHILD = r"""
import json, sys, time
sys.path.insert(0, {examples!r})
import torch
torch.set_num_threads(2)
from ortwrap import ORTWrap

def make(kind):
    torch.manual_seed(0)
    if kind == "lm":
        from tiny_gpt import GPTConfig, TinyGPT, batch
        cfg = GPTConfig(layers=4, d=256, heads=4, max_len=128)
        ids, tgt = batch(cfg, 8, 128, torch.Generator().manual_seed(0))
        return TinyGPT(cfg), (ids, tgt), {{}}, lambda out: out[0]
    import transformers
    cfg = transformers.GPT2Config(vocab_size=1000, n_embd=128, n_layer=4, n_head=4, n_positions=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 1000, (4, 64))
    return transformers.GPT2LMHeadModel(cfg), (), {{"input_ids": ids, "labels": ids}}, lambda out: out.loss

results = []
for phase in ("cold", "warm"):
    model, args, kwargs, loss_of = make({kind!r})
    w = ORTWrap(model, fallback=False, exporter={exporter!r})
    t0 = time.perf_counter()
    loss_of(w(*args, **kwargs)).backward()
    first = time.perf_counter() - t0
    results.append(dict(phase=phase, first=first, stages=w.last_artifacts.seconds))
print("RESULT " + json.dumps(results))
"""


def measure(kind: str, exporter: str) -> list[dict]:
    code = _CHILD.format(examples=os.path.join(HERE, "..", "examples"), kind=kind, exporter=exporter)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{kind}/{exporter} failed:\n{proc.stderr[-3000:]}")


def main(models: list[str] | None = None) -> None:
    import torch

    from ortwrap._compat.torch import default_exporter

    print(f"\n== first step (fresh process per row), torch {torch.__version__}, default exporter {default_exporter()}")
    for kind in models or ["lm", "hf-gpt2"]:
        first: dict[tuple[str, str], float] = {}
        for exporter in ("torchscript", "dynamo"):
            for r in measure(kind, exporter):
                first[(exporter, r["phase"])] = r["first"]
                stages = ", ".join(f"{k} {v:.2f}" for k, v in r["stages"].items())
                print(f"  {kind:<8} {exporter:<12} {r['phase']:<5} first step {r['first']:6.2f} s  ({stages})")
        for phase in ("cold", "warm"):
            ratio = first[("dynamo", phase)] / first[("torchscript", phase)]
            print(f"  {kind:<8} dynamo / torchscript, {phase}: {ratio:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["lm", "hf-gpt2"], action="append")
    main(parser.parse_args().model)
