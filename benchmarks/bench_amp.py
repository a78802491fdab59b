"""Mixed precision on CPU: eager and ortwrap, float32 and bfloat16 autocast, on bench_scale's LM.

    python benchmarks/bench_amp.py                    # GPT-2-small-sized LM (bench_scale --size gpt2)
    python benchmarks/bench_amp.py --size small --iters 5
    python benchmarks/bench_amp.py --adapters         # frozen bf16 base + fp32 LoRA: fuse_initializers
    python benchmarks/bench_amp.py --fused-adamw      # AdamW(fused=True) on every variant, eager too
    python benchmarks/bench_amp.py --rss-only --batch 8   # peak RSS at another batch size
    python benchmarks/bench_amp.py --rss-only --malloc both   # also with glibc's tcache off

Prints, from one interleaved run (forward, loss.backward, AdamW step, zero_grad):

- the CPU and its bfloat16 capability (avx512_bf16 / amx_bf16 flags: native, else emulated);
- the median step of eager fp32, eager bf16 autocast, ortwrap fp32, ortwrap bf16 autocast (the
  route ``half_compute="auto"`` measures faster on the model's GEMM shapes, printed with the rates
  after its first step), ortwrap bf16 on the float32 route (``half_compute="float32"``) and on the
  native one (``"native"``: bf16 GEMMs in torch), and the ratio of ortwrap bf16 to eager bf16
  (the goal: <= 0.8);
- the float32 and bfloat16 GEMM rates torch reaches on the model's own matmul shapes in the same
  run, and each variant's fraction of the float32 GEMM limit (6 * N * tokens FLOPs at that rate);
- peak RSS of each variant in its own fresh process (``--no-rss`` skips); with ``--malloc both``
  each variant also in a process started with glibc's per-thread cache off
  (``GLIBC_TUNABLES=glibc.malloc.tcache_count=0``, the setting docs/user-guide.md "Memory on CPU"
  recommends where the peak matters), the two settings alternating variant by variant.

With ``--adapters``: the LM in bfloat16, frozen, with float32 low-rank adapters on every qkv and fc
projection (the fuse_initializers case): eager, ortwrap (a Cast of each frozen weight per step) and
ortwrap with ``fuse_initializers=True`` (float32 copies made once).

Where bf16 is emulated, ortwrap computes bf16 regions in float32 (passes/half_precision.py): see
docs/performance.md for which kernels run in which precision.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import _harness  # noqa: F401  (puts examples/ on sys.path)
import torch
from _harness import NO_TCACHE, interleaved, malloc_env, median_ms, peak_rss_child, report
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import SIZES, cpu_name, make, matmul_shapes


def bf16_capability() -> str:
    try:
        flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"native ({' '.join(native)})" if native else "emulated (no avx512_bf16 / amx_bf16)"


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable float32 low-rank update, as PEFT's LoRA computes it."""

    def __init__(self, base: nn.Linear, r: int = 8) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, r, bias=False)
        self.lora_b = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x.to(self.lora_a.weight.dtype))).to(x.dtype)


def make_adapted(size: str):
    model, ids, tgt = make(size, BATCH.get("batch"))
    model = model.to(torch.bfloat16).requires_grad_(False)
    for blk in model.blocks:
        blk.qkv = LoRALinear(blk.qkv)
        blk.fc = LoRALinear(blk.fc)
    return model, ids, tgt


#: the batch size, where ``--batch`` overrides bench_scale's for the size (``{"batch": n}``)
BATCH: dict = {}

#: torch.optim.AdamW's keyword arguments for every variant (``--fused-adamw``: ``fused=True``, PyTorch's
#: one-kernel CPU AdamW; the same optimizer on both sides either way)
OPTIM: dict = {}


def step_fn(model, ids, tgt, amp: bool):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, **OPTIM)

    def step() -> None:
        if amp:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = model(ids, tgt)
        else:
            loss, _ = model(ids, tgt)
        loss.float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


