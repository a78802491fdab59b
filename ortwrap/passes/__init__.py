"""Stage 2: ONNX -> ONNX rewrites, one pass per module; ``pipeline.py`` lists them in order."""

from __future__ import annotations

from .pipeline import PassRecord, default_passes, run_pass
from .shape_related import ShapeRelatedNode, explain_shape_related_nodes, shape_related_nodes

__all__ = [
    "PassRecord",
    "ShapeRelatedNode",
    "default_passes",
    "explain_shape_related_nodes",
    "run_pass",
    "shape_related_nodes",
]
