"""Import of ONNX Runtime's training build, with one clear error when it is missing.

Never imports ``onnxruntime.training.ortmodule``: that is what ortwrap replaces, and it fails to
import on current PyTorch.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys

from .options import env_flag

#: CUDA 11.8 / cuDNN 8 libraries that onnxruntime-training 1.19.2 (CUDA build) links against, as
#: installed by the ``ortwrap[cuda]`` extra (NVIDIA's PyPI wheels), in load order.
_CUDA_LIBRARIES = (
    "cuda_runtime/lib/libcudart.so.11*",
    "cuda_nvrtc/lib/libnvrtc.so.11*",
    "cublas/lib/libcublasLt.so.11",
    "cublas/lib/libcublas.so.11",
    "cufft/lib/libcufft.so.10",
    "curand/lib/libcurand.so.10",
    "cudnn/lib/libcudnn*.so.8",
)


def _preload_cuda_libraries() -> list[str]:
    """Load the CUDA 11 libraries of the ``nvidia-*-cu11`` wheels globally, so that ORT's CUDA
    provider finds them without LD_LIBRARY_PATH (torch's own CUDA 12 libraries have other sonames
    and are unaffected). Does nothing for the CPU build. Returns the paths loaded."""
    try:
        importlib.metadata.distribution("onnxruntime-training")
    except importlib.metadata.PackageNotFoundError:
        return []
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    loaded = []
    for root in spec.submodule_search_locations:
        for pattern in _CUDA_LIBRARIES:
            for path in sorted(glob.glob(os.path.join(root, pattern))):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    loaded.append(path)
                except OSError:
                    pass
    return loaded


PRELOADED_CUDA_LIBRARIES = _preload_cuda_libraries() if env_flag("ORTWRAP_PRELOAD_CUDA", True) else []


class _NoORTModule(importlib.abc.MetaPathFinder):
    """Refuses ``onnxruntime.training`` while ``onnxruntime`` is first imported.

    The training wheel's ``onnxruntime/__init__.py`` imports ``onnxruntime.training.ortmodule`` to
    validate the package: ORTModule, which imports DeepSpeed and reaches into torch internals at
    import time, and on newer torch fails there (an error ``import onnxruntime`` re-raises).
    ortwrap replaces it and needs only the C module ``onnxruntime.capi._pybind_state``: for the
    length of that first import, ``onnxruntime.training`` raises ImportError, which onnxruntime
    takes as "no ORTModule in this package". Importing it later (by the user) is unaffected.
    """

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "onnxruntime.training" or name.startswith("onnxruntime.training."):
            raise ImportError(f"{name} is not imported by ortwrap")
        return None


#: The CPython versions ONNX Runtime publishes its 1.19.2 training wheels for.
TRAINING_WHEEL_PYTHONS = ((3, 10), (3, 11), (3, 12))


def missing_ort_message(version: tuple[int, int] = sys.version_info[:2]) -> str:
    """What ``import ortwrap`` says when ``onnxruntime`` cannot be imported, on Python ``version``."""
    pythons = ", ".join(f"{major}.{minor}" for major, minor in TRAINING_WHEEL_PYTHONS)
    if version not in TRAINING_WHEEL_PYTHONS:
        return (
            f"ortwrap needs ONNX Runtime's training build (onnxruntime-training 1.19.2), which is published for "
            f"CPython {pythons} only, and this is Python {version[0]}.{version[1]}: the ortwrap[cpu] and "
            f"ortwrap[cuda] extras install nothing here. Use a Python {pythons} environment, e.g. "
            f"`python3.12 -m venv .venv`, then pip install 'ortwrap[cpu]' (or 'ortwrap[cuda]'). Or, on this Python, "
            "train on the maintained onnxruntime: pip install 'ortwrap[ort]' (or 'ortwrap[ort-gpu]'), "
            "ORTWrap(model, engine='onnxruntime')."
        )
    return (
        "ortwrap needs ONNX Runtime's training build: pip install 'ortwrap[cpu]' "
        "(onnxruntime-training-cpu==1.19.2) or 'ortwrap[cuda]' (onnxruntime-training==1.19.2), or the maintained "
        "onnxruntime for engine='onnxruntime': 'ortwrap[ort]' / 'ortwrap[ort-gpu]'. "
        f"Install only one of them, and not plain onnxruntime beside it (training wheels exist for CPython {pythons})."
    )


_blocker = _NoORTModule()
sys.meta_path.insert(0, _blocker)
try:
    import onnxruntime as ort
    from onnxruntime.capi import _pybind_state as C
except ImportError as e:
    raise ImportError(missing_ort_message()) from e
finally:
    sys.meta_path.remove(_blocker)

#: Whether this onnxruntime is the training build (OrtModuleGraphBuilder, TrainingAgent): the
#: ``"training"`` engine needs it; the ``"onnxruntime"`` engine (ortwrap/engines/) needs only
#: InferenceSession, which every build has. Code of the training engine checks it before using ``C``'s
#: training classes (``require_training``).
TRAINING_BUILD = hasattr(C, "OrtModuleGraphBuilder") and hasattr(C, "TrainingAgent")


def require_training() -> None:
    """Raise ImportError unless the training build is installed (the training engine's code paths)."""
    if not TRAINING_BUILD:
        raise ImportError(
            f"the installed onnxruntime {ort.__version__} is not a training build (no OrtModuleGraphBuilder): "
            "ORTWrap's 'training' engine needs onnxruntime-training-cpu==1.19.2 or onnxruntime-training==1.19.2 "
            "(ortwrap[cpu] / ortwrap[cuda]); with the maintained onnxruntime use ORTWrap(..., engine='onnxruntime')"
        )


__all__ = ["PRELOADED_CUDA_LIBRARIES", "TRAINING_BUILD", "C", "ort", "require_training"]