#: variant -> (ortwrap options or None for eager, autocast)
VARIANTS = {
    "eager fp32": (None, False),
    "eager bf16": (None, True),
    "ortwrap fp32": ({}, False),
    "ortwrap bf16": ({}, True),  # half_compute="auto": the native route where bf16 is native
    "ortwrap bf16 f32": ({"half_compute": "float32"}, True),  # the emulated route, forced
    "ortwrap bf16 native": ({"half_compute": "native"}, True),  # PyTorch's bf16 GEMMs, forced
    "ortwrap bf16 layers": ({"recompute": "layers"}, True),  # layer-wise activation recompute
    # without the region ORT's, the kernels' and PyTorch's large blocks share during ORT's runs
    # (runtime/cpu_region.py): glibc's heap, as before session 35
    "ortwrap fp32 no region": ({"cpu_region": False}, False),
    "ortwrap bf16 no region": ({"cpu_region": False}, True),
}
ADAPTER_VARIANTS = {
    "eager": (None, False),
    "ortwrap (cast)": ({"fuse_initializers": False}, False),
    "ortwrap (fused)": ({"fuse_initializers": True}, False),
}


def build(size: str, adapters: bool, options: dict | None):
    from ortwrap import ORTWrap

    model, ids, tgt = make_adapted(size) if adapters else make(size, BATCH.get("batch"))
    if options is not None:
        model = ORTWrap(model, fallback=False, **options)
    return model, ids, tgt


def gemm_rates(shapes, reps: int = 2, clock=time.perf_counter) -> dict[str, float]:
    """FLOP/s torch reaches over the list of GEMMs in float32 and in bfloat16 (best of ``reps``)."""
    flops = sum(2 * m * k * n for m, k, n in shapes)
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        mats = {s: (torch.randn(s[0], s[1]).to(dtype), torch.randn(s[1], s[2]).to(dtype)) for s in set(shapes)}
        best = float("inf")
        for _ in range(reps):
            t0 = clock()
            for s in shapes:
                torch.mm(*mats[s])
            best = min(best, clock() - t0)
        rates[str(dtype).removeprefix("torch.")] = flops / best
    return rates


def _rss_child(size: str, adapters: bool, variant: str, steps: int, env: dict | None = None) -> dict:
    code = f"""
import json, sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import bench_amp as b
import torch
b.OPTIM.update({OPTIM!r})
b.BATCH.update({BATCH!r})
torch.set_num_threads({torch.get_num_threads()})
variants = b.ADAPTER_VARIANTS if {adapters!r} else b.VARIANTS
options, amp = variants[{variant!r}]
model, ids, tgt = b.build({size!r}, {adapters!r}, options)
step = b.step_fn(model, ids, tgt, amp)
for _ in range({steps}):
    step()
"""
    return peak_rss_child(code, timeout=3600, env=env)


