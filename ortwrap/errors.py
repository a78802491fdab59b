"""Exception classes, one per phase of the ortwrap pipeline.

Every error names the phase it came from and, where it can, the argument, node or Function
involved and what the user can do. Errors raised because a lower layer failed are chained to
that cause with ``raise ... from``.
"""

from __future__ import annotations

import re

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
        #: the message without the ``[ortwrap:phase]`` prefix, and without the prefixes (and class
        #: names) of the ortwrap errors it quotes: an error wrapping another names one phase, once
        self.detail = _PREFIX.sub("", message)
        super().__init__(f"[ortwrap:{self.phase}] {self.detail}")


#: An ortwrap error's prefix quoted inside another's message, with the class name before it.
_PREFIX = re.compile(r"(?:\b[A-Z]\w*(?:Error|Exception): )?\[ortwrap:[\w-]+\] ")


def sentence(text: str) -> str:
    """``text`` ending with exactly one period, to be followed by another sentence."""
    text = text.rstrip()
    return text if text.endswith((".", "!", "?")) else text + "."


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


class FallbackWarning(UserWarning):
    """ORTWrap could not build the module for ONNX Runtime and runs it in PyTorch instead."""


#: Phases whose failure may fall back to PyTorch (when the options allow it).
FALLBACK_PHASES: tuple[type[ORTWrapError], ...] = (ExportError, PassError, GradientBuildError, SessionError)


def node_origin(name: str, metadata: dict[str, str]) -> dict[str, str]:
    """Where graph node ``name`` came from in the user's module, from what the exporter recorded:
    ``path`` (the submodule's path, ``""`` for the wrapped module itself), ``cls`` (its class name),
    ``op`` (the torch op, ``aten.embedding_bag``), ``line`` (``file:line`` of the user's code); each
    key only where known. The dynamo exporter records all four in the node's metadata; the
    TorchScript exporter only the path, in the node's name (``/module/bag/Loop``)."""
    import ast

    origin: dict[str, str] = {}
    scopes = metadata.get("pkg.torch.onnx.name_scopes")
    classes = metadata.get("pkg.torch.onnx.class_hierarchy")
    if scopes and classes:
        try:
            scopes_l, classes_l = ast.literal_eval(scopes), ast.literal_eval(classes)
        except (ValueError, SyntaxError):
            scopes_l, classes_l = [], []
        if len(scopes_l) == len(classes_l) and len(scopes_l) >= 2:
            last = classes_l[-1]
            is_op = ("." in last and last.split(".")[0] in ("aten", "prims", "ortwrap_ops")) or not last[:1].isupper()
            if is_op:
                parts = last.split(".")
                origin["op"] = ".".join(parts[:2]) if len(parts) >= 3 else last
                scopes_l, classes_l = scopes_l[:-1], classes_l[:-1]
            path = scopes_l[-1]
            if path == "module" or path.startswith("module."):  # (the wrapper's adapter holds the module as .module)
                origin["path"] = path.removeprefix("module").removeprefix(".")
                origin["cls"] = classes_l[-1].rsplit(".", 1)[-1]
    elif name.startswith("/module"):
        origin["path"] = ".".join(name.strip("/").split("/")[1:-1])
    trace = metadata.get("pkg.torch.onnx.stack_trace", "")
    for file, line in reversed(re.findall(r'File "([^"]+)", line (\d+)', trace)):
        norm = file.replace("\\", "/")
        if "/ortwrap/" not in norm and "/torch/" not in norm:
            origin["line"] = f"{file}:{line}"
            break
    return origin


def describe_origin(origin: dict[str, str]) -> str:
    """``node_origin``'s answer in words: "module `bag` (EmbeddingBag), torch op aten.embedding_bag, at f.py:8"."""
    parts = []
    if "path" in origin:
        where = f"module `{origin['path']}`" if origin["path"] else "the wrapped module"
        parts.append(f"{where} ({origin['cls']})" if "cls" in origin else where)
    if "op" in origin:
        parts.append(f"torch op {origin['op']}")
    if "line" in origin:
        parts.append(f"at {origin['line']}")
    return ", ".join(parts)
