"""Exception classes, one per phase of the ortwrap pipeline.

Every error names the phase it came from and, where it can, the argument, node or Function
involved and what the user can do. Errors raised because a lower layer failed are chained to
that cause with ``raise ... from``.
"""

from __future__ import annotations

__all__ = [
    "ExportError",
    "GradientBuildError",
    "ORTWrapError",
    "PassError",
    "RuntimeRunError",
    "SessionError",
    "UnsupportedFunctionError",
    "UnsupportedInputError",
    "UnsupportedOutputError",
    "UnsupportedTorchError",
    "VerificationError",
]


class ORTWrapError(RuntimeError):
    """Base class of every error ortwrap raises.

    Attributes:
        phase: the pipeline stage the error belongs to (``"export"``, ``"passes"``, ...).
    """

    phase = "ortwrap"

    def __init__(self, message: str) -> None:
        super().__init__(f"[ortwrap:{self.phase}] {message}")


class ExportError(ORTWrapError):
    """The module could not be exported to ONNX."""

    phase = "export"


class PassError(ORTWrapError):
    """A graph pass refused or failed to rewrite the exported ONNX model."""

    phase = "passes"


class GradientBuildError(ORTWrapError):
    """ONNX Runtime's gradient graph builder rejected the model."""

    phase = "gradient-build"


class SessionError(ORTWrapError):
    """ONNX Runtime could not create an execution session for the built graphs."""

    phase = "session"


class RuntimeRunError(ORTWrapError):
    """ONNX Runtime failed while running a forward or backward graph."""

    phase = "runtime"


class UnsupportedInputError(ORTWrapError, TypeError):
    """An input of ``forward`` has a type or layout ortwrap cannot feed to ONNX Runtime."""

    phase = "inputs"


class UnsupportedOutputError(ExportError, TypeError):
    """An output of ``forward`` holds tensors in an object ortwrap cannot take apart and rebuild
    from each call's values."""

    phase = "outputs"


def output_error_in(e: BaseException) -> UnsupportedOutputError | None:
    """The UnsupportedOutputError that ``e`` is or wraps (through ``__cause__``/``__context__``), if any:
    an exporter that reports it as its own failure would hide that no exporter can take those outputs."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, UnsupportedOutputError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


class UnsupportedFunctionError(ORTWrapError, TypeError):
    """A torch.autograd.Function in the module cannot run inside ONNX Runtime (non-tensor outputs)."""

    phase = "bridge"


class UnsupportedTorchError(ORTWrapError):
    """The running torch lacks a private API ortwrap needs (see ``ortwrap._compat.torch``)."""

    phase = "compat"


class VerificationError(ORTWrapError):
    """A verification run found ONNX Runtime's results differ from eager PyTorch."""

    phase = "verify"


#: Phases whose failure may fall back to PyTorch (when the options allow it).
FALLBACK_PHASES: tuple[type[ORTWrapError], ...] = (ExportError, PassError, GradientBuildError, SessionError)
