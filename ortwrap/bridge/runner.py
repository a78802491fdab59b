"""The Python half of ortwrap's PythonOp / PythonOpGrad runners.

``_runner.c`` is registered with ONNX Runtime as the forward and backward runner. The first time a
PythonOp node (ORT kernel) runs, the native runner calls :func:`_forward` with ORT's arguments::

    (func_name, callback, requires_grad, tensor_flags, training, inplace_map, invoke_id, safe_mode, args)

which learns the node's constants, runs it and generates the node's forward and backward
(:func:`_generate_forward`, :func:`_generate_backward`). Every later call of the node goes straight
to its generated forward, ``run(*args)`` (the native runner caches it per node); every PythonOpGrad
call goes to the generated backward that the call's Handle carries, ``run(handle, *grads)``, or to
:func:`_backward`. Results are lists: forward ``[handle, capsule | None, ...]``, backward
``[capsule | None, ...]`` (one entry per argument of ``Function.apply``). The handlers never raise:
an exception is parked (``state.park``) and the C side returns an empty vector, which fails the
node; the caller of the ORT run then re-raises the original exception.

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

from .._compat import torch as compat
from .._ort import C
from ..errors import UnsupportedFunctionError
from ..graph.names import PYTHONOP_BOOL_MARK
from . import state
from ._native import load

# Public entry points until install() swaps in the C ones (ortwrap/_compat/torch.py): nothing
# private is touched at import time.
_from_dlpack = torch.utils.dlpack.from_dlpack
_to_dlpack = torch.utils.dlpack.to_dlpack
_Tensor = torch.Tensor
_set_grad_enabled = torch.set_grad_enabled
_is_grad_enabled = torch.is_grad_enabled
_zeros = torch.zeros


@functools.cache
def install() -> None:
    """Build (first time only), load and register the native runners with ORT. Once per process."""
    global _from_dlpack, _set_grad_enabled
    _from_dlpack = _GENERATED_GLOBALS["from_dlpack"] = compat.from_dlpack()
    _set_grad_enabled = compat.set_grad_enabled()
    lib = load("_runner")
    lib.ortwrap_bridge_set_handlers.argtypes = [ctypes.py_object] * 5
    lib.ortwrap_bridge_set_handlers.restype = ctypes.c_int
    if lib.ortwrap_bridge_set_handlers(_forward, _backward, _lookup, state.park, Handle) != 0:
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
        self.context_ids: list = []  # int64 tensors holding this run's keys in ORT's context map
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
                state.abandon([i for t in self.context_ids for i in t.reshape(-1).tolist()])
                left = 0
            state.forward_finished(left)


class Handle:
    """What ORT stores as a PythonOp's context (its output 0 is an int64 key to it).

    ``out_shapes``: per output its shape (None for a None output); ``out_diff``: None when every
    output is differentiable, else a flag per output; ``in_shapes``: input position -> shape, for
    the inputs that require grad. Per call only shapes: dtypes and devices are per node.
    ``backward``: the node's generated backward (the native runner calls it), or None.
    """

    __slots__ = ("__weakref__", "alive", "backward", "ctx", "in_shapes", "kernel", "out_diff", "out_shapes")

    def release(self) -> None:
        self.alive = False
        self.ctx = self.out_shapes = self.in_shapes = self.backward = None


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
        "bool_outputs",
        "clone",
        "cls",
        "forward",
        "in_types",
        "n_args",
        "needs_input_grad",
        "out_types",
        "rg_pos",
        "run",
        "run_backward",
        "setup_context",
        "tensor_pos",
        "want_grad",
    )

    def __init__(self, func_name: str, requires_grad, tensor_flags, training: bool) -> None:
        base, _, bools = func_name.partition(PYTHONOP_BOOL_MARK)
        cls = state.function_class(base)
        if cls is None:
            raise RuntimeError(f"PythonOp {func_name!r}: no torch.autograd.Function is registered under this name")
        self.cls = cls
        self.forward = cls.forward
        # torch documents ``vjp`` as an alias of ``backward``: a Function may define either.
        self.backward = cls.vjp if cls.backward is torch.autograd.Function.backward else cls.backward
        self.setup_context = cls.setup_context if compat.has_setup_context(cls) else None
        self.n_args = len(tensor_flags)
        self.tensor_pos = tuple(i for i, f in enumerate(tensor_flags) if f)
        self.rg_pos = frozenset(i for i in self.tensor_pos if requires_grad[i]) if training else frozenset()
        self.want_grad = bool(self.rg_pos)
        self.needs_input_grad = tuple(i in self.rg_pos for i in range(self.n_args))
        self.bool_inputs = frozenset(int(i) for i in bools.split(",")) if bools else frozenset()
        self.clone: frozenset[int] = frozenset()  # inputs saved in ctx or made dirty
        self.bool_outputs = True  # until the first call showed none
        self.out_types: list | None = None  # per output: (dtype, device, floating) or None
        self.in_types: dict[int, tuple] = {}  # per input that requires grad: (dtype, device)
        # Made by the first call (the node's generated forward and backward, see _generate_*).
        self.run = None
        self.run_backward = None


_kernels: dict[str, _Kernel] = {}
_bool = torch.bool
_uint8 = torch.uint8
_contiguous = torch.contiguous_format
_weakref = weakref.ref
_new_context = object.__new__


def _export(t: _Tensor, foreign: list[int]) -> object:
    """DLPack capsule for an output: contiguous, not in an ORT input buffer, bool as uint8.

    (Bridged Functions run with grad mode off: their outputs never require grad.)"""
    if t.untyped_storage().data_ptr() in foreign and t.numel():
        t = t.clone(memory_format=_contiguous)
    elif not t.is_contiguous():
        t = t.contiguous()
    if t.dtype is _bool:
        t = t.view(_uint8)
    return _to_dlpack(t)


def _non_tensor_output(k: _Kernel, o: object) -> UnsupportedFunctionError:
    return UnsupportedFunctionError(
        f"torch.autograd.Function {state.qualified_name(k.cls)} returned a non-tensor output "
        f"({type(o).__name__}); ortwrap can only run Functions whose outputs are all tensors "
        "inside ONNX Runtime. Return tensors, or keep this module out of ORTWrap."
    )


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
    k.bool_outputs = any(o is not None and o.dtype is _bool for o in outs)
    if k.want_grad and k.out_types is None:
        k.out_types = [(o.dtype, o.device, o.is_floating_point()) if o is not None else None for o in outs]
        k.in_types = {i: (passed[i].dtype, passed[i].device) for i in k.rg_pos if i in passed}


def _call(k: _Kernel, ctx: FunctionContext, call: list) -> object:
    """The Function's forward, with grad mode off (as in ``Function.apply``)."""
    prev = _is_grad_enabled()
    _set_grad_enabled(False)
    try:
        if k.setup_context is None:
            return k.forward(ctx, *call)
        outs = k.forward(*call)
        k.setup_context(ctx, tuple(call), outs)
        return outs
    finally:
        _set_grad_enabled(prev)


