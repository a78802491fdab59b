"""Stage 2: ONNX -> ONNX rewrites, one pass per module; ``pipeline.py`` lists them in order."""

from __future__ import annotations

from .pipeline import PassRecord, PlannedPass, default_passes, planned_passes, run_pass
from .result import PassResult
from .shape_related import ShapeRelatedNode, explain_shape_related_nodes, shape_related_nodes

__all__ = [
    "PassRecord",
    "PassResult",
    "PlannedPass",
    "ShapeRelatedNode",
    "default_passes",
    "explain_shape_related_nodes",
    "planned_passes",
    "run_pass",
    "shape_related_nodes",
]
