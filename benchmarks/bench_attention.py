"""bf16 attention: ortwrap's kernels (through an ORT session, with each bf16 GEMM available) against
PyTorch's CPU flash attention, forward + backward, one thread, CPU time.

    python benchmarks/bench_attention.py

Calls the kernels as ``tests/test_native_kernels.py`` does (its sessions and masks); "heads":
``attention_bf16`` on [B, H, T, D], "bthd": ``attention_bthd_bf16`` on [B, T, H, D]. GEMMs: "mkl"
(MKL's ``cblas_gemm_bf16bf16f32`` from PyTorch's library), "own" (``_cpu.c``'s AVX512-BF16 GEMM,
where compiled); ``kernels.attention_gemm()`` names the one chosen for this CPU.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_native_kernels as tk

from ortwrap import kernels
from ortwrap._compat.torch import flash_attention_cpu

tk.attention_sessions = functools.cache(tk.attention_sessions)  # one session per kernel, not per call

#: (B, H, T, D), mask
CASES = [
    ((4, 12, 256, 64), "causal"),
    ((4, 12, 256, 64), "none"),
    ((8, 12, 128, 64), "causal"),
    ((1, 12, 1024, 64), "causal"),
]


def best_ms(fn, n: int = 10, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - t0) / n)
    return best * 1e3


def case(shape, kind: str, chosen: str | None) -> dict[str, float]:
    """ms of flash attention and of each kernel / GEMM on one shape and mask."""
    b, h, t, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, t, d, generator=g).bfloat16() for _ in range(4))
    mask, scale = tk._mask(kind, (b, h, t, t), g), 1 / math.sqrt(d)
    forward, backward = flash_attention_cpu()

    def flash_fwd():
        return forward(q, k, v, 0.0, False, attn_mask=mask, scale=scale)

    def flash_both():
        out, lse = flash_fwd()
        backward(dout, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)

    row = {"flash fwd": best_ms(flash_fwd), "flash fwd+bwd": best_ms(flash_both)}
    for gemm in kernels.attention_gemms():
        kernels.set_attention_gemm(gemm)
        for layout in ("heads", "bthd"):
            row[f"{gemm} {layout}"] = best_ms(
                functools.partial(tk.run_attention, q, k, v, mask, scale, dout, layout), 5
            )
    if chosen is not None:
        kernels.set_attention_gemm(chosen)
    return row


def main() -> None:
    torch.set_num_threads(1)
    kernels.set_threads(1)
    chosen = kernels.attention_gemm()
    print(f"bf16 GEMMs here: {kernels.attention_gemms()}; chosen for this CPU: {chosen}; ms, CPU time, one thread")
    for shape, kind in CASES:
        row = case(shape, kind, chosen)
        print(f"  {shape} {kind:<6} " + "  ".join(f"{n} {ms:.1f}" for n, ms in row.items()))


if __name__ == "__main__":
    main()
