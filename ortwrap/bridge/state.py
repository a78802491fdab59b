"""Process-wide state of the bridge: registered Functions, pending exceptions, context accounting.

ONNX Runtime keeps three process-global tables that this module mirrors and manages:

- Functions registered by name (``register_torch_autograd_function``). ORT keeps the *first* class
  registered under a name, so every class gets a name no other class has (:func:`function_name`).
- The context map of PythonOp: each forward run of a PythonOp stores its context under an id that
  PythonOpGrad erases after the Function's backward. A forward whose backward never runs (a
  ``torch.no_grad()`` run, an abandoned training forward) leaves its entry behind. ortwrap counts
  such entries and empties the map with ``unregister_python_functions`` at a quiet moment (no
  forward waiting for its backward), then registers the Functions again (:func:`maybe_purge`).
- Exceptions cannot cross ORT: a Function's exception is parked here by the runner and re-raised by
  the caller of the ORT run with its original type (:func:`reraise_pending`).

The janitor (:func:`erase_contexts`, at the end) erases entries of ORT's PythonOp context map whose
backward will never run. ORT 1.19.2 erases a context from its map only after ``PythonOpGrad`` ran
for it; the only other way, ``unregister_python_functions``, empties the whole map and so must wait
until no forward awaits its backward. A training forward whose outputs are dropped without backward
(while other forwards are in flight) would leave its entries behind for good. The janitor is a
one-node ONNX graph, ``PythonOpGrad(ctx_id, grad)``: running it makes ORT look the context up, call
ortwrap's backward runner (which declines: the context was already released) and erase the entry.
The run's failure is expected and ignored.
"""

from __future__ import annotations

import atexit
import threading

import numpy as np
import torch
from onnx import TensorProto, helper

from .._ort import C, ort

_lock = threading.Lock()

# ------------------------------------------------------------------------------------- functions
_functions: dict[str, type] = {}  # unique name -> Function class
_names: dict[type, str] = {}
_aliases: dict[str, type] = {}  # variants of unique names (bool-input markers) -> class


class _Placeholder(torch.autograd.Function):
    """Registered with ORT for classes it refuses (only direct Function subclasses are accepted).

    ortwrap's runner resolves the class from its own table, so ORT never calls this."""

    @staticmethod
    def forward(ctx, *args):  # pragma: no cover
        raise RuntimeError("ortwrap placeholder Function called")

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover
        raise RuntimeError("ortwrap placeholder Function called")


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a Function class: the name users give in ``inline_functions``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def function_name(cls: type) -> str:
    """The unique name of ``cls`` in ORT's registry, registering it on first use.

    Two classes with the same qualified name (defined in a loop, or reloaded) get ``name``,
    ``name#2``, ...: ORT silently keeps the first class registered under a name.
    """
    with _lock:
        name = _names.get(cls)
        if name is not None:
            return name
        base = qualified_name(cls)
        name, n = base, 1
        while name in _functions:
            n += 1
            name = f"{base}#{n}"
        _functions[name] = cls
        _names[cls] = name
        _ort_register(name, cls)
        return name


def function_class(name: str) -> type | None:
    return _functions.get(name)


def register_alias(name: str, cls: type) -> None:
    """Register ``cls`` with ORT under a variant of its unique name (bool-input markers)."""
    with _lock:
        if name not in _aliases:
            _aliases[name] = cls
            _ort_register(name, cls)


def _ort_register(name: str, cls: type) -> None:
    direct = torch.autograd.Function in cls.__bases__
    C.register_torch_autograd_function(name, cls if direct else _Placeholder)


# ------------------------------------------------------------------------------------- errors
_pending: list[BaseException] = []


def park(exc: BaseException) -> None:
    """Keep an exception raised inside ORT's run for the caller to re-raise."""
    _pending.append(exc)


def clear_pending() -> None:
    _pending.clear()


def reraise_pending(ort_error: BaseException | None) -> None:
    """Raise the first exception parked during the last run, chained to ORT's error, if any."""
    if _pending:
        exc = _pending[0]
        _pending.clear()
        raise exc.with_traceback(exc.__traceback__) from ort_error


