"""Export of ``torch.autograd.Function`` calls as ``com.microsoft::PythonOp`` nodes.

The TorchScript exporter keeps each Function call as a ``prim::PythonOp`` node (with the ops its
forward ran as a sub-block); ortwrap's symbolic for it (installed only during ortwrap's exports)
emits one PythonOp whose attributes encode the call, following ORT 1.19.2's schema:

==============================  ==================================================================
argument of ``Function.apply``  encoding
==============================  ==================================================================
tensor                          a node input (bool tensors cast to uint8, see ``runner.py``)
bool / int / float              ``input_{bool,int,float}_scalars`` + ``..._positions``
tuple of bool / int / float     ``input_{bool,int,float}_tuples`` + ``..._positions`` + ``..._begins``
anything else                   ``input_pointer_scalars`` (the object's address) + positions; the
                                object is kept alive by the program that owns the graph
==============================  ==================================================================

(None, str, dict, modules, process groups, callables all go by pointer. Floats are float32
attributes; pass a float by pointer if it must be exact: wrap it in a 1-tuple of mixed types.)

Outputs: ORT's context id (added by ``passes/pythonop_context.py`` as output 0), then the tensors.
A Function listed in ``Options.inline_functions`` is not bridged: the symbolic exports the ops of
the node's sub-block instead (differentiated by ORT). How calls are routed through ortwrap while it
exports, without touching ``Function.apply``: ``bridge/intercept.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .._compat import torch as compat
from ..graph.names import PYTHONOP_BOOL_MARK
from . import intercept, state
from .runner import install

_BOOL = 9
_UINT8 = 2
_ONNX_TYPES = {
    "Float": 1,
    "Byte": 2,
    "Char": 3,
    "Short": 5,
    "Int": 6,
    "Long": 7,
    "Bool": _BOOL,
    "Half": 10,
    "Double": 11,
    "BFloat16": 16,
}


@dataclass
class ExportScope:
    """What one export's PythonOps refer to.

    Attributes:
        keepalive: objects whose addresses are ``input_pointer_scalars`` of the graph. The program
            built from the graph holds this list, so the objects live exactly as long as it can run.
        functions: unique names of the Functions bridged.
        with_backward: the graph gets a backward (PythonOp ``training_mode=1``, contexts kept).
        inline: qualified names of Functions to inline instead of bridging.
    """

    with_backward: bool
    inline: frozenset[str] = frozenset()
    keepalive: list[object] = field(default_factory=list)
    functions: list[str] = field(default_factory=list)


_scope: contextvars.ContextVar[ExportScope | None] = contextvars.ContextVar("ortwrap_bridge_scope", default=None)


class BridgeExportError(ValueError):
    """A Function call cannot be bridged; the message names the Function.

    (Not a RuntimeError: the exporter would turn that into an ATen fallback node.)"""


def _onnx_type(value, what: str, fn: str) -> int:
    t = value.type()
    scalar = t.scalarType() if hasattr(t, "scalarType") else None
    if scalar is None or scalar not in _ONNX_TYPES:
        raise BridgeExportError(f"torch.autograd.Function {fn}: {what} has type {t}, which ortwrap cannot bridge")
    return _ONNX_TYPES[scalar]


def _rank(value, what: str, fn: str) -> int:
    r = value.type().dim()
    if r is None:
        raise BridgeExportError(f"torch.autograd.Function {fn}: the rank of {what} is unknown")
    return r


def encode_call(
    cls: type, items: list[tuple[str, object]], out_types: list[int], out_ranks: list[int], scope: ExportScope
) -> dict[str, object]:
    """The PythonOp attributes of one call of ``cls`` (TorchScript ``g.op`` keyword style).

    Args:
        cls: the Function class.
        items: each argument of ``apply`` in order: ``("tensor", (onnx elem type, rank,
            requires_grad))`` or ``("value", the Python object)``.
        out_types: ONNX element type of each output (bool is passed as uint8).
        out_ranks: rank of each output.
        scope: the export scope; pointer arguments are kept alive in ``scope.keepalive``.
    """
    lists: dict[str, list] = {}

    def add(key: str, value) -> None:
        lists.setdefault(key, []).append(value)

    def extend_tuple(kind: str, suffix: str, position: int, values: list) -> None:
        key = f"input_{kind}_tuples_{suffix}"
        add(f"input_{kind}_tuple_positions_i", position)
        add(f"input_{kind}_tuple_begins_i", len(lists.get(key, [])))
        lists.setdefault(key, []).extend(values)

    requires_grad, bool_inputs, cconv = [], [], []
    for i, (kind, a) in enumerate(items):
        if kind == "tensor":
            elem, rank, rg = a
            if elem == _BOOL:
                elem = _UINT8
                bool_inputs.append(i)
            add("input_tensor_types_i", elem)
            add("input_tensor_ranks_i", rank)
            requires_grad.append(1 if rg else 0)
            cconv.append("d")
            continue
        cconv.append("c")
        requires_grad.append(0)
        if isinstance(a, bool):  # before int: bool is an int
            add("input_bool_scalars_i", int(a))
            add("input_bool_scalar_positions_i", i)
        elif isinstance(a, int):
            add("input_int_scalars_i", a)
            add("input_int_scalar_positions_i", i)
        elif isinstance(a, float):
            add("input_float_scalars_f", a)
            add("input_float_scalar_positions_i", i)
        elif isinstance(a, tuple) and a and all(isinstance(x, bool) for x in a):
            extend_tuple("bool", "i", i, [int(x) for x in a])
        elif isinstance(a, tuple) and a and all(isinstance(x, int) and not isinstance(x, bool) for x in a):
            extend_tuple("int", "i", i, list(a))
        elif isinstance(a, tuple) and a and all(isinstance(x, float) for x in a):
            extend_tuple("float", "f", i, list(a))
        else:  # None, str, dicts, modules, callables, mixed tuples, ...: by address
            scope.keepalive.append(a)
            add("input_pointer_scalars_i", id(a))
            add("input_pointer_scalar_positions_i", i)
    name = state.function_name(cls)
    scope.functions.append(name)
    if bool_inputs:
        func_name = f"{name}{PYTHONOP_BOOL_MARK}{','.join(map(str, bool_inputs))}"
        state.register_alias(func_name, cls)
    else:
        func_name = name
    attrs: dict[str, object] = dict(
        func_name_s=func_name,
        input_convention_s="".join(cconv),
        input_requires_grads_i=requires_grad,
        output_tensor_types_i=[_UINT8 if t == _BOOL else t for t in out_types],
        output_tensor_ranks_i=list(out_ranks),
        training_mode_i=1 if scope.with_backward else 0,
        safe_run_mode_i=0,
        comment_s=state.qualified_name(cls),
    )
    attrs.update(lists)
    attrs.setdefault("input_tensor_types_i", [])
    attrs.setdefault("input_tensor_ranks_i", [])
    return attrs


def pythonop_symbolic(g, *args, **kwargs):
    """Symbolic for ``prim::PythonOp`` (torch >= 1.13 convention: ``fn(g, *args)``)."""
    scope = _scope.get()
    node = g.original_node
    cls = node.pyobj().__self__
    qualname = state.qualified_name(cls)
    if scope is None:
        raise BridgeExportError(f"torch.autograd.Function {qualname}: exported outside an ortwrap export")
    cconv = node.cconv()
    if len(args) != len(cconv):
        raise BridgeExportError(
            f"torch.autograd.Function {qualname}: argument count does not match its calling convention"
        )
    if qualname in scope.inline:  # the forward's ops, recorded in the node's sub-block
        outs = compat.ts_inline_block(g, node, [a for a, c in zip(args, cconv) if c == "d"])
        return outs[0] if len(outs) == 1 else tuple(outs)
    items: list[tuple[str, object]] = []
    cast_inputs = []
    for i, (a, c) in enumerate(zip(args, cconv)):
        if c == "d":
            elem = _onnx_type(a, f"input {i}", qualname)
            if elem == _BOOL:
                a = g.op("Cast", a, to_i=_UINT8)
            cast_inputs.append(a)
            items.append(("tensor", (elem, _rank(a, f"input {i}", qualname), bool(a.requiresGrad()))))
        else:
            items.append(("value", a))
    outputs = list(node.outputs())
    for j, o in enumerate(outputs):
        t = o.type()
        if not hasattr(t, "scalarType") or t.scalarType() is None:
            raise BridgeExportError(
                f"torch.autograd.Function {qualname}: output {j} is not a tensor ({t}); ortwrap can only run "
                "Functions whose outputs are all tensors inside ONNX Runtime"
            )
    out_types = [_onnx_type(o, f"output {j}", qualname) for j, o in enumerate(outputs)]
    out_ranks = [_rank(o, f"output {j}", qualname) for j, o in enumerate(outputs)]
    attrs = encode_call(cls, items, out_types, out_ranks, scope)
    tensors = cast_inputs
    results = g.op("com.microsoft::PythonOp", *tensors, outputs=len(outputs), **attrs)
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    for j, (r, o, t) in enumerate(zip(results, outputs, out_types)):
        r.setType(o.type())  # traced sizes; passes/pythonop_context.py makes the dimensions symbolic
        if t == _BOOL:
            results[j] = g.op("Cast", r, to_i=_BOOL)
            results[j].setType(o.type())
    return results[0] if len(results) == 1 else tuple(results)


def _trace_handler(cls: type, forward, args: tuple, kwargs: dict):
    """A Function call while the TorchScript exporter traces (``bridge/intercept.py``): the tracer
    records it as a ``prim::PythonOp`` whatever the forward does; the forward runs as usual."""
    scope = _scope.get()
    qualname = state.qualified_name(cls)
    inlined = scope is not None and qualname in scope.inline
    with intercept.in_function(cls, bridged=not inlined):
        out = forward(*args, **kwargs)
    if not inlined and not _all_tensors(out):
        # Autograd does not track such outputs: the tracer would record the forward's ops and ORT
        # would differentiate them, silently ignoring the Function's backward.
        raise BridgeExportError(
            f"torch.autograd.Function {qualname} returned {type(out).__name__}"
            f"{'' if not isinstance(out, (tuple, list)) else ' holding ' + ', '.join(type(o).__name__ for o in out)}; "
            "ortwrap can only run Functions whose outputs are a tensor or a tuple of tensors inside ONNX Runtime"
        )
    return out


def _all_tensors(out) -> bool:
    if isinstance(out, torch.Tensor):
        return True
    return type(out) is tuple and all(o is None or isinstance(o, torch.Tensor) for o in out)


@contextlib.contextmanager
def hidden_symbolics() -> Iterator[None]:
    """Hide the ONNX ``symbolic`` staticmethods of Function classes (Megatron defines some).

    The TorchScript exporter calls a Function's own ``symbolic`` instead of ortwrap's PythonOp
    symbolic: it would emit the forward's ops, which ORT would differentiate instead of calling the
    Function's backward. During ortwrap's export those attributes are hidden, so every call is bridged.
    """
    hidden = [(c, c.__dict__["symbolic"]) for c in intercept.function_classes() if "symbolic" in c.__dict__]
    for c, _ in hidden:
        delattr(c, "symbolic")
    try:
        yield
    finally:
        for c, fn in hidden:
            c.symbolic = fn


@contextlib.contextmanager
def export_scope(*, with_backward: bool, inline: frozenset[str]) -> Iterator[ExportScope]:
    """Bridge the Functions called while the TorchScript exporter traces; inline those in ``inline``
    (the exporter must run with ``autograd_inlining=True``, which keeps each call's ops as a sub-block)."""
    install()
    scope = ExportScope(with_backward=with_backward, inline=inline)
    token = _scope.set(scope)
    try:
        with hidden_symbolics(), intercept.intercept_functions(_trace_handler):
            yield scope
    finally:
        _scope.reset(token)
