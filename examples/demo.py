"""Train a small GPT-style LM with ortwrap and with eager PyTorch side by side.

Both copies start from the same weights and see the same batches; the script prints the two losses
at every step, then how far they drifted apart and the median step time of each.

    python examples/demo.py [--steps 30] [--layers 4] [--d 256] [--seq 128] [--batch 8]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt import GPTConfig, TinyGPT, batch

from ortwrap import ORTWrap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = GPTConfig(layers=args.layers, d=args.d, max_len=args.seq)
    eager = TinyGPT(cfg)
    ours = ORTWrap(copy.deepcopy(eager))
    opt_e = torch.optim.SGD(eager.parameters(), lr=args.lr)
    opt_o = torch.optim.SGD(ours.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(0)
    n_params = sum(p.numel() for p in eager.parameters())
    print(
        f"TinyGPT: {cfg.layers} layers, d={cfg.d}, T={args.seq}, batch={args.batch}, {n_params / 1e6:.2f}M parameters"
    )
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'step':>4}  {'eager loss':>10}  {'ortwrap loss':>12}  {'|diff|':>9}  {'eager ms':>8}  {'ortwrap ms':>10}")

    def step(model, opt, ids, tgt):
        start = time.perf_counter()
        loss, _ = model(ids, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item(), time.perf_counter() - start

    times_e, times_o, diffs = [], [], []
    first_step = None
    for i in range(args.steps):
        ids, tgt = batch(cfg, args.batch, args.seq, gen)
        # Alternate which side runs first so that neither gets a systematically warmer cache.
        if i % 2 == 0:
            le, te = step(eager, opt_e, ids, tgt)
            lo, to = step(ours, opt_o, ids, tgt)
        else:
            lo, to = step(ours, opt_o, ids, tgt)
            le, te = step(eager, opt_e, ids, tgt)
        if i == 0:
            first_step = to
        else:
            times_e.append(te)
            times_o.append(to)
        diffs.append(abs(le - lo))
        print(
            f"{i:>4}  {le:>10.5f}  {lo:>12.5f}  {abs(le - lo):>9.2e}  {te * 1e3:>8.1f}  {to * 1e3:>10.1f}", flush=True
        )

    me, mo = statistics.median(times_e), statistics.median(times_o)
    print()
    print(f"loss agreement: max |eager - ortwrap| = {max(diffs):.2e} over {args.steps} steps")
    print(f"first ortwrap step (export + gradient build + session + run): {first_step:.2f} s")
    print(f"median step: eager {me * 1e3:.1f} ms, ortwrap {mo * 1e3:.1f} ms, ratio ortwrap/eager = {mo / me:.2f}x")
    if ours.fallback_reason is not None:
        print(f"NOTE: ortwrap fell back to PyTorch: {ours.fallback_reason}")


if __name__ == "__main__":
    main()
