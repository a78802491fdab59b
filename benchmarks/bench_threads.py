"""Effect of ORT's thread settings on a training step, in one interleaved run.

ORT's default lets idle intra-op threads spin; between ORT runs they compete with PyTorch's OpenMP
threads (optimizer step, loss, autograd) for the same cores. ortwrap turns spinning off and uses
as many intra-op threads as torch. This prints eager and ortwrap step times for the MLP (a) and
the LM (b) under: ortwrap's default, spinning on (ORT's default), and one intra-op thread.
"""

from __future__ import annotations

import copy

import torch
from _harness import interleaved, report, train_step
from tiny_gpt import GPTConfig, TinyGPT, batch
from torch import nn

from ortwrap import ORTWrap

CONFIGS = {
    "ortwrap (spinning off, N threads)": {},
    "ortwrap spinning on (ORT default)": {"allow_spinning": True},
    "ortwrap 1 intra-op thread": {"intra_op_threads": 1},
}


def _compare(title: str, model: nn.Module, make_loss, iters: int, warmup: int) -> None:
    steps = {"eager": train_step(model, torch.optim.SGD(model.parameters(), lr=0.01), make_loss)}
    for name, opts in CONFIGS.items():
        w = ORTWrap(copy.deepcopy(model), fallback=False, **opts)
        steps[name] = train_step(w, torch.optim.SGD(w.parameters(), lr=0.01), make_loss)
    report(title, interleaved(steps, warmup=warmup, iters=iters))


def main() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    lossf = nn.CrossEntropyLoss()
    mlp = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
    _compare("threads: (a) MLP", mlp, lambda m: lossf(m(x), y), iters=100, warmup=5)
    cfg = GPTConfig(layers=4, d=256, heads=4, max_len=128)
    ids, tgt = batch(cfg, 8, 128, torch.Generator().manual_seed(0))
    _compare("threads: (b) GPT LM", TinyGPT(cfg), lambda m: m(ids, tgt)[0], iters=10, warmup=2)


if __name__ == "__main__":
    main()
