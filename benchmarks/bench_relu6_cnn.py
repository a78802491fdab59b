"""ReLU6 (hardtanh) routes in a small CNN: ATen nodes (a Python call into PyTorch per node and step, forward and
backward) against ortwrap's CPU kernel ``ortwrap_cpu::clamp`` and its backward (gradient 0 at a bound, as eager's).

4 blocks of Conv3x3 + BatchNorm + ReLU6 (MobileNetV2's activation), global average pool, Linear, MSE; batch 8,
32x32, AdamW. 1 thread, CPU time (``time.process_time``), eager and both routes interleaved in one process. The ATen
route is ``native_kernels=False`` (nothing else in this model has a native kernel).

    OMP_NUM_THREADS=1 python benchmarks/bench_relu6_cnn.py [--iters 60] [--width 32] [--act relu6|clamp]
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
from _harness import interleaved, report, train_step
from torch import nn


class Clamp(nn.Module):
    """``x.clamp(0.0, 6.0)``: ReLU6's values, clamp's gradient (an ATen node on torch 2.14, ``Clip`` on 2.13)."""

    def forward(self, x):
        return x.clamp(0.0, 6.0)


def cnn(width: int, act: str = "relu6") -> nn.Module:
    layers, c = [], 3
    for _ in range(4):
        a = nn.ReLU6() if act == "relu6" else Clamp()
        layers += [nn.Conv2d(c, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), a]
        c = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--act", choices=("relu6", "clamp"), default="relu6")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from ortwrap import ORTWrap

    torch.manual_seed(0)
    base = cnn(args.width, args.act)
    x, target = torch.randn(args.batch, 3, 32, 32), torch.randn(args.batch, 10)
    models = {
        "eager": copy.deepcopy(base),
        "ortwrap, native_kernels=False": ORTWrap(copy.deepcopy(base), native_kernels=False),
        "ortwrap (clamp kernel)": ORTWrap(copy.deepcopy(base)),
    }
    steps = {
        name: train_step(m, torch.optim.AdamW(m.parameters(), 1e-3), lambda m: nn.functional.mse_loss(m(x), target))
        for name, m in models.items()
    }
    times = interleaved(steps, warmup=args.warmup, iters=args.iters, clock=time.process_time)
    report(f"CNN 4x(conv3x3 {args.width} + BN + {args.act}), batch {args.batch}, 32x32, 1 thread, CPU ms/step", times)
    for name in ("ortwrap, native_kernels=False", "ortwrap (clamp kernel)"):
        m = models[name]
        ops = [
            a.s.decode() for n in m.last_artifacts.graph.model().graph.node for a in n.attribute if a.name == "operator"
        ]
        print(f"  {name}: ATen operators {sorted(set(ops))}")


if __name__ == "__main__":
    main()
