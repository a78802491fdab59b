"""Stage 4: run forward and backward graphs in ONNX Runtime; torch <-> OrtValue via DLPack."""

from __future__ import annotations

from .session import InferenceRunner, TrainingRunner, session_options

__all__ = ["InferenceRunner", "TrainingRunner", "session_options"]
