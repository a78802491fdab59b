"""The Python half of ortwrap's PythonOp / PythonOpGrad runners.

``_runner.c`` is registered with ONNX Runtime as the forward and backward runner. For every
PythonOp (PythonOpGrad) kernel call it calls :func:`_forward` (:func:`_backward`) with ORT's
arguments as Python objects::

    (func_name, callback, requires_grad, tensor_flags, training, inplace_map, invoke_id, safe_mode, args)

and expects a list back: forward ``[handle, capsule | None, ...]``, backward ``[capsule | None, ...]``
(one entry per argument of ``Function.apply``). The handlers never raise: an exception is parked
(``state.park``) and the C side returns an empty vector, which fails the node; the caller of the
ORT run then re-raises the original exception.

NOTE: ownership and lifetime.
- ORT stores the forward's :class:`Handle` in its context map (it is the only owner: unsafe run
  mode) and drops it right after PythonOpGrad ran. The Handle holds the torch context of the call,
  which holds what ``save_for_backward`` saved. ``Handle.release`` drops that early when no
  backward will run (see ``RunRecord``).
- ORT, not autograd, drives the Function: its ``forward`` and ``backward`` are called directly
  with a :class:`FunctionContext` (no autograd graph is built for the call).
- Tensors arrive in ORT's buffers. ORT may reuse an input buffer once the PythonOp ran, so inputs
  that the Function keeps (saved for backward, or modified in place) are cloned; the first call of
  each node learns which those are. An output or gradient that shares an ORT input buffer is cloned.
- Bool tensors cannot cross PythonOp (ORT 1.19.2 refuses DLPack's bool): the exporter casts bool
  inputs to uint8 and names their positions in the function name (``name|bool=0,2``); bool outputs
  leave as uint8 and the graph casts them back.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import types
import weakref

import torch

from .._ort import C
from ..errors import UnsupportedFunctionError
from . import state
from ._native import load

_from_dlpack = torch._C._from_dlpack
_to_dlpack = torch._C._to_dlpack
_Tensor = torch.Tensor
_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch.is_grad_enabled
_zeros = torch.zeros

BOOL_MARK = "|bool="


@functools.cache
def install() -> None:
    """Build (first time only), load and register the native runners with ORT. Once per process."""
    lib = load("_runner")
    lib.ortwrap_bridge_set_handlers.argtypes = [ctypes.py_object] * 5
    lib.ortwrap_bridge_set_handlers.restype = ctypes.c_int
    if lib.ortwrap_bridge_set_handlers(_forward, _backward, state.park, _forward_fast, _backward_fast) != 0:
        raise RuntimeError("ortwrap: initializing the PythonOp runners failed")
    C.register_forward_runner(ctypes.cast(lib.ortwrap_forward_runner, ctypes.c_void_p).value)
    C.register_backward_runner(ctypes.cast(lib.ortwrap_backward_runner, ctypes.c_void_p).value)


# ------------------------------------------------------------------------------------- run records
_current = threading.local()


class RunRecord:
    """The PythonOp contexts created by one training forward of a graph.

    Created by the autograd bridge around ``run_forward``; the runner appends each Handle. When the
    graph's backward ran, every Handle was consumed; if the record dies first (outputs dropped
    without backward), its Handles are released and their map entries counted as stale.
    """

    __slots__ = ("context_ids", "done", "handles")

    def __init__(self) -> None:
        # Weak: ORT must be the only owner of a Handle (unsafe run mode checks the refcount).
        self.handles: list[weakref.ref[Handle]] = []
        self.context_ids: list = []  # int64 tensors: this run's keys in ORT's context map
        self.done = False
        state.forward_started()

    def __enter__(self) -> RunRecord:
        _current.record = self
        return self

    def __exit__(self, *exc) -> None:
        _current.record = None

    def _release(self) -> int:
        left = 0
        for ref in self.handles:
            h = ref()
            if h is not None and h.alive:
                h.release()
                left += 1
        self.handles = []
        return left

    def finish(self) -> None:
        """The backward ran (or the run failed): what ORT did not erase is counted as stale."""
        if not self.done:
            self.done = True
            state.forward_finished(self._release())
            state.maybe_purge()

    def __del__(self) -> None:
        if not self.done:
            self.done = True
            left = self._release()
            if left and self.context_ids:
                # No backward will erase these entries: queue them for the janitor (run later, at a
                # safe point: this may be called by the garbage collector inside an ORT run).
                state.abandon([int(t) for t in self.context_ids])
                left = 0
            state.forward_finished(left)


class Handle:
    """What ORT stores as a PythonOp's context (its output 0 is an int64 key to it)."""

    __slots__ = ("__weakref__", "alive", "ctx", "in_meta", "kernel", "out_meta")

    def release(self) -> None:
        self.alive = False
        self.ctx = self.out_meta = self.in_meta = None