def _call_backward(k: _Kernel, ctx: FunctionContext, grads: list) -> object:
    """The Function's backward, with grad mode off (a double backward is not supported)."""
    prev = _is_grad_enabled()
    _set_grad_enabled(False)
    try:
        return k.backward(ctx, *grads)
    finally:
        _set_grad_enabled(prev)


def _grad_count(k: _Kernel, r: tuple) -> tuple:
    """The backward's result trimmed to one entry per argument of ``apply``, as autograd checks it."""
    n_in = k.n_args
    if len(r) > n_in and all(x is None for x in r[n_in:]):  # autograd accepts extra Nones
        return r[:n_in]
    raise RuntimeError(
        f"function {k.cls.__name__}Backward returned an incorrect number of gradients (expected {n_in}, got {len(r)})"
    )


def _non_variable_grad(k: _Kernel, i: int) -> RuntimeError:
    return RuntimeError(
        f"function {k.cls.__name__}Backward returned a gradient different than None at position {i + 1}, but the "
        "corresponding forward input was not a Variable"
    )


def _sum_to(k: _Kernel, i: int, g: _Tensor, shape) -> _Tensor:
    """A gradient of another shape than its input: reduced like autograd does, or refused."""
    try:
        return g.sum_to_size(shape)
    except RuntimeError:
        raise RuntimeError(
            f"Function {k.cls.__name__}Backward returned an invalid gradient at index {i} - got "
            f"{list(g.shape)} but expected shape compatible with {list(shape)}"
        ) from None


