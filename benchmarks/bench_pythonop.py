"""Per-call cost of a torch.autograd.Function bridged as PythonOp/PythonOpGrad.

A model of 16 Linear(16,16) layers, with a near-identity Function after each (``x * 1.0`` forward,
``g`` backward), against the same model without the Functions, both through ortwrap, in one
interleaved run. The difference of the median training steps divided by 16 is the cost of one
Function call (forward + backward). The eager PyTorch steps are printed for reference.

On a shared machine one run is noisy: ``python bench_pythonop.py 5`` repeats the interleaved run
five times (same models) and also prints the median of the per-call costs.
"""

from __future__ import annotations

import copy
import statistics
import sys

import torch
from _harness import interleaved, report, train_step
from torch import nn

from ortwrap import ORTWrap

CALLS = 16


class NearIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g


class Stack(nn.Module):
    def __init__(self, with_functions: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(CALLS))
        self.with_functions = with_functions

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            x = NearIdentity.apply(x) if self.with_functions else x * 1.0
        return x


def main(iters: int = 400, repeats: int = 1) -> None:
    torch.manual_seed(0)
    base = Stack(False)
    with_fn = copy.deepcopy(base)
    with_fn.with_functions = True
    x = torch.randn(8, 16)
    models = {
        "eager without Functions": base,
        "eager with Functions": copy.deepcopy(with_fn),
        "ortwrap without Functions": ORTWrap(copy.deepcopy(base), fallback=False),
        "ortwrap with 16 PythonOps": ORTWrap(with_fn, fallback=False),
    }
    steps = {
        n: train_step(m, torch.optim.SGD(m.parameters(), lr=1e-3), lambda m: m(x).sum()) for n, m in models.items()
    }
    costs = []
    for _ in range(repeats):
        times = interleaved(steps, warmup=20, iters=iters)
        report(f"PythonOp overhead: {CALLS} near-identity Functions", times, baseline="eager without Functions")
        per_call = (
            statistics.median(times["ortwrap with 16 PythonOps"])
            - statistics.median(times["ortwrap without Functions"])
        ) / CALLS
        eager_per_call = (
            statistics.median(times["eager with Functions"]) - statistics.median(times["eager without Functions"])
        ) / CALLS
        print(
            f"  => per Function call (forward + backward): ortwrap {per_call * 1e6:.1f} us, "
            f"eager {eager_per_call * 1e6:.1f} us"
        )
        costs.append(per_call)
    if repeats > 1:
        runs = ", ".join(f"{c * 1e6:.1f}" for c in costs)
        print(f"\n  => ortwrap per call over {repeats} runs: median {statistics.median(costs) * 1e6:.1f} us ({runs})")


if __name__ == "__main__":
    main(repeats=int(sys.argv[1]) if len(sys.argv) > 1 else 1)
