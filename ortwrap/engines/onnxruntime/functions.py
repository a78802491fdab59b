"""autograd.Functions while AOTAutograd traces: traced into the joint graph, or (untraceable) one opaque
op in the forward graph and one in the backward graph, which ``split.py`` runs in PyTorch between ORT
segments.

Every trace routes Function calls through ``bridge/intercept.py`` (ortwrap's forward wrappers; ``apply``
is untouched). :class:`FunctionTracer` runs a Function's forward as it is, so its ops are traced, and
records the class of one whose forward or backward (its node's backward borrowed for the trace,
:class:`_RecordedBackward`) raises. The engine then traces again with that class opaque: its call
becomes ``ortwrap_engine::function_forward(tensors, site)``, and its autograd node's backward (redirected
for this one ctx, ``compat.backward_from``) becomes ``ortwrap_engine::function_backward(grads, token,
site)``. Neither op has an ONNX translation.

At run time the forward op runs the Function's own ``apply`` with autograd on (its inputs detached,
those that need a gradient marked so) and keeps its inputs and outputs under a token, an int64 scalar
the op also returns: AOTAutograd saves it for the backward like any saved value. The backward op calls
``torch.autograd.grad`` on what the token names, so the Function's own backward runs with its own ctx.

NOTE: state and its lifetime. ``_STATES[token]`` holds the Function's autograd graph from the forward
op until the backward op pops it; a token whose backward never runs (the loss was not backpropagated)
is dropped when the token tensor is freed (``weakref.finalize``). Output shapes are probed at trace time
by running the Function on zeros of its inputs' shapes (outside every dispatch mode, without grad): a
Function whose output shapes depend on its inputs' values is caught at run time (RuntimeRunError).
Only ctx-style Functions (``forward(ctx, ...)``) can be opaque: a ``setup_context`` Function's ctx is
out of the forward's reach. Nor can one that modifies an input in place (``ctx.mark_dirty``; seen by the
probe, whose inputs' version counters move): refused, naming it, so the call falls back or raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..._compat import torch as compat
from ...bridge import intercept, state
from ...errors import RuntimeRunError

__all__ = ["FUNCTION_OPS", "FunctionTracer"]


@dataclasses.dataclass
class _Site:
    """One traced call of an untraceable Function: how to rebuild its arguments and what it returns."""

    cls: type
    template: list  # apply's arguments, tensors replaced by None (positions in ``tensor_at``)
    kwargs: dict
    tensor_at: list[int]
    needs_grad: list[bool]  # per tensor argument (ctx.needs_input_grad)
    in_meta: list[tuple]  # (shape, dtype, device) per tensor argument
    out_meta: list[tuple]  # per output
    single: bool  # the forward returned one tensor, not a tuple

    @property
    def name(self) -> str:
        return state.qualified_name(self.cls)

    def arguments(self, tensors: list[torch.Tensor]) -> list:
        args = list(self.template)
        for i, t in zip(self.tensor_at, tensors):
            args[i] = t
        return args

    def call(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        out = self.cls.apply(*self.arguments(tensors), **self.kwargs)
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)


_SITES: list[_Site] = []
_STATES: dict[int, tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
_TOKENS = itertools.count()


def _outputs(site: _Site, outs: tuple, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    got = [(tuple(o.shape), o.dtype) for o in outs]
    want = [(m[0], m[1]) for m in site.out_meta]
    if got != want:
        raise RuntimeRunError(
            f"torch.autograd.Function {site.name} returned {got}, not the {want} its trace-time probe (zeros of "
            "the same shapes) returned: the onnxruntime engine builds per shape, and this Function's output "
            "shapes depend on its inputs' values; use engine='training'"
        )
    storages = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    # (a custom op's output may not alias an input: a Function that returns its input gets a copy)
    return [
        o.detach().clone() if o.numel() and o.untyped_storage().data_ptr() in storages else o.detach() for o in outs
    ]


@torch.library.custom_op("ortwrap_engine::function_forward", mutates_args=())
def function_forward(tensors: list[torch.Tensor], site: int, grad: bool) -> list[torch.Tensor]:
    s = _SITES[site]
    if not grad:
        with torch.no_grad():
            return _outputs(s, s.call(tensors), tensors)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) for t, need in zip(tensors, s.needs_grad)]
        outs = s.call(leaves)
    result = _outputs(s, outs, tensors)
    token = next(_TOKENS)
    _STATES[token] = (leaves, outs)
    handle = torch.tensor(token, dtype=torch.int64)
    weakref.finalize(handle, _STATES.pop, token, None)
    return [*result, handle]


@function_forward.register_fake
def _(tensors: list[torch.Tensor], site: int, grad: bool) -> list[torch.Tensor]:
    s = _SITES[site]
    outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in s.out_meta]
    return [*outs, torch.empty((), dtype=torch.int64)] if grad else outs


@torch.library.custom_op("ortwrap_engine::function_backward", mutates_args=())
def function_backward(grads: list[torch.Tensor], token: torch.Tensor, site: int) -> list[torch.Tensor]:
    s = _SITES[site]
    saved = _STATES.pop(int(token), None)
    if saved is None:
        raise RuntimeRunError(
            f"the backward of torch.autograd.Function {s.name} ran twice, or after its forward's state was freed "
            "(retain_graph=True is not supported for untraceable Functions on the onnxruntime engine)"
        )
    leaves, outs = saved
    pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
    wanted = [leaf for leaf, need in zip(leaves, s.needs_grad) if need]
    got = (
        torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        if pairs
        else [None] * len(wanted)
    )
    return [torch.zeros_like(leaf) if g is None else g.contiguous() for leaf, g in zip(wanted, got)]


@function_backward.register_fake
def _(grads: list[torch.Tensor], token: torch.Tensor, site: int) -> list[torch.Tensor]:
    s = _SITES[site]
    return [torch.empty(m[0], dtype=m[1], device=m[2]) for m, need in zip(s.in_meta, s.needs_grad) if need]


#: the ops split.py always runs in PyTorch
FUNCTION_OPS = (torch.ops.ortwrap_engine.function_forward.default, torch.ops.ortwrap_engine.function_backward.default)


class _OpaqueBackward(torch.autograd.Function):
    """The backward an opaque call's node runs while AOTAutograd traces (``compat.backward_from``):
    one ``function_backward`` op."""

    @staticmethod
    def forward(ctx, *args):  # (never called: only its backward is borrowed)
        raise AssertionError("ortwrap: _OpaqueBackward.forward")

    @staticmethod
    def backward(ctx, *grads):
        site = _SITES[ctx.ortwrap_site]
        (token,) = ctx.saved_tensors
        grads = [torch.zeros(m[0], dtype=m[1], device=m[2]) if g is None else g for g, m in zip(grads, site.out_meta)]
        got = iter(torch.ops.ortwrap_engine.function_backward(grads, token, ctx.ortwrap_site))
        per_tensor = {i: (next(got) if need else None) for i, need in zip(site.tensor_at, site.needs_grad)}
        return tuple(per_tensor.get(i) for i in range(len(site.template)))


class _RecordedBackward(torch.autograd.Function):
    """The backward a traced (not opaque) call's node runs while AOTAutograd traces: the Function's own,
    with a failure recorded, so that a Function whose backward alone cannot be traced is made opaque too."""

    @staticmethod
    def forward(ctx, *args):  # (never called: only its backward is borrowed)
        raise AssertionError("ortwrap: _RecordedBackward.forward")

    @staticmethod
    def backward(ctx, *grads):
        cls, tracer = ctx.ortwrap_traced
        try:
            return cls.backward(ctx, *grads)
        except Exception:
            if cls not in tracer.failed:
                tracer.failed.append(cls)
            raise


class FunctionTracer:
    """The intercept handler of one trace: opaque calls for the classes in ``opaque``, the forward
    as it is for the others; ``failed`` records the classes whose forward or backward raised (innermost
    first)."""

    def __init__(self, opaque: set[type]) -> None:
        self.opaque = opaque
        self.failed: list[type] = []
        #: what an opaque call's probe (the Function run eagerly) raised, if it did
        self.probe_error: Exception | None = None

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        with intercept.intercept_functions(self):
            yield

    def __call__(self, cls: type, forward: Any, args: tuple, kwargs: dict) -> Any:
        if cls in self.opaque:
            return self._opaque(cls, args, kwargs)
        try:
            out = forward(*args, **kwargs)
        except Exception:
            if cls not in self.failed:
                self.failed.append(cls)
            raise
        ctx = args[0] if args else None
        if (
            isinstance(ctx, torch.autograd.function.FunctionCtx)
            and cls.vjp is torch.autograd.Function.vjp  # (a vjp-style Function keeps its own path)
            and not getattr(cls, "boxed_grads_call", False)
        ):
            ctx.ortwrap_traced = (cls, self)
            compat.backward_from(ctx, _RecordedBackward)
        return out

    def _opaque(self, cls: type, args: tuple, kwargs: dict) -> Any:
        if not args or not isinstance(args[0], torch.autograd.function.FunctionCtx):
            raise RuntimeRunError(
                f"torch.autograd.Function {state.qualified_name(cls)} cannot be traced, and only a forward(ctx, ...) "
                "Function can run in PyTorch between ORT segments (a setup_context one cannot yet); use "
                "engine='training'"
            )
        ctx, rest = args[0], args[1:]
        at = [i for i, a in enumerate(rest) if isinstance(a, torch.Tensor)]
        tensors = [rest[i] for i in at]
        needs = list(ctx.needs_input_grad)
        in_meta = [(tuple(int(d) for d in t.shape), t.dtype, t.device) for t in tensors]
        site = _Site(
            cls=cls,
            template=[None if isinstance(a, torch.Tensor) else a for a in rest],
            kwargs=kwargs,
            tensor_at=at,
            needs_grad=[bool(needs[i]) and (rest[i].is_floating_point() or rest[i].is_complex()) for i in at],
            in_meta=in_meta,
            out_meta=[],
            single=False,
        )
        # Probe: the Function on zeros of its inputs' shapes, seen by no trace and by no handler.
        # (its warnings are the real call's to give; its inputs require grad as the real ones do)
        with compat.no_dispatch_modes(), intercept.passthrough(), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            zeros = [
                torch.zeros(shape, dtype=dtype, device=device).requires_grad_(need)
                for (shape, dtype, device), need in zip(in_meta, site.needs_grad)
            ]
            versions = [compat.tensor_version(z) for z in zeros]
            try:
                raw = cls.apply(*site.arguments(zeros), **kwargs)
            except Exception as e:
                self.probe_error = e
                raise
        if [compat.tensor_version(z) for z in zeros] != versions:
            # (its op would write into a tensor the ORT segments and AOTAutograd see as unchanged)
            raise RuntimeRunError(
                f"torch.autograd.Function {site.name} cannot be traced, and it modifies an input in place "
                "(ctx.mark_dirty): an in-place Function cannot run in PyTorch between ORT segments yet; use "
                "engine='training'"
            )
        site.single = isinstance(raw, torch.Tensor)
        site.out_meta = [(tuple(o.shape), o.dtype, o.device) for o in ((raw,) if site.single else raw)]
        index = len(_SITES)
        _SITES.append(site)
        grad = any(site.needs_grad)
        result = torch.ops.ortwrap_engine.function_forward(tensors, index, grad)
        if grad:
            ctx.save_for_backward(result[-1])
            ctx.ortwrap_site = index
            compat.backward_from(ctx, _OpaqueBackward)
            result = result[:-1]
        return result[0] if site.single else tuple(result)
