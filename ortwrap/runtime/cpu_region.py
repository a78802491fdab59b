"""ONNX Runtime's, ortwrap's kernels' and PyTorch's large CPU blocks from one best-fit region while
ORT runs (Linux).

Inside a CPU training run, ORT's blocks (activations, gradients), the kernels' outputs and PyTorch's
(the bridge's GEMM outputs and weight casts) alternate at a fine grain, each surrounded by small
chunks that glibc's per-thread cache keeps in use; with glibc's heap the freed memory between them
does not merge, and the backward extends the heap (GPT-2 small, bf16 autocast, batch 4: 1.04-1.10x
eager's peak RSS; docs/performance.md, "Both libraries' large blocks in one region"). So for the
duration of each ORT run of a CPU graph the runners (:func:`bracket`) route every request of at
least 1 MiB from the three to one best-fit region of ortwrap's, whose freed blocks merge whatever
glibc does around them:

- PyTorch's: a ``c10::Allocator`` installed with ``c10::SetCPUAllocator`` at the first enter and
  the previous one restored at the last exit (smaller requests go to the previous one);
- ORT's and the kernels': the GOT slots of ``posix_memalign``/``aligned_alloc``/``free`` in ORT's
  Python module and in the kernels' library point at the region's functions (the training wheel
  exports no C API to register an allocator); outside the runs, and for small requests, they call
  the C library's.

Every block is freed through the region's deleter wherever and whenever its tensor dies (a pointer
is routed by the address range it lies in), so a block allocated in a run may outlive it. The
region keeps its pages (the next step reuses them); :func:`release` gives the free ones back.

The allocator is C++ (``_compat/_cpu_region.cpp``, the compat boundary's one C++ file: it uses
torch's C++ allocator API), compiled on first use against the installed torch (about 1 s, cached).
Where it cannot be built (no C++ compiler, no torch headers) the runs use the libraries' own
allocators as before, with one warning; ``cpu_region=False`` (``ORTWRAP_CPU_REGION=0``) turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import warnings
from collections.abc import Callable

import torch

from ..bridge._native import LOADED, NativeBuildError, load_torch_cxx

_log = logging.getLogger("ortwrap")

_COMPAT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_compat")

#: Names of :func:`stats`' fields, in the C function's order.
STAT_FIELDS = ("blocks", "refused", "in_use", "peak_in_use", "touched", "free", "free_ranges", "hooked_blocks")

#: The ORT library whose CPU allocator's posix_memalign/free are routed to the region (the module
#: that holds ORT's CPU provider in the 1.19.2 training wheel); the kernels' (``LOADED["_cpu"]``) too.
ORT_LIBRARY = b"onnxruntime_pybind11_state"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled region allocator, or None where it cannot exist here (warned once)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = load_torch_cxx(
            "_cpu_region",
            _COMPAT_DIR,
            os.path.dirname(os.path.abspath(torch.__file__)),
            torch.__version__,
            bool(torch.compiled_with_cxx11_abi()),
        )
    except NativeBuildError as e:
        warnings.warn(
            f"ortwrap: the region allocator for PyTorch's large CPU blocks during ONNX Runtime's runs could not be "
            f"built, so they come from PyTorch's own allocator (peak memory may be a few percent higher; results are "
            f"the same): {e}. Set cpu_region=False (ORTWRAP_CPU_REGION=0) to silence this.",
            stacklevel=4,
        )
        return None
    lib.ortwrap_region_enter.restype = ctypes.c_int
    lib.ortwrap_region_exit.restype = None
    lib.ortwrap_region_release.restype = ctypes.c_uint64
    lib.ortwrap_region_hook.argtypes = [ctypes.c_char_p]
    lib.ortwrap_region_hook.restype = ctypes.c_int
    return lib


def _hook(lib: ctypes.CDLL) -> None:
    """Route ORT's and the loaded kernels' large blocks to the region (idempotent; the kernels load
    on first use, so each new runner asks again)."""
    patched = lib.ortwrap_region_hook(ORT_LIBRARY)
    kernels = LOADED.get("_cpu")
    if kernels:
        patched += lib.ortwrap_region_hook(os.fsencode(kernels))
    _log.debug("cpu region: %d allocation slots of ORT and ortwrap's kernels routed to it", patched)


def bracket() -> tuple[Callable[[], int], Callable[[], None]] | None:
    """``(enter, exit)`` to call around each ORT run of a CPU graph, or None without the allocator.

    ``enter()`` returns 1 when it installed the region (or an outer run had), 0 when another
    allocator of higher priority is installed; call ``exit()`` only after a 1."""
    lib = library()
    if lib is None:
        return None
    _hook(lib)
    return lib.ortwrap_region_enter, lib.ortwrap_region_exit


def stats() -> dict[str, int]:
    """The region's counters: blocks served to PyTorch, requests refused, bytes in use and at most in
    use, bytes of address space touched, bytes free inside it and in how many ranges, blocks served
    to ORT and the kernels (all zero without the region)."""
    out = (ctypes.c_uint64 * len(STAT_FIELDS))()
    lib = library()
    if lib is not None:
        lib.ortwrap_region_stats(out)
    return dict(zip(STAT_FIELDS, (int(x) for x in out)))


def release() -> int:
    """Give the pages of the region's free ranges back to the OS (the next run faults them in again);
    the bytes released. For a long pause between training and other work in the same process."""
    lib = library()
    return int(lib.ortwrap_region_release()) if lib is not None else 0
