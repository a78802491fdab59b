"""``torch.no_grad()`` inside ``forward``: where eager stops the gradient, the exported graph does too.

Neither exporter records grad mode: the ops a module runs under ``torch.no_grad()`` (a scale taken
from the activations, spectral_norm's power iteration, a teacher's targets) are exported as ordinary
ops, and ORT differentiates through them, where eager's gradient stops (silently wrong gradients).
While the module runs for the export, :class:`NoGradBoundaries` watches each torch call: a floating
result computed with grad mode off, from an input that requires grad, is where eager's gradient
stops, so it is ``detach()``-ed there; both exporters write the detach as ortwrap's stop-gradient
(``passes/stop_gradient.py``). Calls inside an ``autograd.Function``'s forward (grad mode is off
there by autograd's design, not the module's) are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..bridge.intercept import inside_function_forward
from ..errors import ExportError


def _needs_grad(value: Any, depth: int = 4) -> bool:
    """Whether ``value`` (a call's argument: a tensor, or a list, tuple or dict of them) holds a
    tensor that requires grad."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if depth and isinstance(value, (list, tuple)):
        return any(_needs_grad(v, depth - 1) for v in value)
    if depth and isinstance(value, dict):
        return any(_needs_grad(v, depth - 1) for v in value.values())
    return False


def _detached(value: Any) -> Any:
    """``value`` (a call's result) with its floating tensors that need no grad detached; tuples
    (named ones and torch's return types included) and lists rebuilt only where something changed."""
    if isinstance(value, torch.Tensor):
        return value.detach() if value.is_floating_point() and not value.requires_grad else value
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, tuple):
        items = [_detached(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if hasattr(type(value), "n_fields"):  # torch.return_types (structseq)
            return type(value)(items)
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return tuple(items)
    return value


def _refuse_parameter_write(func: Any, args: tuple) -> None:
    """An in-place op on a parameter under no_grad (``nn.Embedding(max_norm=...)``'s renormalization):
    eager changes the parameter itself; the graph would change a copy inside ORT, and the parameter
    never (later steps silently differ). Raised during the export, so the build fails clearly."""
    name = getattr(func, "__name__", "")
    if not name.endswith("_") or name.endswith("__") or not args:
        return
    _refuse(f"{name} under torch.no_grad()", args[0])


def _refuse(what: str, target: Any) -> None:
    if isinstance(target, torch.Tensor) and target.is_leaf and target.requires_grad:
        raise ExportError(
            f"forward() changes a parameter in place ({what}, shape {'x'.join(str(int(d)) for d in target.shape)}): "
            "ORT would change a copy "
            "inside the graph, never the parameter, and later steps would differ from eager. Renormalize or clip "
            "the weight outside forward (e.g. after optimizer.step()), or run the module without ORTWrap"
        )


class NoGradBoundaries(TorchFunctionMode):
    """Detach floating results of torch calls made with grad mode off from inputs that need grad."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and (kwargs.get("max_norm") is not None or (len(args) > 3 and args[3] is not None)):
            # it renormalizes rows of the weight in place, through a detached alias (not seen below)
            _refuse(
                "nn.Embedding(max_norm=...) renormalizes its weight", args[1] if len(args) > 1 else kwargs["weight"]
            )
        if not torch.is_grad_enabled() and not inside_function_forward():
            _refuse_parameter_write(func, args)
        out = func(*args, **kwargs)
        if torch.is_grad_enabled() or inside_function_forward():
            return out
        if not (_needs_grad(args) or _needs_grad(kwargs)):
            return out
        return _detached(out)


@contextlib.contextmanager
def no_grad_boundaries() -> Iterator[None]:
    """Watch the module's calls for :class:`NoGradBoundaries` if grad mode is on (a capture for
    training); nothing otherwise."""
    if not torch.is_grad_enabled():
        yield
        return
    with NoGradBoundaries():
        yield
