"""Stage 3: forward ONNX -> forward+backward graph, with ONNX Runtime's training graph builder."""

from __future__ import annotations

from .builder import GraphInfo, TrainingGraph, build_graph

__all__ = ["GraphInfo", "TrainingGraph", "build_graph"]
