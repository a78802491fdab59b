"""Export-safe collectives: ``torch.distributed`` and ``deepspeed.comm`` stubs while ortwrap exports.

Tracing a module whose ``torch.autograd.Function`` calls a collective fails ("Tried to trace
<ProcessGroup> but it is not part of the active trace", ``_Map_base::at``): the tracer cannot record
a process group. But a Function runs as a PythonOp whose forward and backward ortwrap calls in
Python at run time (docs/bridge.md), so its collectives need not be in the graph at all: during the
trace only the shapes of its outputs matter.

:func:`collective_stubs` therefore replaces, for the duration of an export, every collective of
``torch.distributed`` (and of ``deepspeed.comm`` when DeepSpeed is imported) with a stub that
communicates nothing, leaves its output tensors as the caller allocated them (so with the correct
shapes), and returns what the real call returns: ``None``, or a completed work object when
``async_op=True``. The originals are restored when the export ends, also when it fails.

NOTE: a collective called while exporting but *not* inside a bridged Function's forward (directly in
a module's forward, or in a Function listed in ``inline_functions``) would silently vanish from the
exported graph. The stub refuses it with an :class:`~ortwrap.ExportError` naming the collective
instead (ortwrap then falls back to PyTorch with a warning, or raises with ``fallback=False``).
Whether a call is inside a bridged Function's forward is explicit state that the export's Function
routing sets (``bridge.intercept.current_function``), never read from Python frames.

NOTE: the stubs are process-wide attributes, but only the thread that entered the context sees
them: any other thread calling a collective meanwhile gets the real one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._compat import torch as compat
from ..bridge.intercept import current_function
from ..errors import ExportError, UnsupportedInputError
from ..export.context import register_capture_context
from . import Integration

__all__ = [
    "DEEPSPEED_COLLECTIVES",
    "TORCH_COLLECTIVES",
    "DataParallelWrappers",
    "DoneWork",
    "check_wrappable",
    "collective_stubs",
    "stubs_active",
]

#: Names of ``torch.distributed`` (and ``torch.distributed.distributed_c10d``) functions replaced
#: while exporting; names a torch release lacks are skipped.
TORCH_COLLECTIVES: tuple[str, ...] = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    *compat.private_collectives(),  # _all_gather_base, ... (private names: the compat boundary's)
)

#: Names of ``deepspeed.comm`` functions replaced while exporting (when DeepSpeed is imported).
DEEPSPEED_COLLECTIVES: tuple[str, ...] = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "allgather_fn",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "inference_all_reduce",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter",
    "send",
)


_Work: type = dist.Work if dist.is_available() else object


class DoneWork(_Work):
    """The work object of a stubbed asynchronous collective: already completed and successful."""

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def wait(self, timeout: Any = None) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def source_rank(self) -> int:
        return 0

    def _source_rank(self) -> int:
        return 0

    def result(self) -> list[torch.Tensor]:
        return []

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([])
        return future


# ------------------------------------------------------------------------------------- the stubs

_lock = threading.Lock()
_depth: dict[int, int] = {}  # thread id -> nesting depth of collective_stubs()
_installed: list[tuple[object, str, object]] = []  # (namespace, name, original)


def stubs_active() -> bool:
    """Whether the calling thread is inside :func:`collective_stubs`."""
    return _depth.get(threading.get_ident(), 0) > 0


def _unwrap(fn: Callable) -> Callable:
    """The function a decorator wrapped: ``__wrapped__``, or DeepSpeed's ``timed_op`` closure cell."""
    seen = 0
    while seen < 5:
        seen += 1
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _cell_is_set(c)]
            inner = next((c for c in cells if callable(c) and getattr(c, "__name__", None) == fn.__name__), None)
        if inner is None:
            return fn
        fn = inner
    return fn