class FunctionContext:
    """The ``ctx`` a bridged Function's forward and backward receive.

    ORT, not autograd, drives a bridged Function, so its ``forward`` and ``backward`` are called
    directly (no autograd graph is built for the call: that is most of ``Function.apply``'s cost)
    with this context, which implements the ``FunctionCtx`` API Functions use.
    """

    # Defaults as class attributes: a context costs one attribute set until the Function uses it.
    to_save: tuple = ()
    dirty_tensors: tuple = ()
    non_differentiable: tuple = ()
    materialize_grads = True

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad

    def save_for_backward(self, *tensors) -> None:
        self.to_save = tensors

    @property
    def saved_tensors(self) -> tuple:
        return self.to_save

    saved_variables = saved_tensors

    def save_for_forward(self, *tensors) -> None:
        pass

    def mark_dirty(self, *tensors) -> None:
        self.dirty_tensors = tensors

    def mark_non_differentiable(self, *tensors) -> None:
        self.non_differentiable = tensors

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = bool(value)


class _Kernel:
    """One PythonOp node (ORT's kernel invoke id): constants of the node and what its first run
    learned. requires_grad flags, tensor flags and training mode are node attributes."""

    __slots__ = (
        "backward",
        "bool_inputs",
        "clone",
        "cls",
        "first",
        "forward",
        "in_types",
        "n_args",
        "needs_input_grad",
        "out_types",
        "rg_pos",
        "setup_context",
        "tensor_pos",
        "want_grad",
    )

    def __init__(self, func_name: str, requires_grad, tensor_flags, training: bool) -> None:
        base, _, bools = func_name.partition(BOOL_MARK)
        cls = state.function_class(base)
        if cls is None:
            raise RuntimeError(f"PythonOp {func_name!r}: no torch.autograd.Function is registered under this name")
        self.cls = cls
        self.forward = cls.forward
        base = torch.autograd.function._SingleLevelFunction
        # torch documents ``vjp`` as an alias of ``backward``: a Function may define either.
        self.backward = cls.vjp if cls.backward is base.backward else cls.backward
        has_setup = cls.setup_context is not torch.autograd.function._SingleLevelFunction.setup_context
        self.setup_context = cls.setup_context if has_setup else None
        self.n_args = len(tensor_flags)
        self.tensor_pos = tuple(i for i, f in enumerate(tensor_flags) if f)
        self.rg_pos = frozenset(i for i in self.tensor_pos if requires_grad[i]) if training else frozenset()
        self.want_grad = bool(self.rg_pos)
        self.needs_input_grad = tuple(i in self.rg_pos for i in range(self.n_args))
        self.bool_inputs = frozenset(int(i) for i in bools.split(",")) if bools else frozenset()
        self.clone: frozenset[int] = frozenset()  # inputs saved in ctx or made dirty
        self.first = True
        self.out_types: list | None = None  # per output: (dtype, device, floating) or None
        self.in_types: dict[int, tuple] = {}  # per input that requires grad: (dtype, device)


_kernels: dict[str, _Kernel] = {}


def _export(t: _Tensor, foreign: list[int]) -> object:
    """DLPack capsule for an output: contiguous, not in an ORT input buffer, bool as uint8.

    (Bridged Functions run with grad mode off: their outputs never require grad.)"""
    if foreign and t.numel() and t.untyped_storage().data_ptr() in foreign:
        t = t.clone(memory_format=torch.contiguous_format)
    elif not t.is_contiguous():
        t = t.contiguous()
    if t.dtype is torch.bool:
        t = t.view(torch.uint8)
    return _to_dlpack(t)


