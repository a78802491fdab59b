"""The typed result of a pass with side results for the build."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

__all__ = ["PassResult"]


@dataclass
class PassResult(ir.passes.PassResult):
    """A pass's result with side results for the build: subclasses add typed fields, and the pass's
    entry in ``passes/pipeline.py`` (``PlannedPass.provides``) names the build values they give.
    Nothing reads attributes back from a pass object."""
