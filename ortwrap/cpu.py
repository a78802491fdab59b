"""What this CPU is, as ortwrap's CPU routes ask it: the vendor (MKL and oneDNN pick their kernels by
it) and hardware bfloat16 (``gemm_choice.py``: without it PyTorch's bf16 GEMMs are never faster)."""

from __future__ import annotations

import functools

from ._compat import torch as compat

__all__ = ["cpu_has_native_bf16", "cpu_is_intel"]


@functools.cache
def cpu_is_intel() -> bool:
    """Whether ``/proc/cpuinfo`` names an Intel CPU (MKL and oneDNN pick their kernels by vendor)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(ln.startswith("vendor_id") and "GenuineIntel" in ln for ln in f)
    except OSError:
        return False


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX512-BF16 or AMX), as torch's kernels see it.

    Without them torch's bfloat16 GEMMs convert to float32 and run several times slower than its
    float32 ones. Falls back to the flags in ``/proc/cpuinfo`` where torch's checks are missing.
    """
    try:
        return any(bool(check()) for check in compat.native_bf16_checks())
    except Exception:
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((ln.split() for ln in f if ln.startswith("flags")), [])
        except OSError:
            return False
        return "avx512_bf16" in flags or "amx_bf16" in flags