def _cell_is_set(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _make_stub(qualname: str, original: Callable) -> Callable:
    short = qualname.rsplit(".", 1)[1]
    signature: list[inspect.Signature | None] = []  # computed on first use: exports rarely call collectives

    def arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
        if not signature:
            try:
                signature.append(inspect.signature(_unwrap(original)))
            except (TypeError, ValueError):
                signature.append(None)
        sig = signature[0]
        if sig is None:
            return dict(kwargs)
        try:
            return dict(sig.bind_partial(*args, **kwargs).arguments)
        except TypeError:
            return dict(kwargs)

    @functools.wraps(original)
    def stub(*args: Any, **kwargs: Any) -> Any:
        if not stubs_active():  # another thread: the real collective
            return original(*args, **kwargs)
        function = current_function()  # explicit state that the export's Function routing sets
        if function is None or not function.bridged:
            where = (
                f"in torch.autograd.Function {function.name}, which inline_functions lists"
                if function is not None
                else "outside the forward of a torch.autograd.Function"
            )
            raise ExportError(
                f"{qualname} was called while ortwrap exported the module, {where}: the exported graph would "
                "silently skip the communication. Call collectives inside a torch.autograd.Function (ortwrap runs "
                "its forward and backward in Python, with the real collectives), or run the module without ORTWrap"
            )
        bound = arguments(args, kwargs)
        if short in ("isend", "irecv"):
            return DoneWork()
        if short == "batch_isend_irecv":
            ops = bound.get("p2p_op_list", args[0] if args else [])
            return [DoneWork() for _ in ops]
        if short == "recv":
            src = bound.get("src")
            return src if isinstance(src, int) else 0
        if short == "inference_all_reduce":
            return bound.get("tensor", args[0] if args else None)
        return DoneWork() if bound.get("async_op") else None

    stub.__ortwrap_stub__ = True  # type: ignore[attr-defined]
    return stub


def _targets() -> list[tuple[object, str, tuple[str, ...]]]:
    """(namespace, qualified prefix, names) of every place a collective is looked up from."""
    import torch.distributed.distributed_c10d as c10d

    targets: list[tuple[object, str, tuple[str, ...]]] = [
        (dist, "torch.distributed", TORCH_COLLECTIVES),
        (c10d, "torch.distributed", TORCH_COLLECTIVES),
    ]
    ds_comm = sys.modules.get("deepspeed.comm")  # only once the user imported DeepSpeed
    if ds_comm is not None:
        targets.append((ds_comm, "deepspeed.comm", DEEPSPEED_COLLECTIVES))
        inner = sys.modules.get("deepspeed.comm.comm")
        if inner is not None:
            targets.append((inner, "deepspeed.comm", DEEPSPEED_COLLECTIVES))
    return targets


def _install() -> None:
    stubs: dict[int, Callable] = {}  # one stub per original function, shared by its namespaces
    for namespace, prefix, names in _targets():
        for name in names:
            original = namespace.__dict__.get(name)
            if original is None or not callable(original) or getattr(original, "__ortwrap_stub__", False):
                continue
            stub = stubs.get(id(original))
            if stub is None:
                stub = stubs[id(original)] = _make_stub(f"{prefix}.{name}", original)
            _installed.append((namespace, name, original))
            setattr(namespace, name, stub)


def _uninstall() -> None:
    while _installed:
        namespace, name, original = _installed.pop()
        setattr(namespace, name, original)


@contextlib.contextmanager
def collective_stubs() -> Iterator[None]:
    """Replace the collectives of ``torch.distributed`` and ``deepspeed.comm`` with stubs while ortwrap
    exports; restore them on exit, also when the body raises.

    Re-entrant and thread-aware: nested uses share one installation, and threads other than the one
    that entered keep calling the real collectives. The stubs communicate nothing, leave outputs as
    allocated (correct shapes, unspecified values), return ``None`` or, with ``async_op=True``, a
    completed :class:`DoneWork`.

    Raises (from a stub, during the body):
        ExportError: a collective was called outside a bridged ``torch.autograd.Function``'s forward.
    """
    if not dist.is_available():  # a torch build without torch.distributed: nothing to replace
        yield
        return
    tid = threading.get_ident()
    with _lock:
        if not _depth:
            _install()
        _depth[tid] = _depth.get(tid, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _depth[tid] -= 1
            if not _depth[tid]:
                del _depth[tid]
            if not _depth:
                _uninstall()


# The exporters enter it around each capture and translation (export/context.py): they never import
# this module.
register_capture_context(collective_stubs)


# ------------------------------------------------------------------------------------- wrap order


def check_wrappable(module: torch.nn.Module) -> None:
    """Refuse data-parallel wrappers inside ORTWrap: they communicate in their own forward and hooks,
    which an export cannot contain. The working order is the other way round.

    Raises:
        UnsupportedInputError: ``module`` is a ``DistributedDataParallel``, ``DataParallel``,
            ``FullyShardedDataParallel`` or a DeepSpeed engine (a ``TypeError`` too).
    """
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__}
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise UnsupportedInputError(
            "ORTWrap(DistributedDataParallel(model)) is not supported: DDP communicates in its own forward. "
            "Wrap the other way round: DistributedDataParallel(ORTWrap(model), ...)"
        )
    if isinstance(module, torch.nn.DataParallel):
        raise UnsupportedInputError(
            "ORTWrap(DataParallel(model)) is not supported: use DistributedDataParallel(ORTWrap(model)) instead"
        )
    if any(n.startswith("torch.distributed.fsdp.") and n.endswith("FullyShardedDataParallel") for n in names):
        raise UnsupportedInputError(
            "ORTWrap(FullyShardedDataParallel(model)) is not supported: FSDP gathers parameters in its own forward. "
            "Use DeepSpeed ZeRO-3 with deepspeed.initialize(model=ORTWrap(model)) instead (docs/distributed.md)"
        )
    if any(n.startswith("deepspeed.") and n.endswith(".DeepSpeedEngine") for n in names):
        raise UnsupportedInputError(
            "ORTWrap(deepspeed engine) is not supported: wrap the model first and give the wrapper to DeepSpeed: "
            "engine, *_ = deepspeed.initialize(model=ORTWrap(model), ...)"
        )


class DataParallelWrappers(Integration):
    """The integration seam's wrap-time check for data-parallel wrappers (:func:`check_wrappable`)."""

    name = "data-parallel-wrappers"

    def check_wrappable(self, module: torch.nn.Module) -> None:
        check_wrappable(module)