def main(
    size: str,
    iters: int,
    adapters: bool,
    rss: bool,
    timing: bool = True,
    cpu_time: bool = False,
    only: list[str] | None = None,
    malloc: str = "default",
) -> None:
    s = dict(SIZES[size], **BATCH)
    variants = ADAPTER_VARIANTS if adapters else VARIANTS
    if only:
        variants = {k: v for k, v in variants.items() if k in only}
    if not timing:
        print(f"\n== mixed precision: {size} {s}{' + LoRA' if adapters else ''}; CPU: {cpu_name()}")
        return _print_rss(size, adapters, variants, malloc)
    optim = "AdamW(fused=True)" if OPTIM.get("fused") else "AdamW (PyTorch's default: one tensor at a time on CPU)"
    print(f"\n== mixed precision: {size} {s}{' + LoRA, bf16 frozen base' if adapters else ''}, {optim}")
    print(
        f"   CPU: {cpu_name()}; bf16: {bf16_capability()}; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    if not adapters:
        print("   ortwrap bf16: half_compute='auto' measures its route (below); 'ortwrap bf16 f32' forces float32")
    steps, n_params, tokens = {}, 0, s["batch"] * s["seq"]
    for name, (options, amp) in variants.items():
        model, ids, tgt = build(size, adapters, options)
        n_params = sum(p.numel() for p in model.parameters())
        steps[name] = step_fn(model, ids, tgt, amp)
        t0 = time.perf_counter()
        steps[name]()
        print(f"   {name}: first step {time.perf_counter() - t0:.2f} s")
        artifacts = getattr(model, "last_artifacts", None)
        if artifacts is not None and artifacts.gemm_choice is not None:
            print(f"   {name}: {artifacts.gemm_choice.summary()}")  # the route measured and chosen, the rates
        elif artifacts is not None and artifacts.cached:
            print(f"   {name}: loaded from the build cache (GEMM route as measured when it was built)")
    clock = time.process_time if cpu_time else time.perf_counter
    times = interleaved(steps, warmup=1, iters=iters, clock=clock)
    print(f"   ({'CPU seconds of this process' if cpu_time else 'wall time'}; load before timing: {_load()})")
    report(f"{size}: {n_params / 1e6:.1f}M parameters, {tokens} tokens/step", times, baseline=next(iter(steps)))
    if not adapters and {"ortwrap bf16", "eager bf16"} <= set(times):
        ratio = median_ms(times["ortwrap bf16"]) / median_ms(times["eager bf16"])
        print(f"  ortwrap bf16 / eager bf16 autocast = {ratio:.2f}x (goal <= 0.8x)")
        rates = gemm_rates(matmul_shapes(size), clock=clock)
        limit = 6 * n_params * tokens / rates["float32"]
        print(
            f"  torch GEMM rate on the model's shapes: float32 {rates['float32'] / 1e9:.1f} GFLOP/s, "
            f"bfloat16 {rates['bfloat16'] / 1e9:.1f} GFLOP/s; float32 GEMM limit {limit * 1e3:.0f} ms"
        )
        for name, ts in times.items():
            print(f"  {name:<16} {median_ms(ts):9.0f} ms = {limit * 1e3 / median_ms(ts) * 100:5.1f}% of the fp32 limit")
    if rss:
        _print_rss(size, adapters, variants, malloc)


def _load() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "unknown"


def _print_rss(size: str, adapters: bool, variants: dict, malloc: str = "default") -> None:
    settings = {"default": [None], "no-tcache": [NO_TCACHE], "both": [None, NO_TCACHE]}[malloc]
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    print(f"\n== peak RSS, each variant in its own process (3 steps); GLIBC_TUNABLES={tunables!r}")
    if NO_TCACHE in settings:
        print(f"   [no tcache]: the process started with GLIBC_TUNABLES += {NO_TCACHE}")
    base: dict = {}  # per setting: (the first measured peak, its variant)
    for name in variants:
        for setting in settings:
            r = _rss_child(size, adapters, name, 3, env=malloc_env(setting) if setting else None)
            tag = " [no tcache]" if setting else ""
            if "error" in r:
                print(f"  {name + tag:<28} failed: {r['error'][-300:]}")
                continue
            ref, ref_name = base.setdefault(setting, (r["peak_rss_mib"], name))
            print(f"  {name + tag:<28} {r['peak_rss_mib']:8.0f} MiB ({r['peak_rss_mib'] / ref:.2f}x {ref_name}{tag})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="gpt2")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--adapters", action="store_true")
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--rss-only", action="store_true", help="only the peak RSS of each variant")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time CPU seconds, not wall time (steadier on a shared machine)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (and ORT's); 0: torch's default")
    parser.add_argument(
        "--fused-adamw", action="store_true", help="torch.optim.AdamW(fused=True) for every variant (eager too)"
    )
    parser.add_argument("--batch", type=int, default=0, help="batch size; 0: bench_scale's for the size")
    parser.add_argument(
        "--malloc",
        choices=("default", "no-tcache", "both"),
        default="default",
        help="the peak-RSS processes' glibc setting: as this process, with the per-thread cache off "
        "(GLIBC_TUNABLES=glibc.malloc.tcache_count=0), or both, alternating",
    )
    parser.add_argument("--only", help="comma-separated variants to run (e.g. 'eager bf16,ortwrap bf16')")
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    only = [v.strip() for v in a.only.split(",")] if a.only else None
    if a.fused_adamw:
        OPTIM["fused"] = True
    if a.batch:
        BATCH["batch"] = a.batch
    main(
        a.size,
        a.iters,
        a.adapters,
        not a.no_rss,
        timing=not a.rss_only,
        cpu_time=a.cpu_time,
        only=only,
        malloc=a.malloc,
    )
