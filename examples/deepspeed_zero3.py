"""Train a small GPT with DeepSpeed ZeRO-3 on ONNX Runtime through ortwrap (CPU, gloo).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 examples/deepspeed_zero3.py [--steps 20] [--compare]

The model is built under ``deepspeed.zero.Init`` (each rank holds only its share of every
parameter), wrapped with ``ORTWrap`` and *then* given to ``deepspeed.initialize``: the wrap order
is ``deepspeed.initialize(model=ORTWrap(model))``. ``--compare`` trains the same model with plain
DeepSpeed afterwards and prints how far the two loss curves are apart. The configuration is
``deepspeed_zero3.json`` next to this file. See docs/distributed.md.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
from tiny_gpt import GPTConfig, TinyGPT

from ortwrap import ORTWrap

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_zero3.json")
MODEL = GPTConfig(vocab=128, d=64, heads=4, layers=2, max_len=32)


def batch(size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; the target of each token is a fixed function of it (learnable)."""
    ids = torch.randint(0, MODEL.vocab, (size, 24), generator=gen)
    return ids, (3 * ids + 1) % MODEL.vocab


def init_weights(model: torch.nn.Module) -> None:
    """GPT-2 style initialization of partitioned parameters: gather, let rank 0 write, re-partition."""
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
        if dist.get_rank() == 0:
            for mod in model.modules():
                if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
                    mod.weight.normal_(std=0.02)
                if isinstance(mod, torch.nn.Linear):
                    mod.bias.zero_()


def train(steps: int, wrap: bool) -> list[float]:
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):  # parameters are partitioned as they are created
        model = TinyGPT(MODEL)
    init_weights(model)
    if wrap:
        model = ORTWrap(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank trains on its own data
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        ids, targets = batch(engine.train_micro_batch_size_per_gpu(), gen)
        loss, _ = engine(ids, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if rank == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"{'ortwrap' if wrap else 'plain  '} step {step:3d}  loss {loss.item():.4f}", flush=True)
    seconds = time.perf_counter() - start
    held = sum(p.data.numel() for p in engine.module.parameters())
    total = sum(p.ds_numel for p in engine.module.parameters())
    if rank == 0:
        print(
            f"{'ortwrap' if wrap else 'plain  '}: {steps} steps in {seconds:.1f}s; between steps this rank holds "
            f"{held} of {total} parameter values in full form (the rest is partitioned)",
            flush=True,
        )
        if wrap:
            print(f"ORTWrap exports: {engine.module.export_count}, fallback: {engine.module.fallback_reason}")
    engine.destroy()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compare", action="store_true", help="also train with plain DeepSpeed and compare losses")
    args = parser.parse_args()
    # DeepSpeed's CPU accelerator would JIT-compile a shared-memory all-reduce kernel here (a minute or
    # more the first time); gloo is enough for this example.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    losses = train(args.steps, wrap=True)
    if args.compare:
        plain = train(args.steps, wrap=False)
        diff = max(abs(a - b) for a, b in zip(losses, plain))
        if dist.get_rank() == 0:
            print(f"max |loss(ortwrap) - loss(plain DeepSpeed)| over {args.steps} steps: {diff:.2e}")
    dist.barrier()


if __name__ == "__main__":
    main()
