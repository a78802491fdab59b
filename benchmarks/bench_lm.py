"""(b) GPT-style LM (4 layers, d=256, T=128, batch 8, SGD, cross-entropy inside the module).

Prints the first-step time of ortwrap (export + passes + gradient build + session + first run) and
the eager and ortwrap median step times from one interleaved run: ortwrap with each exporter, and
with ORT's own CPU kernels instead of ortwrap's (``native_kernels=False``).
"""

from __future__ import annotations

import copy
import time

import torch
from _harness import interleaved, report, train_step
from tiny_gpt import GPTConfig, TinyGPT, batch

from ortwrap import ORTWrap


def _first_step(model, opt, ids, tgt) -> float:
    t0 = time.perf_counter()
    loss, _ = model(ids, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main(iters: int = 40) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(layers=4, d=256, heads=4, max_len=128)
    eager = TinyGPT(cfg)
    ids, tgt = batch(cfg, 8, 128, torch.Generator().manual_seed(0))
    steps = {"eager": train_step(eager, torch.optim.SGD(eager.parameters(), lr=0.01), lambda m: m(ids, tgt)[0])}
    print("\n== (b) first ortwrap step (export + passes + gradient build + session + first run)")
    for exporter in ("torchscript", "dynamo"):
        ours = ORTWrap(copy.deepcopy(eager), fallback=False, exporter=exporter)
        opt = torch.optim.SGD(ours.parameters(), lr=0.01)
        first = _first_step(ours, opt, ids, tgt)
        secs = ours.last_artifacts.seconds
        print(f"  {exporter:<12} first step {first:.2f} s: " + ", ".join(f"{k} {v:.2f} s" for k, v in secs.items()))
        name = "ortwrap" if exporter == "torchscript" else f"ortwrap ({exporter})"
        steps[name] = train_step(ours, opt, lambda m: m(ids, tgt)[0])
    # The same without ortwrap's CPU kernels (ORT 1.19.2's own kernels for GELU, LayerNorm, ...).
    plain = ORTWrap(copy.deepcopy(eager), fallback=False, native_kernels=False)
    steps["ortwrap (ORT kernels)"] = train_step(
        plain, torch.optim.SGD(plain.parameters(), lr=0.01), lambda m: m(ids, tgt)[0]
    )
    report("(b) GPT LM 4x256, T=128, batch 8, SGD", interleaved(steps, warmup=3, iters=iters))


if __name__ == "__main__":
    main()