# ------------------------------------------------------------------------------ generic forward


def _forward(func_name, callback, requires_grad, tensor_flags, training, inplace_map, invoke_id, safe_mode, args):
    """A node's first call, with ORT's full argument list: learn its constants, then run it.

    Later calls take ``_lookup(invoke_id)``, the node's generated forward."""
    try:
        k = _kernels.get(invoke_id)
        if k is None:
            k = _kernels[invoke_id] = _Kernel(func_name, requires_grad, tensor_flags, training)
    except BaseException as e:
        state.park(e)
        return None
    if k.run is not None:  # a known node (the native cache evicted it)
        return k.run(*args)
    return _run_forward(k, args, first=True)


def _lookup(invoke_id: str):
    """The native runner's per-node entry point: the node's generated forward, once it exists."""
    k = _kernels.get(invoke_id)
    return None if k is None else k.run


def _run_forward(k: _Kernel, args: tuple, first: bool = False):
    """The reference forward: a node's first call (which learns what the Function keeps: every
    input is cloned until then) and the calls the generated forward does not handle."""
    try:
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
                t = t.view(_bool)
            if first or i in k.clone:
                t = t.clone()  # kept by the Function: must not live in a buffer ORT may reuse
            if i in k.rg_pos:
                t.requires_grad_(True)  # as in eager: forward may branch on it (grad mode stays off)
            call[i] = t
            passed[i] = t
        ctx = _new_context(FunctionContext)
        ctx.needs_input_grad = k.needs_input_grad
        outs = _call(k, ctx, call)
        if type(outs) is not tuple:
            outs = (outs,)
        if first:
            for o in outs:
                if o is not None and not isinstance(o, _Tensor):
                    raise _non_tensor_output(k, o)
            _learn(k, ctx, outs, passed)
            k.run_backward = _generate_backward(k)
        result = _forward_outputs(k, ctx, outs, foreign, {i: passed[i].shape for i in k.rg_pos if i in passed})
        if first:
            k.run = _generate_forward(k, len(outs))
        return result
    except BaseException as e:
        state.park(e)
        return None


def _forward_outputs(k: _Kernel, ctx: FunctionContext, outs: tuple, foreign: list[int], in_shapes: dict) -> list:
    """ORT's result list: the Handle (None without grad), then each output's capsule (or None)."""
    for o in outs:
        if o is not None and not isinstance(o, _Tensor):
            raise _non_tensor_output(k, o)
    if k.want_grad:
        h = Handle()
        h.alive = True
        h.ctx = ctx
        h.kernel = k
        h.backward = k.run_backward
        h.in_shapes = in_shapes
        h.out_shapes = [None if o is None else o.shape for o in outs]
        frozen = ctx.non_differentiable
        h.out_diff = [not any(o is f for f in frozen) for o in outs] if frozen else None
        record = getattr(_current, "record", None)
        if record is not None:
            record.handles.append(_weakref(h))
        result: list = [h]
    else:
        result = [None]  # ORT requires None when training_mode == 0
    for o in outs:
        result.append(None if o is None else _export(o, foreign))
    return result


# ------------------------------------------------------------------------------ generic backward


