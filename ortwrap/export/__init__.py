"""Stage 1: torch.nn.Module -> ONNX (``dynamo.py``, the default, and ``torchscript.py``: each a
capture and a translation, two build stages)."""

from __future__ import annotations

from ..graph.model import ExportedModel

__all__ = ["ExportedModel"]