def _tensors_in(values: list, depth: int = 3) -> list[_Tensor]:
    """Tensors in ``values``, also inside lists, tuples, dicts and plain objects' attributes."""
    found = []
    for v in values:
        if isinstance(v, _Tensor):
            found.append(v)
        elif not depth:
            continue
        elif isinstance(v, (list, tuple)):
            found += _tensors_in(list(v), depth - 1)
        elif isinstance(v, dict):
            found += _tensors_in(list(v.values()), depth - 1)
        elif hasattr(v, "__dict__") and not isinstance(
            v, (type, types.ModuleType, types.FunctionType, torch.nn.Module)
        ):
            found += _tensors_in(list(vars(v).values()), depth - 1)
    return found


def _learn(k: _Kernel, ctx: FunctionContext, outs: tuple, passed: dict[int, _Tensor]) -> None:
    """First run of a node: which inputs does the Function keep (saved, or modified in place)?"""
    keep = set()
    by_storage = {t.untyped_storage().data_ptr(): i for i, t in passed.items() if t.numel()}
    # What the backward can reach: saved tensors, dirty ones, and tensors kept as ctx attributes
    # (``ctx.x = x``, also inside lists, tuples and dicts).
    for s in (*ctx.to_save, *ctx.dirty_tensors, *_tensors_in(list(ctx.__dict__.values()))):
        if isinstance(s, _Tensor) and s.numel():
            pos = by_storage.get(s.untyped_storage().data_ptr())
            if pos is not None:
                keep.add(pos)
    for o in outs:  # an output returned in place of its input
        for i, t in passed.items():
            if o is t:
                keep.add(i)
    k.clone = frozenset(keep)
    k.first = False


def _forward(func_name, callback, requires_grad, tensor_flags, training, inplace_map, invoke_id, safe_mode, args):
    """First call of a PythonOp node: learn its constants, then run it."""
    try:
        k = _kernels.get(invoke_id)
        if k is None:
            k = _kernels[invoke_id] = _Kernel(func_name, requires_grad, tensor_flags, training)
    except BaseException as e:
        state.park(e)
        return None
    return _run_forward(k, args)


def _forward_fast(invoke_id, args):
    """Later calls: the C runner passes only the node's id and its arguments."""
    return _run_forward(_kernels[invoke_id], args)


def _run_forward(k: _Kernel, args: tuple):
    try:
        first, clone, rg_pos = k.first, k.clone, k.rg_pos
        call = list(args)
        foreign: list[int] = []  # ORT-owned input buffers
        passed: dict[int, _Tensor] = {}
        for i in k.tensor_pos:
            a = call[i]
            if a is None:
                continue
            t = _from_dlpack(a)
            foreign.append(t.untyped_storage().data_ptr())
            if i in k.bool_inputs:
                t = t.view(torch.bool)
            if first or i in clone:
                t = t.clone()  # kept by the Function: must not live in a buffer ORT may reuse
            if i in rg_pos:
                t.requires_grad_(True)  # as in eager: forward may branch on it (grad mode stays off)
            call[i] = t
            passed[i] = t

        ctx = _new_context(FunctionContext)
        ctx.needs_input_grad = k.needs_input_grad
        prev = _is_grad_enabled()
        _set_grad_enabled(False)
        try:
            if k.setup_context is None:
                outs = k.forward(ctx, *call)
            else:
                outs = k.forward(*call)
                k.setup_context(ctx, tuple(call), outs)
        finally:
            _set_grad_enabled(prev)
        if type(outs) is not tuple:
            outs = (outs,)
        for o in outs:
            if o is not None and not isinstance(o, _Tensor):
                raise UnsupportedFunctionError(
                    f"torch.autograd.Function {state.qualified_name(k.cls)} returned a non-tensor output "
                    f"({type(o).__name__}); ortwrap can only run Functions whose outputs are all tensors "
                    "inside ONNX Runtime. Return tensors, or keep this module out of ORTWrap."
                )
        if first:
            _learn(k, ctx, outs, passed)

        if not k.want_grad:
            result: list = [None]  # ORT requires None when training_mode == 0
        else:
            h = Handle()
            h.alive = True
            h.ctx = ctx
            h.kernel = k
            frozen = ctx.non_differentiable
            # Per call only shapes; dtypes and devices are per node (kernel.types).
            h.out_meta = [
                (o.shape, not frozen or not any(o is f for f in frozen)) if o is not None else None for o in outs
            ]
            h.in_meta = {i: passed[i].shape for i in rg_pos if i in passed}
            if k.out_types is None:
                k.out_types = [(o.dtype, o.device, o.is_floating_point()) if o is not None else None for o in outs]
                k.in_types = {i: (passed[i].dtype, passed[i].device) for i in rg_pos if i in passed}
            record = getattr(_current, "record", None)
            if record is not None:
                record.handles.append(weakref.ref(h))
            result = [h]
        for o in outs:
            result.append(None if o is None else _export(o, foreign))
        return result
    except BaseException as e:
        state.park(e)
        return None


