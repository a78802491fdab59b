"""ortwrap: train PyTorch modules on ONNX Runtime's training engine.

``model = ORTWrap(model)`` in an otherwise unchanged training loop.
"""

from __future__ import annotations

from .api import FallbackWarning, ORTWrap
from .errors import (
    ExportError,
    GradientBuildError,
    ORTWrapError,
    PassError,
    RuntimeRunError,
    SessionError,
    UnsupportedFunctionError,
    UnsupportedInputError,
    VerificationError,
)
from .options import ENV_VARS, Options
from .program import BuildArtifacts

__version__ = "0.1.0"

__all__ = [
    "ENV_VARS",
    "BuildArtifacts",
    "ExportError",
    "FallbackWarning",
    "GradientBuildError",
    "ORTWrap",
    "ORTWrapError",
    "Options",
    "PassError",
    "RuntimeRunError",
    "SessionError",
    "UnsupportedFunctionError",
    "UnsupportedInputError",
    "VerificationError",
]
