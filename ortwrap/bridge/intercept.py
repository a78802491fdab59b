"""Routing ``torch.autograd.Function`` calls through ortwrap while it exports, without touching ``apply``.

``Function.apply`` (Python in torch 2.13, autograd's C builtin itself from 2.14) looks up the
class's ``forward`` on every call. While an export runs, ortwrap gives every Function subclass a
``forward`` of its own: a ``functools.wraps`` of the class's forward (so ``inspect.signature``, and
``apply``'s binding of default arguments for ``setup_context``-style Functions, see the original)
that hands the call to the export's handler, which decides:

- TorchScript, bridged: run the original forward. The tracer records the call as one
  ``prim::PythonOp`` (the forward's ops in its sub-block), which ortwrap's symbolic turns into a
  ``com.microsoft::PythonOp`` (``bridge/symbolic.py``).
- TorchScript, inlined (``Options.inline_functions``): run the original forward; the symbolic
  exports the sub-block's ops instead of a PythonOp.
- dynamo, bridged: return the outputs of one ``ortwrap::function_call`` custom op (``bridge/dynamo.py``).
- dynamo, inlined: run the original forward; its ops are captured as they run.

Because ``apply`` finds the forward on the class at call time, this reaches every way of calling a
Function: ``MyFn.apply(...)``, aliases bound at import time (``fn = MyFn.apply``, as apex and Megatron
do), calls from inside other Functions, and both the Python and the C ``apply``. A class that
inherits its forward gets its own wrapper (the handler must see the class that was called).
Outside an export the wrappers are not installed; while one runs, calls from other threads, or
with no handler set, go straight to the original forward.

The module also keeps, while a Function's forward runs during an export, which Function that is and
whether ortwrap bridges it (:func:`current_function`): the collective stubs
(``integrations/distributed.py``) read it instead of inspecting frames.

NOTE: a Function class created while the traced forward runs (a class statement inside
``forward``) exists only after the wrappers were installed, so it is not intercepted. Under
TorchScript it is still bridged (the tracer records it); the dynamo capture refuses it
(:func:`new_function_classes`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import state

#: ``handler(cls, forward, args, kwargs)``: what a call of ``cls.apply`` does while an export runs.
Handler = Callable[[type, Callable[..., Any], tuple, dict], Any]

_handler: contextvars.ContextVar[Handler | None] = contextvars.ContextVar("ortwrap_function_handler", default=None)


@dataclass(frozen=True)
class InFunction:
    """The Function whose forward runs now, during an export.

    Attributes:
        name: its qualified name (``module.QualName``).
        bridged: ortwrap runs it (or a Function around it) as a PythonOp, whose forward and
            backward run in Python at run time; False for an inlined Function, whose ops are exported.
    """

    name: str
    bridged: bool


_current: contextvars.ContextVar[InFunction | None] = contextvars.ContextVar("ortwrap_in_function", default=None)


def current_function() -> InFunction | None:
    """The Function whose forward the export is running, or ``None`` (not inside one)."""
    return _current.get()


@contextlib.contextmanager
def in_function(cls: type, *, bridged: bool) -> Iterator[InFunction]:
    """Record that ``cls``'s forward runs now. Inside a bridged Function, everything is bridged: its
    forward (with whatever it calls) runs in Python at run time."""
    outer = _current.get()
    frame = InFunction(state.qualified_name(cls), bridged or (outer is not None and outer.bridged))
    token = _current.set(frame)
    try:
        yield frame
    finally:
        _current.reset(token)


@contextlib.contextmanager
def passthrough() -> Iterator[None]:
    """Calls made inside run the Functions' original forwards (fake implementations, autograd
    wrappers of custom ops)."""
    token = _handler.set(None)
    try:
        yield
    finally:
        _handler.reset(token)


# ------------------------------------------------------------------------------------- installing

_lock = threading.Lock()
_depth = 0
#: (class, the forward it had in its own __dict__, or _INHERITED)
_installed: list[tuple[type, Any]] = []
_INHERITED = object()
_BASE_FORWARD = torch.autograd.Function.forward


def function_classes() -> list[type]:
    """Every subclass of ``torch.autograd.Function`` that exists now."""
    seen: dict[type, None] = {}
    stack = [torch.autograd.Function]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen[sub] = None
                stack.append(sub)
    return list(seen)


#: how many intercepted Function forwards are running now (in this context)
_forwards: contextvars.ContextVar[int] = contextvars.ContextVar("ortwrap_function_forwards", default=0)


def inside_function_forward() -> bool:
    """Whether an (intercepted) ``autograd.Function``'s forward is running now, during an export,
    whatever the handler does with it (autograd runs forwards with grad mode off)."""
    return _forwards.get() > 0


def _wrap(cls: type, forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def intercepted(*args: Any, **kwargs: Any) -> Any:
        token = _forwards.set(_forwards.get() + 1)
        try:
            handler = _handler.get()
            if handler is None:
                return forward(*args, **kwargs)
            return handler(cls, forward, args, kwargs)
        finally:
            _forwards.reset(token)

    intercepted.__ortwrap_intercepted__ = True  # type: ignore[attr-defined]
    return intercepted


def _install() -> None:
    for cls in function_classes():
        own = cls.__dict__.get("forward")
        if own is None:
            inherited = getattr(cls, "forward", _BASE_FORWARD)
            if inherited is _BASE_FORWARD or getattr(inherited, "__ortwrap_intercepted__", False):
                continue  # no forward of its own anywhere, or a parent's wrapper: wrapped below
            fn, original = inherited, _INHERITED
        elif isinstance(own, staticmethod):
            fn, original = own.__func__, own
        else:
            continue  # a classmethod or an unusual descriptor: autograd would not call it either
        if getattr(fn, "__ortwrap_intercepted__", False):
            continue
        try:
            cls.forward = staticmethod(_wrap(cls, fn))
        except (TypeError, AttributeError):  # an immutable (C-defined) class
            continue
        _installed.append((cls, original))
    # A class that inherits its forward and was visited before its parent got the parent's
    # wrapper above: give it its own (the handler must see the class that was called).
    for cls in function_classes():
        if "forward" in cls.__dict__:
            continue
        inherited = getattr(cls, "forward", _BASE_FORWARD)
        if getattr(inherited, "__ortwrap_intercepted__", False):
            fn = inherited.__wrapped__
            try:
                cls.forward = staticmethod(_wrap(cls, fn))
            except (TypeError, AttributeError):
                continue
            _installed.append((cls, _INHERITED))


def _uninstall() -> None:
    while _installed:
        cls, original = _installed.pop()
        if original is _INHERITED:
            delattr(cls, "forward")
        else:
            cls.forward = original


@contextlib.contextmanager
def intercept_functions(handler: Handler) -> Iterator[None]:
    """Route every ``Function.apply`` call made in this context (this thread) to ``handler``.

    Re-entrant and thread-aware: nested exports share one installation, and the wrappers send calls
    from contexts without a handler to the original forwards. The originals come back when the
    outermost export ends, also when it fails.
    """
    global _depth
    with _lock:
        if _depth == 0:
            _install()
        _depth += 1
    token = _handler.set(handler)
    try:
        yield
    finally:
        _handler.reset(token)
        with _lock:
            _depth -= 1
            if _depth == 0:
                _uninstall()


def new_function_classes(before: list[type]) -> list[type]:
    """The Function subclasses that exist now but not in ``before`` (created during an export)."""
    known = set(before)
    return [c for c in function_classes() if c not in known]