def _backward(*args):
    """The reference backward (PythonOpGrad): ``args`` is the context ORT kept for the call, then
    one gradient per output. The native runner calls it when the Handle has no generated backward
    (or is no Handle: a forward without grad, a released context)."""
    h = args[0]
    try:
        if type(h) is not Handle:
            raise RuntimeError("PythonOpGrad: the forward produced no context")
        if not h.alive:
            raise RuntimeError(
                f"PythonOpGrad of {state.qualified_name(h.kernel.cls)}: its context was released before backward ran"
            )
        k: _Kernel = h.kernel
        ctx = h.ctx
        out_diff = h.out_diff
        foreign: list[int] = []
        grads = []
        for j, (shape, out_type, a) in enumerate(zip(h.out_shapes, k.out_types, args[1:])):
            if shape is None:
                grads.append(None)
            elif a is not None and out_type[2] and (out_diff is None or out_diff[j]):  # a differentiable output
                g = _from_dlpack(a)
                foreign.append(g.untyped_storage().data_ptr())
                grads.append(g)
            elif ctx.materialize_grads:
                grads.append(_zeros(shape, dtype=out_type[0], device=out_type[1]))
            else:
                grads.append(None)
        r = _call_backward(k, ctx, grads)
        if type(r) is not tuple:
            r = (r,)
        if len(r) != k.n_args:
            r = _grad_count(k, r)
        out = []
        for i, g in enumerate(r):
            shape = h.in_shapes.get(i)
            if shape is None:
                if g is not None and i not in k.tensor_pos:
                    raise _non_variable_grad(k, i)
                out.append(None)
                continue
            dtype, device = k.in_types[i]
            if g is None:
                g = _zeros(shape, dtype=dtype, device=device)
            else:
                if g.shape != shape:
                    g = _sum_to(k, i, g, shape)
                if g.dtype is not dtype:
                    g = g.to(dtype)
            out.append(_export(g, foreign))
        return out
    except BaseException as e:
        state.park(e)
        return None
    finally:
        if type(h) is Handle:
            h.release()  # ORT drops its reference right after this call returns


# ------------------------------------------------------------------------------ generated code
#
# A node's calls after its first run the same steps with the same constants every time (which
# arguments are tensors, which require grad or are kept by the Function, how many outputs, their
# dtypes), so after the first call ortwrap generates a forward and a backward for the node with
# those decisions taken: straight-line code, one local per argument and output, no loops. This is
# the per-call hot path (about 40% less Python work than the reference functions above, which
# remain the specification and handle every call the generated code does not: a missing input,
# another output count, a released context).

_GENERATED_GLOBALS = {
    "FunctionContext": FunctionContext,
    "Handle": Handle,
    "Tensor": _Tensor,
    "bool_": _bool,
    "call": _call,
    "call_backward": _call_backward,
    "current": _current,
    "forward_outputs": _forward_outputs,
    "from_dlpack": _from_dlpack,
    "generic_backward": _backward,
    "grad_count": _grad_count,
    "is_grad_enabled": _is_grad_enabled,
    "new_context": _new_context,
    "non_tensor": _non_tensor_output,
    "non_variable": _non_variable_grad,
    "park": state.park,
    "run_forward": _run_forward,
    "sum_to": _sum_to,
    "to_dlpack": _to_dlpack,
    "uint8": _uint8,
    "weak": _weakref,
    "zeros": _zeros,
}


def _compile(k: _Kernel, lines: list[str], name: str, **constants):
    namespace = dict(_GENERATED_GLOBALS, k=k, **constants)
    exec(compile("\n".join(lines), f"<ortwrap {name} of {state.qualified_name(k.cls)}>", "exec"), namespace)
    return namespace["run"]


def _in_buffer(buffers: list[str]) -> str:
    """Python test: is address ``q`` in one of the ORT input buffers ``buffers`` (``[p<i>, e<i>)``)?

    A tensor from DLPack spans its whole buffer, and anything sharing that memory (a view, a
    detached alias) starts inside it: one ``data_ptr()`` per tensor, no storage objects."""
    return " or ".join(f"p{b} <= q < e{b}" for b in buffers)


