"""Stage 2: ONNX -> ONNX rewrites, one pass per module; ``pipeline.py`` lists them in order."""

from __future__ import annotations

from .pipeline import PassRecord, default_passes, run_passes

__all__ = ["PassRecord", "default_passes", "run_passes"]
