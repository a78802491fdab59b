"""Effect of ORT's thread settings on a training step.

ORT's default lets idle intra-op threads spin; between ORT runs they compete with PyTorch's OpenMP
threads (optimizer step, loss, autograd) for the same cores. ortwrap turns spinning off and uses
as many intra-op threads as torch. Each configuration runs in its own process (thread pools of
several sessions in one process would disturb each other), with its own interleaved eager baseline:

    python benchmarks/bench_threads.py            # all configurations, MLP (a) and LM (b)
    python benchmarks/bench_threads.py --one mlp 2 0   # one: model, intra-op threads, spinning
"""

from __future__ import annotations

import copy
import statistics
import subprocess
import sys

CONFIGS = [
    (0, 0, "ortwrap default: spinning off, threads = torch's"),
    (0, 1, "spinning on (ORT's default)"),
    (1, 0, "1 intra-op thread, spinning off"),
]


def one(which: str, threads: int, spin: bool) -> None:
    import torch
    from _harness import interleaved, train_step
    from tiny_gpt import GPTConfig, TinyGPT, batch
    from torch import nn

    from ortwrap import ORTWrap

    torch.manual_seed(0)
    if which == "mlp":
        x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
        lossf = nn.CrossEntropyLoss()
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
        make_loss, iters, warmup = (lambda m: lossf(m(x), y)), 200, 20
    else:
        cfg = GPTConfig(layers=4, d=256, heads=4, max_len=128)
        ids, tgt = batch(cfg, 8, 128, torch.Generator().manual_seed(0))
        model = TinyGPT(cfg)
        make_loss, iters, warmup = (lambda m: m(ids, tgt)[0]), 12, 2
    w = ORTWrap(copy.deepcopy(model), fallback=False, intra_op_threads=threads, allow_spinning=spin)
    steps = {
        "eager": train_step(model, torch.optim.SGD(model.parameters(), lr=0.01), make_loss),
        "ortwrap": train_step(w, torch.optim.SGD(w.parameters(), lr=0.01), make_loss),
    }
    t = interleaved(steps, warmup=warmup, iters=iters)
    e, o = statistics.median(t["eager"]), statistics.median(t["ortwrap"])
    print(f"{e * 1e3:.3f} {o * 1e3:.3f}")


def main() -> None:
    for which, title in (("mlp", "(a) MLP"), ("lm", "(b) GPT LM")):
        print(f"\n== threads: {title}")
        for threads, spin, label in CONFIGS:
            out = subprocess.run(
                [sys.executable, __file__, "--one", which, str(threads), str(spin)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            e, o = float(out[-2]), float(out[-1])
            print(f"  {label:<48} eager {e:8.3f} ms  ortwrap {o:8.3f} ms  ratio ortwrap/eager = {o / e:.2f}x")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        one(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
    else:
        main()