def _generate_forward(k: _Kernel, n_out: int):
    """The node's forward for its later calls: ``run(*ORT's arguments) -> ORT's result list``."""
    if n_out == 0:
        return lambda *args: _run_forward(k, args)
    args = [f"a{i}" for i in range(k.n_args)]
    tensors = [i for i in k.tensor_pos]
    call = ", ".join(f"t{i}" if i in tensors else f"a{i}" for i in range(k.n_args))
    buffers = [str(i) for i in tensors]
    foreign = ", ".join(f"p{i}" for i in tensors)  # the reference's list of ORT buffers
    in_shapes = "{" + ", ".join(f"{i}: t{i}.shape" for i in tensors if i in k.rg_pos) + "}"
    outs = [f"o{j}" for j in range(n_out)]
    L = [f"def run({', '.join(args)}):", "    try:"]
    if tensors:  # ORT passes None for a missing input: the reference handles it
        L += [
            f"        if {' or '.join(f'a{i} is None' for i in tensors)}:",
            f"            return run_forward(k, ({', '.join(args)},))",
        ]
    for i in tensors:
        L += [
            f"        t{i} = from_dlpack(a{i})",
            f"        p{i} = t{i}.data_ptr()",
            f"        e{i} = p{i} + t{i}.nbytes",
        ]
        if i in k.bool_inputs:
            L.append(f"        t{i} = t{i}.view(bool_)")
        if i in k.clone:  # kept by the Function: must not live in a buffer ORT may reuse
            L.append(f"        t{i} = t{i}.clone()")
        if i in k.rg_pos:  # as in eager: forward may branch on it (grad mode stays off)
            L.append(f"        t{i}.requires_grad_(True)")
    L.append("        ctx = new_context(NodeContext)")
    if k.setup_context is None:  # ORT's training runs are inside an autograd.Function: grad is off
        L += [
            "        if is_grad_enabled():",
            f"            outs = call(k, ctx, [{call}])",
            "        else:",
            f"            outs = forward(ctx, {call})",
        ]
    else:
        L.append(f"        outs = call(k, ctx, [{call}])")
    L += [
        "        if type(outs) is not tuple:",
        "            outs = (outs,)",
        f"        if len(outs) != {n_out}:",
        f"            return forward_outputs(k, ctx, outs, [{foreign}], {in_shapes})",
        f"        {', '.join(outs)}, = outs",
    ]
    for o in outs:
        L += [f"        if {o} is not None and not isinstance({o}, Tensor):", f"            raise non_tensor(k, {o})"]
    if k.want_grad:
        L += [
            "        h = Handle()",
            "        h.alive = True",
            "        h.ctx = ctx",
            "        h.kernel = k",
            "        h.backward = node_backward",
            f"        h.in_shapes = {in_shapes}",
            "        frozen = ctx.non_differentiable",
            "        h.out_diff = [not any(o is f for f in frozen) for o in outs] if frozen else None",
            "        record = getattr(current, 'record', None)",
            "        if record is not None:",
            "            record.handles.append(weak(h))",
        ]
    for j, o in enumerate(outs):
        L += [f"        if {o} is None:", f"            c{j} = None"]
        if k.want_grad:
            L += [f"            s{j} = None", "        else:", f"            s{j} = {o}.shape"]
        else:
            L.append("        else:")
        L += _dense_lines(o, buffers, "            ")  # outputs ORT may reuse are copied
        if k.bool_outputs:
            L += [f"            if {o}.dtype is bool_:", f"                {o} = {o}.view(uint8)"]
        L.append(f"            c{j} = to_dlpack({o})")
    capsules = ", ".join(f"c{j}" for j in range(n_out))
    if k.want_grad:
        L += [f"        h.out_shapes = [{', '.join(f's{j}' for j in range(n_out))}]", f"        return [h, {capsules}]"]
    else:
        L.append(f"        return [None, {capsules}]")  # ORT requires None when training_mode == 0
    L += ["    except BaseException as e:", "        park(e)", "        return None"]
    # The node's context class: needs_input_grad is a class attribute, so a context costs no
    # attribute set (no instance dict) until the Function stores something on it.
    context = type(FunctionContext.__name__, (FunctionContext,), {"needs_input_grad": k.needs_input_grad})
    context.__module__ = FunctionContext.__module__
    return _compile(k, L, "forward", forward=k.forward, NodeContext=context, node_backward=k.run_backward)