# ------------------------------------------------------------------------------------- contexts
_waiting = 0  # training forwards with PythonOps whose backward has not run (or been abandoned)
_stale = 0  # context-map entries no backward will erase
PURGE_THRESHOLD = 64


def forward_started() -> None:
    global _waiting
    with _lock:
        _waiting += 1


def forward_finished(abandoned_entries: int) -> None:
    """A forward's backward ran (0 entries left behind) or will never run (``abandoned_entries``)."""
    global _waiting, _stale
    with _lock:
        _waiting -= 1
        _stale += abandoned_entries


def entries_left(n: int) -> None:
    """A run left ``n`` entries in ORT's context map (inference runs: one per PythonOp)."""
    global _stale
    with _lock:
        _stale += n


def maybe_purge() -> bool:
    """Empty ORT's context map when it holds stale entries and no forward awaits its backward."""
    global _stale
    with _lock:
        if _waiting or _stale < PURGE_THRESHOLD:
            return False
        C.unregister_python_functions()  # also forgets the Functions: register them again
        for name, cls in (*_functions.items(), *_aliases.items()):
            _ort_register(name, cls)
        _stale = 0
        return True


_abandoned: list[int] = []  # context ids of training forwards whose backward will never run


def abandon(ids: list[int]) -> None:
    with _lock:
        _abandoned.extend(ids)


def collect_abandoned() -> int:
    """Erase the queued context entries from ORT's map; return how many. Call only at a safe point
    (not during an ORT run).

    ORT erases a context only when PythonOpGrad ran for it, so a one-node graph with a
    ``PythonOpGrad`` (the janitor) is run for each abandoned id: ORT looks the context up, calls
    ortwrap's backward runner (which declines the released context) and erases the entry.
    """
    with _lock:
        ids = list(_abandoned)
        _abandoned.clear()
    if not ids:
        return 0
    erase_contexts(ids)
    return len(ids)


def stats() -> dict[str, int]:
    """Counters for tests and debugging."""
    return {
        "functions": len(_functions),
        "waiting_forwards": _waiting,
        "stale_context_entries": _stale,
        "abandoned_context_entries": len(_abandoned),
    }


# ---------------------------------------------------------------------------------------- janitor
_session = None
_janitor_lock = threading.Lock()  # (the janitor session: not _lock, which collect_abandoned does not hold)


class JanitorFunction(torch.autograd.Function):
    """Named by the janitor graph; never called (the contexts it sees are released)."""

    @staticmethod
    def forward(ctx, x):  # pragma: no cover
        return x

    @staticmethod
    def backward(ctx, g):  # pragma: no cover
        return g


def _build() -> ort.InferenceSession:
    name = function_name(JanitorFunction)
    node = helper.make_node(
        "PythonOpGrad",
        ["ctx", "grad"],
        ["grad_input"],
        domain="com.microsoft",
        name="ortwrap_janitor",
        func_name=name,
        output_convention="d",
        safe_run_mode=0,
        input_tensor_types=[TensorProto.FLOAT],
        input_tensor_ranks=[1],
        output_tensor_types=[TensorProto.FLOAT],
        output_tensor_ranks=[1],
        output_tensor_requires_grads=[1],
    )
    graph = helper.make_graph(
        [node],
        "ortwrap_janitor",
        [
            helper.make_tensor_value_info("ctx", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("grad", TensorProto.FLOAT, [1]),
        ],
        [helper.make_tensor_value_info("grad_input", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=8
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 4  # its runs fail by design: do not log them
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def erase_contexts(ids: list[int]) -> None:
    """Erase each context id from ORT's map (ids already erased are ignored)."""
    global _session
    with _janitor_lock:
        if _session is None:
            _session = _build()
        grad = np.zeros(1, dtype=np.float32)
        for context_id in ids:
            try:
                _session.run(None, {"ctx": np.array([context_id], dtype=np.int64), "grad": grad})
            except Exception:
                pass
        clear_pending()


# ORT's tables are C++ statics: if they still hold Python objects when the interpreter is gone,
# their destructors crash the process at exit.
if hasattr(C, "unregister_python_functions"):  # (the training build's; the onnxruntime engine has no PythonOps)
    atexit.register(C.unregister_python_functions)
