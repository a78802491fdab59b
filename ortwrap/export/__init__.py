"""Stage 1: torch.nn.Module -> ONNX."""

from __future__ import annotations

from .dynamo import export_dynamo
from .model import ExportedModel
from .torchscript import export_torchscript

__all__ = ["ExportedModel", "export_dynamo", "export_torchscript"]