def _dense_lines(var: str, buffers, indent: str) -> list[str]:
    """Generated lines that make ``var`` a dense tensor ORT may keep: a copy if it lies in one of
    ``buffers`` (an ORT input buffer, which ORT may reuse), else contiguous."""
    contiguous = f"{var}.clone() if {var}.is_contiguous() else {var}.contiguous()"
    if buffers:
        lines = [
            f"{indent}q = {var}.data_ptr()",
            f"{indent}if {_in_buffer(buffers)}:",
            f"{indent}    {var} = {contiguous}",
            f"{indent}elif not {var}.is_contiguous():",
        ]
    else:
        lines = [f"{indent}if not {var}.is_contiguous():"]
    return [*lines, f"{indent}    {var} = {var}.contiguous()"]


def _generate_backward(k: _Kernel):
    """The node's backward: ``run(handle, *grads) -> ORT's result list``, or None (the reference)."""
    if not k.want_grad or k.out_types is None or any(i not in k.in_types for i in k.rg_pos):
        return None
    n_out = len(k.out_types)
    grads = [f"g{j}" for j in range(n_out)]
    constants: dict[str, object] = {"backward": k.backward}
    L = [
        "def run(h, *grads):",
        "    try:",
        f"        if len(grads) != {n_out}:",
        "            return generic_backward(h, *grads)",
        f"        {', '.join(grads)}, = grads",
        "        ctx = h.ctx",
        "        shapes = h.out_shapes",
        "        out_diff = h.out_diff",
    ]
    buffers = []
    for j, out_type in enumerate(k.out_types):
        if out_type is None:  # the output was None: so is its gradient
            L.append(f"        x{j} = None")
            continue
        constants[f"odt{j}"], constants[f"odev{j}"], floating = out_type
        if floating:
            buffers.append(str(j))
            L.append(f"        p{j} = e{j} = -1")  # not an ORT buffer
        L += [f"        s{j} = shapes[{j}]", f"        if s{j} is None:", f"            x{j} = None"]
        if floating:  # a differentiable output
            L += [
                f"        elif g{j} is not None and (out_diff is None or out_diff[{j}]):",
                f"            x{j} = from_dlpack(g{j})",
                f"            p{j} = x{j}.data_ptr()",
                f"            e{j} = p{j} + x{j}.nbytes",
            ]
        L += [
            "        elif ctx.materialize_grads:",
            f"            x{j} = zeros(s{j}, dtype=odt{j}, device=odev{j})",
            "        else:",
            f"            x{j} = None",
        ]
    xs = ", ".join(f"x{j}" for j in range(n_out))
    L += [
        "        if is_grad_enabled():",
        f"            r = call_backward(k, ctx, [{xs}])",
        "        else:",  # ORT's backward runs inside RunTrainingGraph.backward: grad mode is off
        f"            r = backward(ctx, {xs})",
        "        if type(r) is not tuple:",
        "            r = (r,)",
        f"        if len(r) != {k.n_args}:",
        "            r = grad_count(k, r)",
        f"        {', '.join(f'r{i}' for i in range(k.n_args))}, = r",
        "        in_shapes = h.in_shapes",
    ]
    for i in range(k.n_args):
        r = f"r{i}"
        if i not in k.tensor_pos:
            L += [f"        if {r} is not None:", f"            raise non_variable(k, {i})", f"        c{i} = None"]
        elif i not in k.rg_pos:
            L.append(f"        c{i} = None")
        else:
            constants[f"idt{i}"], constants[f"idev{i}"] = k.in_types[i]
            L += [
                f"        s = in_shapes.get({i})",
                "        if s is None:",
                f"            c{i} = None",
                "        else:",
                f"            if {r} is None:",
                f"                {r} = zeros(s, dtype=idt{i}, device=idev{i})",
                "            else:",
                f"                if {r}.shape != s:",
                f"                    {r} = sum_to(k, {i}, {r}, s)",
                f"                if {r}.dtype is not idt{i}:",
                f"                    {r} = {r}.to(idt{i})",
            ]
            L += _dense_lines(r, buffers, "                ")  # gradients ORT may reuse are copied
            L.append(f"            c{i} = to_dlpack({r})")
    L += [
        "        h.alive = False",  # ORT drops its reference (the last one) right after this call
        f"        return [{', '.join(f'c{i}' for i in range(k.n_args))}]",
        "    except BaseException as e:",
        "        park(e)",
        "        h.release()",
        "        return None",
    ]
    return _compile(k, L, "backward", **constants)
