"""Engines: what trains the wrapped module once ortwrap has its graph.

- ``"training"``: ONNX Runtime's training build (``onnxruntime-training`` 1.19.2): ortwrap exports
  the module, ORT's ``OrtModuleGraphBuilder`` builds the gradient graph and its ``TrainingAgent``
  runs forward and backward (``export/``, ``passes/``, ``grad/``, ``runtime/``).
- ``"onnxruntime"``: the maintained ONNX Runtime (``onnxruntime>=1.20`` or ``onnxruntime-gpu``):
  the gradients come from PyTorch's AOTAutograd, and ORT runs the partitioned forward and backward
  graphs in two InferenceSessions (``engines/onnxruntime/``, docs/engines.md).

Both install the Python module ``onnxruntime``, so one environment has one of them; the
``"onnxruntime"`` engine also runs on the training build's InferenceSession. Nothing here imports
onnxruntime until asked.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any, Protocol

__all__ = ["ENGINES", "Engine", "available_engines", "is_onnxruntime_available", "is_training_available"]

#: Engine names, in the order ``"auto"`` prefers them.
ENGINES = ("training", "onnxruntime")


class Engine(Protocol):
    """What ``ORTWrap`` asks of an engine other than the training build's (api.py's dispatch point).

    An engine is made once per wrapper and keeps its own compiled graphs.
    """

    name: str

    def __call__(self, wrapper: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``wrapper.module(*args, **kwargs)`` on the engine, with eager's outputs and gradients."""

    def clear(self) -> None:
        """Forget every compiled graph (the module changed)."""


@functools.cache
def is_training_available() -> bool:
    """Whether ONNX Runtime's training build (OrtModuleGraphBuilder, TrainingAgent) imports."""
    try:
        from .._ort import TRAINING_BUILD
    except ImportError:
        return False
    return TRAINING_BUILD


@functools.cache
def is_onnxruntime_available() -> bool:
    """Whether an ONNX Runtime with InferenceSession and IOBinding imports (any build: the maintained
    ``onnxruntime``/``onnxruntime-gpu``, or the training build's)."""
    try:
        from .._ort import ort
    except ImportError:
        return False
    return hasattr(ort, "InferenceSession")


def available_engines() -> tuple[str, ...]:
    """The engines this environment can run, in ``"auto"``'s order of preference."""
    return tuple(
        name for name, ok in (("training", is_training_available()), ("onnxruntime", is_onnxruntime_available())) if ok
    )


def onnxruntime_distribution() -> str | None:
    """The installed distribution that provides the module ``onnxruntime`` (name==version), or None."""
    for dist in ("onnxruntime-training", "onnxruntime-training-cpu", "onnxruntime-gpu", "onnxruntime"):
        try:
            return f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def resolve(name: str) -> str:
    """The engine ``name`` (an option value) stands for: ``"auto"`` -> ``"training"`` where the
    training build is installed, else ``"onnxruntime"``.

    Raises:
        ImportError: the engine's runtime is not installed, saying what to install.
    """
    if name == "auto":
        return "training" if is_training_available() else "onnxruntime"
    if name == "training" and not is_training_available():
        raise ImportError(
            "ORTWrap(engine='training') needs ONNX Runtime's training build (pip install 'ortwrap[cpu]' or "
            f"'ortwrap[cuda]', CPython 3.10-3.12); installed: {onnxruntime_distribution() or 'no onnxruntime'}. "
            "engine='onnxruntime' trains on the maintained onnxruntime (pip install 'ortwrap[ort]')"
        )
    if name == "onnxruntime" and not is_onnxruntime_available():
        raise ImportError(
            "ORTWrap(engine='onnxruntime') needs onnxruntime: pip install 'ortwrap[ort]' (or 'ortwrap[ort-gpu]')"
        )
    return name


def make_engine(name: str, options: Any) -> Engine | None:
    """The engine object for resolved engine ``name`` (None for ``"training"``: api.py's own path)."""
    if name == "training":
        return None
    from .onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(options)
