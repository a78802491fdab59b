"""Peak parameter memory per rank under DeepSpeed ZeRO-3: eager against ORTWrap's two gather modes.

Trains the same stack of ``--layers`` blocks (Linear d x d, LayerNorm, tanh) on 2 ranks (gloo, CPU,
``torchrun --nproc_per_node=2``) for a few steps, each mode in its own pair of processes:

- ``eager``: plain DeepSpeed ZeRO-3 (its module hooks gather and release each submodule);
- ``module``: ``ORTWrap(model)`` with ``zero3_gather="module"`` (the whole module gathered per step);
- ``submodule``: ``ORTWrap(model, zero3_gather="submodule")`` (each submodule gathered inside the
  ORT graph when ORT reaches it, forward and backward; the default exporter, dynamo);
- ``submodule-ts``: the same with ``exporter="torchscript"``.

Per rank it reports the most elements of whole (gathered) parameters alive at once during a
training step after the first (the first exports, with every parameter whole), as a fraction of the
model, and the process's peak RSS. DeepSpeed is configured to keep nothing whole that it does not need
now (no prefetch, ``stage3_max_live_parameters=0``, ``stage3_max_reuse_distance=0``), else eager
keeps up to 1e9 elements whole. Eager's figure is sampled in forward pre-hooks and
post-accumulate-grad hooks (registered after DeepSpeed's, so they see what DeepSpeed holds then);
``module`` holds every parameter; ``submodule``'s comes from the gather nodes' tracker
(``ortwrap.integrations.zero3_layers.GatherTracker``). The losses of the three modes are printed
side by side. RSS includes each runtime's own footprint (ORT sessions and build): indicative only.

    python benchmarks/bench_zero3.py                    # width 1024, 12 blocks
    python benchmarks/bench_zero3.py --width 512 --layers 24
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("eager", "module", "submodule", "submodule-ts")
STEPS = 4
BATCH = 8


def worker(mode: str, d: int, layers: int, out: str) -> None:
    import resource

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    from ortwrap import ORTWrap

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(d, d)
            self.norm = nn.LayerNorm(d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.norm(self.fc(x)))

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(*[Block() for _ in range(layers)], nn.Linear(d, 1))
    model_numel = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    if mode != "eager":
        options = {"zero3_gather": mode.removesuffix("-ts")}
        if mode == "submodule-ts":
            options["exporter"] = "torchscript"
        model = ORTWrap(model, fallback=False, **options)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_model_persistence_threshold": 0,
            # Eager at its tightest: no prefetch, nothing kept whole for reuse (DeepSpeed's defaults
            # keep up to 1e9 elements whole, the whole of this model). ORTWrap does not read them.
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_live_parameters": 0,
            "stage3_max_reuse_distance": 0,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    params = list(engine.module.parameters())
    peak = [0]
    measuring = [False]

    def sample(*_args) -> None:
        if measuring[0]:
            peak[0] = max(peak[0], sum(p.ds_numel for p in params if p.data.numel()))

    tracker = None
    if mode == "eager":
        for m in engine.module.modules():
            m.register_forward_pre_hook(lambda m, a: sample())
        for p in params:
            p.register_post_accumulate_grad_hook(sample)
    elif mode.startswith("submodule"):
        from ortwrap.integrations import zero3_layers
        from ortwrap.integrations.deepspeed import _state

        tracker = zero3_layers.GatherTracker()
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(STEPS):
        x, y = torch.randn(BATCH, d, generator=g), torch.randn(BATCH, 1, generator=g)
        measuring[0] = step > 0
        if tracker is not None and step == 1:
            _state(engine.module).table.tracker = tracker
        pred = engine(x)
        if mode == "module" and step > 0:
            sample()  # (every parameter is whole from the forward to the end of the backward)
        loss = ((pred - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if tracker is not None:
        peak[0] = tracker.peak
    result = {
        "mode": mode,
        "rank": rank,
        "losses": losses,
        "peak_whole_numel": peak[0],
        "model_numel": model_numel,
        "largest_layer_numel": largest,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    with open(os.path.join(out, f"{mode}.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    engine.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.width, args.layers, args.out)
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTWRAP_")}
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        ORTWRAP_BUILD_CACHE="0",
        PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]),
    )
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        for mode in MODES:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            cmd += [os.path.abspath(__file__), "--worker", mode, "--out", out, "--width", str(args.width)]
            cmd += ["--layers", str(args.layers)]
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            try:
                rows[mode] = [json.load(open(os.path.join(out, f"{mode}.rank{r}.json"))) for r in range(2)]
            except FileNotFoundError:
                sys.exit(f"{mode} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    first = rows["eager"][0]
    print(
        f"ZeRO-3 on 2 ranks, {args.layers} blocks of d={args.width}: {first['model_numel']:,} parameters, "
        f"largest submodule {first['largest_layer_numel']:,}"
    )
    print(f"{'mode':<13} {'rank':>4} {'peak whole params':>18} {'of model':>9} {'peak RSS MiB':>13}")
    for mode in MODES:
        for r in rows[mode]:
            frac = r["peak_whole_numel"] / r["model_numel"]
            print(f"{mode:<13} {r['rank']:>4} {r['peak_whole_numel']:>18,} {frac:>9.1%} {r['peak_rss_mib']:>13.0f}")
    for r in range(2):
        print(f"losses rank {r}: " + " | ".join(f"{m}: {[round(v, 6) for v in rows[m][r]['losses']]}" for m in MODES))


if __name__ == "__main__":
    main()
