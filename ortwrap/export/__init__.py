"""Stage 1: torch.nn.Module -> ONNX."""

from __future__ import annotations

from ..graph.model import ExportedModel
from .dynamo import export_dynamo
from .torchscript import export_torchscript

__all__ = ["ExportedModel", "export_dynamo", "export_torchscript"]
