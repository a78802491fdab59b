"""Standard-op fusions against ortwrap's own kernels: which runs GELU, LayerNorm and RMSNorm faster.

One training step (forward, backward, SGD) of a block that is mostly the op in question, at a
GPT-2-small activation size (batch 4, seq 256, d 768), interleaved in one run:

- ``eager``: PyTorch;
- ``fused+kernels``: the default (fusions, then ortwrap's CPU kernels where they cover the fused op);
- ``fused``: fusions only (ORT's Gelu/FastGelu, LayerNormalization, SimplifiedLayerNormalization and
  their gradients);
- ``kernels``: ortwrap's kernels on the exporter's decomposed form (no fusions);
- ``decomposed``: neither (ORT differentiates the exporter's elementwise form).

The pipeline keeps whichever is faster on CPU training graphs: docs/performance.md has the numbers.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
from _harness import interleaved, report, train_step
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import cpu_name

from ortwrap import ORTWrap


class RMSNorm(nn.Module):
    """Llama's RMSNorm: float32 statistics, cast back before the weight."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def block(kind: str, d: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gelu":
        return nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.GELU(approximate="tanh"))
    if kind == "layernorm":
        return nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d))
    if kind == "rmsnorm":
        return nn.Sequential(nn.Linear(d, d), RMSNorm(d), nn.Linear(d, d), RMSNorm(d))
    raise ValueError(kind)


CONFIGS = {
    "fused+kernels": {"fusions": True, "native_kernels": True},
    "fused": {"fusions": True, "native_kernels": False},
    "kernels": {"fusions": False, "native_kernels": True},
    "decomposed": {"fusions": False, "native_kernels": False},
}


def main(kinds: list[str], iters: int, batch: int, seq: int, d: int, exporter: str, cpu_time: bool) -> None:
    clock = time.process_time if cpu_time else time.perf_counter
    print(
        f"CPU: {cpu_name()}; torch threads {torch.get_num_threads()}; exporter {exporter}; "
        f"{'CPU seconds of this process' if cpu_time else 'wall time'}"
    )
    x = torch.randn(batch, seq, d)
    for kind in kinds:
        eager = block(kind, d)
        models = {"eager": eager}
        for name, opts in CONFIGS.items():
            models[name] = ORTWrap(copy.deepcopy(eager), fallback=False, exporter=exporter, build_cache=False, **opts)
        steps = {
            name: train_step(m, torch.optim.SGD(m.parameters(), lr=1e-3), lambda m: m(x).square().mean())
            for name, m in models.items()
        }
        report(
            f"{kind}: [{batch}, {seq}, {d}] x2, forward+backward+SGD",
            interleaved(steps, warmup=3, iters=iters, clock=clock),
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["gelu", "layernorm", "rmsnorm"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--exporter", default="torchscript")
    parser.add_argument("--threads", type=int, default=None, help="torch (and so ORT) threads")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time CPU seconds, not wall time (steadier on a shared machine)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    main(args.kinds, args.iters, args.batch, args.seq, args.d, args.exporter, args.cpu_time)