_new_context = object.__new__


def _backward(func_name, callback, requires_grad, tensor_flags, training, inplace_map, invoke_id, safe_mode, args):
    return _backward_fast(invoke_id, args)


def _backward_fast(invoke_id, args):
    h = args[0]
    try:
        if type(h) is not Handle:
            raise RuntimeError(f"PythonOpGrad {invoke_id}: the forward produced no context")
        if not h.alive:
            raise RuntimeError(
                f"PythonOpGrad of {state.qualified_name(h.kernel.cls)}: its context was released before backward ran"
            )
        k: _Kernel = h.kernel
        in_meta, ctx = h.in_meta, h.ctx
        materialize = ctx.materialize_grads
        foreign: list[int] = []
        grads = []
        for meta, types, a in zip(h.out_meta, k.out_types, args[1:]):
            if meta is None:
                grads.append(None)
                continue
            g = None
            if a is not None and meta[1] and types[2]:  # a differentiable (floating) output
                g = _from_dlpack(a)
                foreign.append(g.untyped_storage().data_ptr())
            elif materialize:
                g = _zeros(meta[0], dtype=types[0], device=types[1])
            grads.append(g)
        prev = _is_grad_enabled()
        _set_grad_enabled(False)
        try:
            r = k.backward(ctx, *grads)
        finally:
            _set_grad_enabled(prev)
        if type(r) is not tuple:
            r = (r,)
        n_in = k.n_args
        if len(r) != n_in:
            if len(r) > n_in and all(x is None for x in r[n_in:]):  # autograd accepts extra Nones
                r = r[:n_in]
            else:
                raise RuntimeError(
                    f"function {k.cls.__name__}Backward returned an incorrect number of gradients "
                    f"(expected {n_in}, got {len(r)})"
                )
        out = []
        for i, g in enumerate(r):
            meta = in_meta.get(i)
            if meta is None:
                if g is not None and i not in k.tensor_pos:
                    raise RuntimeError(
                        f"function {k.cls.__name__}Backward returned a gradient different than None at position "
                        f"{i + 1}, but the corresponding forward input was not a Variable"
                    )
                out.append(None)
                continue
            shape = meta
            dtype, device = k.in_types[i]
            if g is None:
                g = _zeros(shape, dtype=dtype, device=device)
            else:
                if g.shape != shape:
                    try:
                        g = g.sum_to_size(shape)
                    except RuntimeError:
                        raise RuntimeError(
                            f"Function {k.cls.__name__}Backward returned an invalid gradient at index {i} - got "
                            f"{list(g.shape)} but expected shape compatible with {list(shape)}"
                        ) from None
                if g.dtype != dtype:
                    g = g.to(dtype)
            out.append(_export(g, foreign))
        return out
    except BaseException as e:
        state.park(e)
        return None
    finally:
        if type(h) is Handle:
            h.release()  # ORT drops its reference right after this call returns
