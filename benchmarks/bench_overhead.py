"""(c) Fixed per-step cost: a Linear(4, 4) training step, eager vs ortwrap, and ortwrap's own
Python time per step (the step's time outside ONNX Runtime's forward and backward runs)."""

from __future__ import annotations

import copy
import statistics
import time

import torch
from _harness import interleaved, report, train_step
from torch import nn

from ortwrap import ORTWrap


class _TimedAgent:
    """Proxy around ORT's TrainingAgent that accumulates the time spent inside its runs."""

    def __init__(self, agent) -> None:
        self._agent = agent
        self.seconds = 0.0

    def run_forward(self, *a):
        t0 = time.perf_counter()
        self._agent.run_forward(*a)
        self.seconds += time.perf_counter() - t0

    def run_backward(self, *a):
        t0 = time.perf_counter()
        self._agent.run_backward(*a)
        self.seconds += time.perf_counter() - t0


def main(iters: int = 2000) -> None:
    torch.manual_seed(0)
    eager = nn.Linear(4, 4)
    ours = ORTWrap(copy.deepcopy(eager), fallback=False)
    x = torch.randn(8, 4)
    steps = {
        "eager": train_step(eager, torch.optim.SGD(eager.parameters(), lr=0.01), lambda m: m(x).sum()),
        "ortwrap": train_step(ours, torch.optim.SGD(ours.parameters(), lr=0.01), lambda m: m(x).sum()),
    }
    report("(c) Linear(4,4) step: fixed per-step cost", interleaved(steps, warmup=50, iters=iters))

    # ortwrap's own time: the forward+backward of the wrapper minus the time inside ORT's runs.
    runner = ours.programs()[0].runner
    timed = _TimedAgent(runner._agent)
    runner._agent = timed
    own, total = [], []
    for _ in range(iters):
        timed.seconds = 0.0
        t0 = time.perf_counter()
        ours(x).sum().backward()
        dt = time.perf_counter() - t0
        total.append(dt)
        own.append(dt - timed.seconds)
    # What PyTorch itself spends on such a step, whoever runs the op: the loss (sum), the autograd
    # engine, one custom autograd.Function with the same inputs and output, and the accumulation of
    # the parameter gradients. Measured with a Function whose forward and backward return
    # preallocated tensors.
    w, b = ours.module.weight, ours.module.bias
    out_buf, gw, gb = torch.empty(8, 4), torch.empty(4, 4), torch.empty(4)

    class NoOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x_, w_, b_):
            return out_buf

        @staticmethod
        def backward(ctx, g):
            return None, gw, gb

    baseline = []
    for _ in range(iters):
        t0 = time.perf_counter()
        NoOp.apply(x, w, b).sum().backward()
        baseline.append(time.perf_counter() - t0)
    med = statistics.median
    ort_us = (med(total) - med(own)) * 1e6
    print(
        f"  ortwrap forward+backward {med(total) * 1e6:.1f} us = inside ORT runs {ort_us:.1f} us + outside ORT {med(own) * 1e6:.1f} us"
    )
    print(
        f"  PyTorch's share of that (loss, autograd engine, a no-op autograd.Function, grad accumulation): {med(baseline) * 1e6:.1f} us"
    )
    print(f"  => ortwrap's own Python overhead per step: {(med(own) - med(baseline)) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
