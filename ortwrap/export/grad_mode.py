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
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..bridge.intercept import current_function


def _needs_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.requires_grad:
        return value.detach()
    return value


class NoGradBoundaries(TorchFunctionMode):
    """Detach floating results of torch calls made with grad mode off from inputs that need grad."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.is_grad_enabled() or current_function() is not None:
            return out
        if not any(_needs_grad(v) for v in pytree.tree_leaves((args, kwargs))):
            return out
        return pytree.tree_map(_detached, out)


@contextlib.contextmanager
def no_grad_boundaries() -> Iterator[None]:
    """Watch the module's calls for :class:`NoGradBoundaries` if grad mode is on (a capture for
    training); nothing otherwise."""
    if not torch.is_grad_enabled():
        yield
        return
    with NoGradBoundaries():
        yield
