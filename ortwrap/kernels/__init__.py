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
(``bridge.aten.mark_used_outputs`` then tells each node which of its outputs the graph uses).
``passes/native_cpu_kernels.py`` rewrites the matching ONNX nodes; ``Options.native_kernels``
(``ORTWRAP_NATIVE_KERNELS``) turns it off.

=======================  ========================================  ================================
kernel                   inputs                                    outputs
=======================  ========================================  ================================
gelu                     x                                         y = x * Phi(x)
gelu_backward            dy, x                                     dx
gelu_tanh                x                                         0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))
gelu_tanh_backward       dy, x                                     dx
layer_norm               x, weight, bias, eps (f32), axis (i64)    y, mean, rstd (shape[:axis]+1s)
layer_norm_backward      dy, x, weight, mean, rstd, axis           dx, dweight, dbias
embedding                weight, indices (i64)                     weight[indices]
embedding_backward       dy, indices, weight                       dweight
softmax                  x (over the last dimension)               y
softmax_backward         dy, y                                     dx
cross_entropy            scores [n, c], labels (i64), ignore_index loss, log_prob
                         (i64), reduction (i64: none, mean, sum)
cross_entropy_backward   dloss, log_prob, labels, ignore_index,    dscores
                         reduction
=======================  ========================================  ================================

float32 only. ``erf`` is Abramowitz & Stegun 7.1.26 (absolute error <= 1.5e-7); sums run in a
fixed order, so results are deterministic.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings

import torch

from ..bridge import aten
from ..bridge._native import NativeBuildError, load

PREFIX = aten.NATIVE_PREFIX
_HERE = os.path.dirname(os.path.abspath(__file__))

#: forward kernel -> (gradient node inputs, gradient node outputs, backward kernel, stop-gradient inputs)
GRADIENTS: dict[str, tuple[list[str], list[str], str, set[int]]] = {
    "gelu": (["GO(0)", "I(0)"], ["GI(0)"], "gelu_backward", set()),
    "gelu_tanh": (["GO(0)", "I(0)"], ["GI(0)"], "gelu_tanh_backward", set()),
    "layer_norm": (
        ["GO(0)", "I(0)", "I(1)", "O(1)", "O(2)", "I(4)"],
        ["GI(0)", "GI(1)", "GI(2)"],
        "layer_norm_backward",
        {3, 4},
    ),
    "embedding": (["GO(0)", "I(1)", "I(0)"], ["GI(0)"], "embedding_backward", {1}),
    "cross_entropy": (["GO(0)", "O(1)", "I(1)", "I(2)", "I(3)"], ["GI(0)"], "cross_entropy_backward", {1, 2, 3}),
    "softmax": (["GO(0)", "O(0)"], ["GI(0)"], "softmax_backward", set()),
}


@functools.cache
def install() -> ctypes.CDLL:
    """Build (first time on a machine only), load and connect the kernels; register their gradients.

    Raises:
        NativeBuildError: no C compiler, or the build failed.
    """
    lib = load("_cpu", _HERE, native_code=True)
    lib.ortwrap_cpu_set_threads.argtypes = [ctypes.c_int]
    lib.ortwrap_cpu_set_threads.restype = ctypes.c_int
    aten.set_native(ctypes.cast(lib.ortwrap_cpu_run, ctypes.c_void_p).value)
    for op, (inputs, outputs, backward, stop) in GRADIENTS.items():
        aten.register_gradient(PREFIX + op, "", inputs, outputs, PREFIX + backward, stop)
    return lib


def cached_bytes(release: bool = False) -> int:
    """Bytes of freed kernel outputs kept for reuse (at most 1 GiB); ``release=True`` frees them."""
    lib = install()
    lib.ortwrap_cpu_cached_bytes.argtypes = [ctypes.c_int]
    lib.ortwrap_cpu_cached_bytes.restype = ctypes.c_size_t
    return int(lib.ortwrap_cpu_cached_bytes(1 if release else 0))


def set_threads(threads: int) -> None:
    """Let the kernels use ``threads`` threads (the pool only grows)."""
    install().ortwrap_cpu_set_threads(max(1, int(threads)))


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
                f"GELU, LayerNorm and embedding gradients: {e}. Set native_kernels=False (ORTWRAP_NATIVE_KERNELS=0) "
                "to silence this.",
                stacklevel=3,
            )
        return False
    return True
