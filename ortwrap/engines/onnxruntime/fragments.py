"""A module AOTAutograd cannot trace into one graph, run in graph fragments (a split capture).

AOTAutograd traces the module once, on fake tensors. A module whose own Python reads a tensor's
value (``if labels.max() >= vocab_size``, ``.item()``) or calls an op whose output shape depends on
the values (``nonzero``, ``masked_select``, a boolean-mask index), outside an autograd.Function, has
no one graph: the trace raises (fake tensor's ``DataDependentOutputException`` or
``DynamicOutputShapeException``, ``compat.is_data_dependent_trace_error``). Such a call signature
runs as the training engine's split capture (``split_capture.py``, the same decision: a trace that
stops on a value it cannot know), with this engine as the per-fragment compiler:
``torch.compile(module, dynamic=True)`` with a backend that makes each graph fragment dynamo hands it
an ``ORTWrap(fragment, engine="onnxruntime", fallback=False)``. Each fragment thus takes this
engine's own path per signature (AOTAutograd's joint graph, partitioned, translated to ONNX, a
forward and a backward InferenceSession, split again at opaque Functions and ops with no ONNX
translation); the data-dependent Python, and the ops dynamo breaks the graph at, run in PyTorch
between fragments. Fragments with no ops run as they are.

Said once, when a signature splits (a warning naming the cause and the user's line), then the
split capture's summary after its first call. A fragment builds per shape signature (this engine's
shapes are static): dynamo hands it sizes as symbols, and the wrapper builds for each size it sees.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..._compat import torch as compat
from ...errors import ExportError
from ...split_capture import SplitCapture, _Fragment

__all__ = ["EngineSplitCapture", "data_dependent_error", "shapeless_key"]

_TORCH_DIR = os.path.dirname(os.path.dirname(nn.__file__))
_ORTWRAP_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _user_line(error: BaseException) -> str | None:
    """``file:line (code)`` of the innermost frame of ``error``'s traceback (and its causes') that is
    neither torch's nor ortwrap's: the module's own code that read the value."""
    found = None
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            path = os.path.abspath(tb.tb_frame.f_code.co_filename)
            if not path.startswith((_TORCH_DIR, _ORTWRAP_DIR)) and "<" not in os.path.basename(path):
                found = f"{os.path.basename(path)}:{tb.tb_lineno} ({tb.tb_frame.f_code.co_name})"
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return found


def _what(error: BaseException) -> str:
    """The data-dependent exception in ``error``'s chain, as ``Type: op``."""
    e = compat.data_dependent_trace_error(error) or error
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def data_dependent_error(module: nn.Module, error: BaseException) -> ExportError:
    """The ExportError for a trace of ``module`` that stopped on a value it cannot know."""
    where = _user_line(error)
    return ExportError(
        f"AOTAutograd could not trace {type(module).__name__} into one graph: its Python reads a tensor's value, or "
        f"an op's output shape depends on the values ({_what(error)}{', at ' + where if where else ''})"
    )


def shapeless_key(key: tuple) -> tuple:
    """The engine's signature key without the inputs' shapes (a split capture serves every shape:
    dynamo's guards and the fragments' own builds take the sizes)."""
    training, needs_grad, in_spec, leaves, *rest = key
    return (training, needs_grad, in_spec, tuple(meta[1:] for meta in leaves), *rest)


class _EngineFragment(_Fragment):
    """A fragment whose wrapper runs on the onnxruntime engine (its builds are the engine's)."""

    @property
    def programs(self) -> int:
        engine = self.wrapper.__dict__.get("_engine")
        return engine.build_count if engine is not None else len(self.wrapper.programs())


class EngineSplitCapture(SplitCapture):
    """``split_capture.SplitCapture`` whose fragments run on the onnxruntime engine."""

    fragment_type = _EngineFragment

    def __init__(self, module: nn.Module, wrapper: Any, options: Any, error: BaseException) -> None:
        # (the engine named: a fragment's wrapper must not resolve "auto" to the training build)
        values = {**wrapper._dispatch.option_values, "engine": "onnxruntime"}
        super().__init__(module, values, options, error, wrapper._dispatch.wrap)
