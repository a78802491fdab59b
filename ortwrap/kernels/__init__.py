"""ortwrap's own CPU kernels, run inside ONNX Runtime graphs.

ORT 1.19.2's CPU kernels for the ops every transformer trains through besides its GEMMs are far
slower than PyTorch's (measured on the (b) GPT LM, 2 cores, ``benchmarks/profile_lm.py``):

* the erf GELU: a dozen memory-bound elementwise kernels forward and backward, ~4 ms per
  8x128x1024 activation against ~0.8 ms for PyTorch's ``gelu`` + ``gelu_backward``;
* ``LayerNormalizationGrad``: one Eigen expression with four full-size temporaries on one thread
  (~0.5 ms per 1024x256, ~7 ms of the step with the forward);
* ``GatherNDGrad``/``GatherGrad`` (embedding gradients): a scalar loop with a 64-bit division per
  element, or adds under one mutex (~2 ms for a 1024x256 lookup);
* ``SoftmaxCrossEntropyLoss`` and its gradient, single-threaded (~2.4 ms for 1024x512 logits,
  ~1 ms in PyTorch);
* ``SoftmaxGrad`` (attention), ~0.3 ms per 8x4x128x128 (the softmax kernel's forward is only as
  fast as ORT's; its backward takes half the time).

Running PyTorch's kernels inside the graph instead (ATen nodes, PythonOps) does not help: every
call costs ~1 ms on 2 cores, because PyTorch's OpenMP workers spin after each parallel region and
take a core from ORT's next kernel. So ortwrap brings its own: ``_cpu.c``, plain C compiled for
the machine it runs on (``-O3 -march=native``, about 1 s, cached), one pass over the data per
kernel, split over a small fork-join pool whose workers sleep between kernels.

They run as ``org.pytorch.aten::ATen`` nodes with ``operator="ortwrap_cpu::<name>"``: ORT's ATen
kernel hands them to ortwrap's executor (``bridge/_aten.c``), which calls ``_cpu.c`` directly,
without Python. Their gradients are ORT gradient definitions registered once per process
(:func:`install`), so the gradient builder pairs each forward kernel with its backward kernel
(``grad.aten.mark_used_outputs`` then tells each node which of its outputs the graph uses).
``passes/native_cpu_kernels.py`` rewrites the matching ONNX nodes; ``Options.native_kernels``
(``ORTWRAP_NATIVE_KERNELS``) turns it off.

Each kernel is declared once, in ``ortwrap/ops/kernels.py`` (``KERNELS``): its name, typed inputs and
outputs, gradient, and the ONNX ops its rewrite replaces; ``_cpu.c``'s ``kOps`` carries the same
signatures and :func:`install` checks the two agree.

One more replaces a PyTorch op rather than ONNX ops: ``attention_bf16`` (and its backward), softmax
attention on bf16 q, k^T, v, which ``passes/native_attention.py`` puts in place of PyTorch's flash
attention on the native bf16 route (docs/performance.md, "bf16 attention"). Its GEMMs are MKL's
``cblas_gemm_bf16bf16f32`` (bf16 inputs, float32 results), found in PyTorch's own library when the
kernels load (:func:`attention_available`), or on CPUs other than Intel's with AVX512-BF16 (where
MKL's bf16 path runs at its float32 rate) ``_cpu.c``'s own AVX512-BF16 GEMM
(:func:`choose_attention_gemm`); the rest is C like the other kernels.

float32, and bfloat16 where a kernel's signature says so. ``erf`` is Abramowitz & Stegun 7.1.26
(absolute error <= 1.5e-7); sums run in a fixed order, so results are deterministic.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings

import torch

from .._compat.torch import bundled_mkl_library
from ..bridge import aten
from ..bridge._native import NativeBuildError, load
from ..cpu import cpu_is_intel
from ..grad.aten import register_gradient
from ..ops import KERNELS, check_kernel_table

PREFIX = aten.NATIVE_PREFIX
_HERE = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def install() -> ctypes.CDLL:
    """Build (first time on a machine only), load and connect the kernels; register their gradients.

    Raises:
        NativeBuildError: no C compiler, or the build failed.
        KernelTableError: ``_cpu.c``'s table disagrees with ``ops.KERNELS``.
    """
    lib = load("_cpu", _HERE, native_code=True)
    check_kernel_table(compiled_table(lib))
    lib.ortwrap_cpu_set_threads.argtypes = [ctypes.c_int]
    lib.ortwrap_cpu_set_threads.restype = ctypes.c_int
    lib.ortwrap_cpu_set_serial.argtypes = [ctypes.c_int]
    lib.ortwrap_cpu_set_serial.restype = None
    lib.ortwrap_cpu_set_bf16_gemm.argtypes = [ctypes.c_char_p]
    lib.ortwrap_cpu_set_bf16_gemm.restype = ctypes.c_int
    mkl = bundled_mkl_library()
    found = mkl is not None and lib.ortwrap_cpu_set_bf16_gemm(mkl.encode()) == 0
    lib.ortwrap_cpu_set_bf16_gemm_kind.argtypes = [ctypes.c_int]
    lib.ortwrap_cpu_set_bf16_gemm_kind.restype = ctypes.c_int
    own = bool(lib.ortwrap_cpu_own_bf16_gemm())
    lib.ortwrap_bf16_gemms = [k for k, ok in (("mkl", found), ("own", own)) if ok]
    lib.ortwrap_bf16_gemm = choose_attention_gemm(mkl=found, own=own, intel=cpu_is_intel())
    if lib.ortwrap_bf16_gemm is not None:
        lib.ortwrap_cpu_set_bf16_gemm_kind(int(lib.ortwrap_bf16_gemm == "own"))
    aten.set_native(ctypes.cast(lib.ortwrap_cpu_run, ctypes.c_void_p).value)
    for k in KERNELS:
        g = k.gradient
        if g is not None:
            register_gradient(PREFIX + k.name, "", list(g.inputs), list(g.outputs), PREFIX + g.backward, set(g.stop))
    return lib


def compiled_table(lib: ctypes.CDLL) -> dict[str, str]:
    """Name -> signature of every kernel in the compiled ``kOps`` table."""
    fn = lib.ortwrap_cpu_kernel
    fn.argtypes = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)]
    fn.restype = ctypes.c_int
    table, k = {}, 0
    name, sig = ctypes.c_char_p(), ctypes.c_char_p()
    while fn(k, ctypes.byref(name), ctypes.byref(sig)) == 0:
        table[name.value.decode()] = sig.value.decode()
        k += 1
    return table


def choose_attention_gemm(*, mkl: bool, own: bool, intel: bool) -> str | None:
    """The bf16 GEMM the attention kernels call: ``"mkl"`` (``cblas_gemm_bf16bf16f32`` from PyTorch's
    library), ``"own"`` (``_cpu.c``'s AVX512-BF16 GEMM, compiled where the CPU has the instructions) or
    None (neither: flash attention stays).

    MKL picks its bf16 kernels by CPU vendor: on Intel it runs AMX or its AVX512-BF16 kernels, on an
    AMD EPYC with avx512_bf16 it ran the attention's GEMMs at ~90 GFLOP/s, its float32 rate, where
    the own GEMM ran ~150 (docs/performance.md, "bf16 attention on AMD"). So: MKL on Intel, the own
    GEMM elsewhere where it was compiled, MKL where it was not.
    """
    if mkl and (intel or not own):
        return "mkl"
    return "own" if own else None


def attention_gemm() -> str | None:
    """The bf16 GEMM the attention kernels call now (:func:`choose_attention_gemm`), None if none."""
    try:
        return install().ortwrap_bf16_gemm
    except NativeBuildError:
        return None


def attention_gemms() -> list[str]:
    """The bf16 GEMMs the attention kernels can call in this process (``"mkl"``, ``"own"``)."""
    try:
        return list(install().ortwrap_bf16_gemms)
    except NativeBuildError:
        return []


def set_attention_gemm(kind: str) -> None:
    """Make the attention kernels call ``kind`` (one of :func:`attention_gemms`; tests, benchmarks)."""
    lib = install()
    if kind not in lib.ortwrap_bf16_gemms:
        raise ValueError(f"bf16 GEMM {kind!r} is not available here: {lib.ortwrap_bf16_gemms}")
    lib.ortwrap_cpu_set_bf16_gemm_kind(int(kind == "own"))
    lib.ortwrap_bf16_gemm = kind


def attention_available() -> bool:
    """Whether ``attention_bf16`` can run: the kernels load and a bf16 GEMM (bf16 inputs, float32
    results) is there for it to call (:func:`choose_attention_gemm`). ``passes/native_attention.py``
    keeps PyTorch's flash attention otherwise."""
    return attention_gemm() is not None


def cached_bytes(release: bool = False) -> int:
    """Bytes of freed kernel outputs kept for reuse (at most 32 MiB); ``release=True`` frees them, and
    the buffers MKL keeps for the attention kernels' GEMMs (4.3 MB per thread that ran one)."""
    lib = install()
    lib.ortwrap_cpu_cached_bytes.argtypes = [ctypes.c_int]
    lib.ortwrap_cpu_cached_bytes.restype = ctypes.c_size_t
    return int(lib.ortwrap_cpu_cached_bytes(1 if release else 0))


def release_cached() -> None:
    """Free the kernels' cached output blocks, if the kernels are loaded; run after each backward.

    NOTE: between the end of a backward and the next forward nothing reads the cached blocks (up
    to the cache's 32 MiB; 94-132 MiB on GPT-2 small before the cap), right when the optimizer step
    allocates its temporaries: freed, glibc hands the same (resident) heap memory to the optimizer,
    and the next forward gets blocks back from the heap. GPT-2 small's fp32 peak RSS fell by 36 MiB
    at no measurable step cost (docs/performance.md, "Memory").
    """
    if install.cache_info().currsize:
        cached_bytes(release=True)


def set_threads(threads: int) -> None:
    """Let the kernels use ``threads`` threads (the pool only grows)."""
    install().ortwrap_cpu_set_threads(max(1, int(threads)))


def serial_setter():
    """``f(1)``: the kernels that the calling thread's next ORT runs call stay on that thread (a graph
    ORT runs on one intra-op thread); ``f(0)``: they use the pool. Called by the runners before each
    run of a graph with these kernels; the results are the same either way."""
    return install().ortwrap_cpu_set_serial


_warned = False


def available(threads: int | None = None) -> bool:
    """Whether the kernels can run in this process (building them the first time); warns once if not."""
    global _warned
    try:
        set_threads(threads or torch.get_num_threads())
    except NativeBuildError as e:
        if not _warned:
            _warned = True
            warnings.warn(
                f"ortwrap: its native CPU kernels could not be built, so ONNX Runtime's own (slower) kernels run "
                f"GELU, LayerNorm, softmax and embedding gradients; the model still trains in ONNX Runtime, with the "
                f"same results: {e}. Set native_kernels=False (ORTWRAP_NATIVE_KERNELS=0) to silence this.",
                stacklevel=3,
            )
        return False
    return True
