"""PyTorch activations that run as ATen nodes (elu, selu, celu, softplus, mish): what their gradient route costs.

Two measurements, 1 thread, CPU time (``time.process_time``), so a loaded machine disturbs them less:

- per call: the ATen bridge's vjp of ``elu`` (``ortwrap_vjp::elu``: the op recomputed under autograd, then
  ``torch.autograd.grad``) against its declared backward op (``ortwrap_ops::elu_backward``, ``ops.ATEN_GRADIENTS``)
  and against ``aten.elu_backward`` alone, each as the bridge calls it;
- per training step: an MLP of ``--layers`` Linear + activation pairs (AdamW), eager and ortwrap interleaved in
  one process; the ratio ortwrap/eager is the number to compare. ``--route vjp`` builds ortwrap's graphs with the
  vjp route (the declared gradients of PyTorch's own ops left out of the table the gradient build reads), so two
  processes, one per route, give the before and after on the same code.

    OMP_NUM_THREADS=1 python benchmarks/bench_aten_activations.py [--route vjp] [--acts elu,mish]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from _harness import interleaved
from torch import nn

ACTS = {"elu": nn.ELU, "selu": nn.SELU, "celu": nn.CELU, "softplus": nn.Softplus, "mish": nn.Mish}


def per_call(iters: int = 3000) -> dict[str, float]:
    """Microseconds per call of each gradient route of ``elu`` on a 16x128 float32 input, as the bridge runs it."""
    from ortwrap.bridge import aten as bridge
    from ortwrap.ops import define_ops

    define_ops()
    x, g = torch.randn(16, 128), torch.randn(16, 128)
    consts = [torch.tensor(1.0)] * 3
    mask = torch.tensor([True])

    def vjp():
        return bridge._vjp("elu", "", [g, x, *consts], 4, "1000")

    def declared():
        plan = bridge.resolve("ortwrap_ops::elu_backward", "")
        args, kwargs = plan.decode("elu_backward", [g, x, *consts, mask])
        return plan.run(*args, **kwargs)

    def aten_only():
        return torch.ops.aten.elu_backward(g, 1.0, 1.0, 1.0, False, x)

    out = {}
    for name, f in (("vjp", vjp), ("declared", declared), ("aten.elu_backward", aten_only)):
        for _ in range(200):
            f()
        t0 = time.process_time()
        for _ in range(iters):
            f()
        out[name] = (time.process_time() - t0) / iters * 1e6
    return out


def mlp(act: str, width: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), ACTS[act]()]
    return nn.Sequential(*mods, nn.Linear(width, 8))


def per_step(act: str, *, exporter: str, width: int, layers: int, batch: int, iters: int) -> dict:
    from ortwrap import ORTWrap

    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))
    steps = {}
    for path in ("eager", "ortwrap"):
        torch.manual_seed(0)
        model = mlp(act, width, layers)
        if path == "ortwrap":
            model = ORTWrap(model, exporter=exporter, build_cache=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model=model, opt=opt) -> None:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step()
        steps[path] = step
    times = interleaved(steps, warmup=20, iters=iters, clock=time.process_time)
    eager, ours = (statistics.median(times[p]) * 1e3 for p in ("eager", "ortwrap"))
    return {"eager_ms": eager, "ortwrap_ms": ours, "ratio": ours / eager}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--route", choices=("declared", "vjp"), default="declared")
    p.add_argument("--acts", default=",".join(ACTS))
    p.add_argument("--exporter", default="dynamo")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--no-per-call", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.route == "vjp":  # the route before ops.ATEN_GRADIENTS: PyTorch's own ops differentiated by a vjp
        from types import MappingProxyType

        import ortwrap.ops as ops

        ops.TORCH_OP_GRADIENTS = MappingProxyType({k: v for k, v in ops.TORCH_OP_GRADIENTS.items() if "::" in k})
    if not a.no_per_call:
        print("per call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in per_call().items()), flush=True)
    for act in a.acts.split(","):
        r = per_step(act, exporter=a.exporter, width=a.width, layers=a.layers, batch=a.batch, iters=a.iters)
        print(
            f"{a.route:8s} {act:9s} {a.exporter} {a.layers}x{a.width} b={a.batch}: eager {r['eager_ms']:.3f} ms, "
            f"ortwrap {r['ortwrap_ms']:.3f} ms, ortwrap/eager {r['ratio']:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
