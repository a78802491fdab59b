"""(a) MLP 784-512-10, batch 64, SGD: eager vs ortwrap median step time from one interleaved run."""

from __future__ import annotations

import copy

import torch
from _harness import interleaved, report, train_step
from torch import nn

from ortwrap import ORTWrap


def main(iters: int = 200) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
    ours = ORTWrap(copy.deepcopy(eager), fallback=False)
    x = torch.randn(64, 784)
    y = torch.randint(0, 10, (64,))
    lossf = nn.CrossEntropyLoss()
    steps = {
        "eager": train_step(eager, torch.optim.SGD(eager.parameters(), lr=0.01), lambda m: lossf(m(x), y)),
        "ortwrap": train_step(ours, torch.optim.SGD(ours.parameters(), lr=0.01), lambda m: lossf(m(x), y)),
    }
    report("(a) MLP 784-512-10, batch 64, SGD", interleaved(steps, warmup=10, iters=iters))


if __name__ == "__main__":
    main()
