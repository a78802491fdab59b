"""ortwrap: train PyTorch modules on ONNX Runtime's training engine.

``model = ORTWrap(model)`` in an otherwise unchanged training loop.
"""

from __future__ import annotations

from ._compat.torch import UnsupportedTorchWarning, check_torch_version
from ._version import __version__

check_torch_version()  # before anything else: a clear ImportError on a torch older than supported

from ._logging import get_verbosity, set_verbosity  # noqa: E402
from .api import FallbackWarning, ORTWrap  # noqa: E402
from .build import BuildArtifacts  # noqa: E402
from .engines import available_engines  # noqa: E402
from .errors import (  # noqa: E402
    ExportError,
    GradientBuildError,
    ORTWrapError,
    PassError,
    RuntimeRunError,
    SessionError,
    UnsupportedFunctionError,
    UnsupportedInputError,
    UnsupportedOutputError,
    UnsupportedTorchError,
    VerificationError,
)
from .integrations import builtin as _builtin_integrations  # noqa: E402,F401 (registers them)
from .options import ENV_VARS, Options  # noqa: E402

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
    "UnsupportedOutputError",
    "UnsupportedTorchError",
    "UnsupportedTorchWarning",
    "VerificationError",
    "__version__",
    "available_engines",
    "get_verbosity",
    "set_verbosity",
]
