"""autograd.Functions under the dynamo exporter: one custom op per call, one PythonOp per node.

``torch.export`` traces through ``Function.forward`` and silently drops the Function's backward.
While ortwrap captures, every Function call (routed by ``bridge/intercept.py``: ``apply`` runs, but
the class's forward is ortwrap's) returns the outputs of the custom op
``ortwrap::function_call(Tensor[] inputs, int call_id) -> Tensor[]`` instead of running the forward:

* ``call_id`` indexes a :class:`_Call` record that holds the Function class and every non-tensor
  argument, which never enter the FX graph;
* the op's fake implementation runs the Function's forward on fake tensors (copies, so in-place
  Functions mutate nothing) to give the capture the output shapes, symbolic dims included;
* the exporter translates the op, through ``custom_translation_table``, into a placeholder node
  ``ortwrap.dynamo::FunctionCall<N>`` with a fixed number of outputs (an ONNX schema per arity
  is registered on first use);
* :meth:`CaptureScope.finish` replaces each placeholder with the ``com.microsoft::PythonOp`` that
  :func:`ortwrap.bridge.symbolic.encode_call` describes: the same node the TorchScript path
  emits, so the runners, the context pass and ORT's PythonOpGrad treat both alike.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import onnx
import onnx_ir as ir
import torch

from .._compat import torch as compat
from ..graph.names import ATEN_DOMAIN, PLACEHOLDER_DOMAIN
from ..graph.nodes import aten_node
from . import intercept, state
from .runner import install
from .symbolic import (
    _BOOL,
    _ONNX_TYPES,
    _UINT8,
    BridgeExportError,
    ExportScope,
    encode_call,
)

_ids = itertools.count(1)


@dataclass
class _Call:
    """One Function call seen during capture."""

    cls: type
    #: ``apply``'s arguments; each tensor is replaced by its index in the op's ``inputs``.
    args: tuple
    tensor_positions: list[int]
    requires_grad: list[bool]
    #: filled by the fake implementation
    n_outputs: int = -1
    single: bool = True
    #: (input index, output index) of each input the forward modified in place (``mark_dirty``)
    dirty: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class CaptureScope(ExportScope):
    """An :class:`ExportScope` that also records the calls made during one capture: Function calls
    (PythonOps to be) and ops that run as ATen nodes (``export/aten_fallback.py``)."""

    calls: dict[int, _Call] = field(default_factory=dict)
    aten_calls: dict[int, Any] = field(default_factory=dict)

    def translation_table(self) -> dict:
        return {torch.ops.ortwrap.function_call.default: _translate}

    def finish(self, model: ir.Model) -> None:
        """Replace the placeholder nodes of ``model`` with PythonOps and ATen nodes."""
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            if node.domain != PLACEHOLDER_DOMAIN:
                continue
            call_id = node.attributes["call_id"].as_int()
            if call_id in self.aten_calls:
                _replace_with_aten(node, self.aten_calls[call_id])
            else:
                _replace_placeholder(node, self.calls[call_id], self)
        model.opset_imports.pop(PLACEHOLDER_DOMAIN, None)
        model.opset_imports.setdefault("com.microsoft", 1)
        if self.aten_calls:
            model.opset_imports.setdefault(ATEN_DOMAIN, 1)


_current: contextvars.ContextVar[CaptureScope | None] = contextvars.ContextVar("ortwrap_capture", default=None)


@contextlib.contextmanager
def capture_scope(*, with_backward: bool, inline: frozenset[str]) -> Iterator[CaptureScope]:
    """Bridge the Functions called while ``torch.export`` captures.

    Raises (on exit):
        BridgeExportError: a Function class was created during the capture (it was not intercepted,
            so its backward would be silently ignored).
    """
    install()
    _define_op()
    scope = CaptureScope(with_backward=with_backward, inline=inline)
    token = _current.set(scope)
    before = intercept.function_classes()
    try:
        with intercept.intercept_functions(_bridge_call):
            yield scope
        new = [c for c in intercept.new_function_classes(before) if _called(c, scope)]
        if new:
            raise BridgeExportError(
                f"torch.autograd.Function {state.qualified_name(new[0])} was defined while the module ran, so "
                "ortwrap could not route it to its own backward. Define the class at module level, or use "
                "exporter='torchscript'"
            )
    finally:
        _current.reset(token)


@contextlib.contextmanager
def translating(scope: CaptureScope) -> Iterator[CaptureScope]:
    """Translate a capture's graph: its placeholder translations read ``scope``."""
    token = _current.set(scope)
    try:
        yield scope
    finally:
        _current.reset(token)


def _called(cls: type, scope: CaptureScope) -> bool:
    """Whether a Function class that appeared during the capture belongs to the user's code (torch
    creates some lazily, for its own custom ops)."""
    return not (cls.__module__ or "").startswith(("torch.", "ortwrap."))


def _bridge_call(cls: type, forward, args: tuple, kwargs: dict):
    """A Function call during capture (``bridge/intercept.py``): one ``ortwrap::function_call``,
    or the forward itself for an inlined Function."""
    scope = _current.get()
    qualname = state.qualified_name(cls)
    if scope is None:
        return forward(*args, **kwargs)
    if qualname in scope.inline:
        with intercept.in_function(cls, bridged=False):
            return forward(*args, **kwargs)
    ctx = None
    if not compat.has_setup_context(cls):  # forward(ctx, *args): apply made ctx
        ctx, args = args[0], args[1:]
    if kwargs:
        raise BridgeExportError(
            f"torch.autograd.Function {qualname} was called with keyword arguments {sorted(kwargs)}; "
            "Function.apply takes positional arguments only"
        )
    tensors, positions, stored = [], [], []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            positions.append(i)
            stored.append(len(tensors))
            tensors.append(a)
        else:
            stored.append(a)
    call_id = next(_ids)
    scope.calls[call_id] = _Call(cls, tuple(stored), positions, [t.requires_grad for t in tensors])
    with intercept.passthrough():  # the op's own autograd wrapper is a Function: let it run
        outs = list(torch.ops.ortwrap.function_call(tensors, call_id))
    call = scope.calls[call_id]
    for k, j in call.dirty:
        # In eager the input IS the output afterwards (marked dirty): later uses of it must see the
        # new values, and apply must see the input returned.
        tensors[k].copy_(outs[j])
        outs[j] = tensors[k]
    if call.dirty and ctx is not None:
        ctx.mark_dirty(*[tensors[k] for k, _ in call.dirty])
    return outs[0] if call.single else tuple(outs)


def _run_forward(call: _Call, tensors: list[torch.Tensor]):
    """Run the Function's forward as autograd would: on copies that keep their inputs'
    ``requires_grad``, with grad mode off. Returns its output and the copies."""
    args = list(call.args)
    copies = []
    for index, pos in enumerate(call.tensor_positions):
        t = tensors[index].detach().clone()
        if call.requires_grad[index] and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        args[pos] = t
        copies.append(t)
    cls = call.cls
    ctx = torch.autograd.function.FunctionCtx()
    # The forward runs in Python at run time: its collectives are real then (and stubs now).
    with intercept.passthrough(), intercept.in_function(cls, bridged=True), torch.no_grad():
        if compat.has_setup_context(cls):
            out = cls.forward(*args)
            cls.setup_context(ctx, tuple(args), out)
        else:
            out = cls.forward(ctx, *args)
    return out, copies, getattr(ctx, "dirty_tensors", ())


def _fake_function_call(inputs: list[torch.Tensor], call_id: int) -> list[torch.Tensor]:
    scope = _current.get()
    call = scope.calls[call_id] if scope is not None else None
    if call is None:
        raise RuntimeError("ortwrap::function_call runs only while ortwrap captures a module")
    out, copies, dirty = _run_forward(call, list(inputs))
    qualname = state.qualified_name(call.cls)
    single = isinstance(out, torch.Tensor)
    outs = (out,) if single else out
    if not isinstance(outs, tuple) or not all(isinstance(o, torch.Tensor) for o in outs):
        kind = lambda o: "Tensor" if isinstance(o, torch.Tensor) else type(o).__name__  # noqa: E731
        kinds = (
            f"{type(outs).__name__} holding {', '.join(map(kind, outs))}"
            if isinstance(outs, (tuple, list))
            else kind(out)
        )
        raise BridgeExportError(
            f"torch.autograd.Function {qualname} returned {kinds}; ortwrap can only run Functions whose outputs "
            "are a tensor or a tuple of tensors inside ONNX Runtime"
        )
    call.single = single
    call.n_outputs = len(outs)
    call.dirty = [
        (k, j) for k, c in enumerate(copies) if any(c is d for d in dirty) for j, o in enumerate(outs) if o is c
    ]
    return [o.detach().clone() for o in outs]


def _real_function_call(inputs: list[torch.Tensor], call_id: int) -> list[torch.Tensor]:
    raise RuntimeError("ortwrap::function_call is a capture placeholder; it never runs eagerly")


def _no_autograd(ctx, grads):
    raise RuntimeError("ortwrap::function_call is a capture placeholder; ONNX Runtime runs its backward")


_defined = False


def _define_op() -> None:
    global _defined
    if _defined:
        return
    op = torch.library.custom_op("ortwrap::function_call", mutates_args=())(_real_function_call)
    op.register_fake(_fake_function_call)
    op.register_autograd(_no_autograd)
    _defined = True


def new_call_id() -> int:
    """A placeholder node's ``call_id``, unique in the process."""
    return next(_ids)


def _replace_with_aten(node: ir.Node, call: Any) -> None:
    """The ATen node a placeholder stands for: same outputs, the absent optional inputs restored."""
    inputs: list[ir.Value | None] = list(node.inputs)
    for i in call.absent:
        inputs.insert(i, None)
    while inputs and inputs[-1] is None:
        inputs.pop()
    aten = aten_node(call.operator, inputs, overload=call.overload, outputs=len(node.outputs), name=node.name)
    graph = node.graph
    graph.insert_before(node, aten)
    for old, new in zip(node.outputs, aten.outputs):
        new.dtype, new.shape, new.name = old.dtype, old.shape, old.name
        old.name = None
        old.replace_all_uses_with(new, replace_graph_outputs=True)
    graph.remove(node, safe=True)


_schemas: set[int] = set()


def placeholder_schema(n_outputs: int) -> str:
    """The name of the placeholder op with ``n_outputs`` outputs (its ONNX schema registered once)."""
    return _placeholder_schema(n_outputs)


def _placeholder_schema(n_outputs: int) -> str:
    name = f"FunctionCall{n_outputs}"
    if n_outputs not in _schemas:
        types = [
            "tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)", "tensor(int64)",
            "tensor(int32)", "tensor(int16)", "tensor(int8)", "tensor(uint8)", "tensor(bool)",
        ]  # fmt: skip
        param = onnx.defs.OpSchema.FormalParameter
        schema = onnx.defs.OpSchema(
            name,
            PLACEHOLDER_DOMAIN,
            1,
            inputs=[
                param(
                    "inputs",
                    "T",
                    param_option=onnx.defs.OpSchema.FormalParameterOption.Variadic,
                    is_homogeneous=False,
                    min_arity=0,
                ),
            ],
            outputs=[param(f"output{j}", f"O{j}") for j in range(n_outputs)],
            type_constraints=[("T", types, "")] + [(f"O{j}", types, "") for j in range(n_outputs)],
            attributes=[onnx.defs.OpSchema.Attribute("call_id", onnx.defs.OpSchema.AttrType.INT, "")],
        )
        try:
            onnx.defs.register_schema(schema)
        except Exception:  # registered by an earlier import of this module
            pass
        _schemas.add(n_outputs)
    return name


def _translate(inputs, call_id: int):
    """custom_translation_table entry: the placeholder node with the call's number of outputs."""
    import onnxscript

    scope = _current.get()
    call = scope.calls[call_id]
    opset = onnxscript.values.Opset(PLACEHOLDER_DOMAIN, 1)
    op = getattr(opset, _placeholder_schema(call.n_outputs))
    outs = op(*inputs, call_id=call_id)
    return [outs] if call.n_outputs == 1 else list(outs)


#: ONNX element types a PythonOp can take (ir.DataType values are ONNX's).
_ELEM = frozenset(_ONNX_TYPES.values())


def _elem_and_rank(value: ir.Value, what: str, qualname: str) -> tuple[int, int]:
    if value.dtype is None or int(value.dtype) not in _ELEM or value.shape is None:
        raise BridgeExportError(
            f"torch.autograd.Function {qualname}: {what} has type {value.type} and shape {value.shape}, which "
            "ortwrap cannot bridge"
        )
    return int(value.dtype), len(value.shape)


def _replace_placeholder(node: ir.Node, call: _Call, scope: CaptureScope) -> None:
    qualname = state.qualified_name(call.cls)
    graph = node.graph
    items: list[tuple[str, object]] = []
    inputs: list[ir.Value] = []
    tensor_index = {pos: k for k, pos in enumerate(call.tensor_positions)}
    for i, a in enumerate(call.args):
        k = tensor_index.get(i)
        if k is None:
            items.append(("value", a))
            continue
        value = node.inputs[k]
        elem, rank = _elem_and_rank(value, f"input {i}", qualname)
        if elem == _BOOL:
            cast = ir.node("Cast", [value], {"to": _UINT8}, name=f"{node.name}/bool_in{i}")
            graph.insert_before(node, cast)
            cast.outputs[0].dtype = ir.DataType.UINT8
            cast.outputs[0].shape = value.shape
            value = cast.outputs[0]
        inputs.append(value)
        items.append(("tensor", (elem, rank, call.requires_grad[k])))
    outs = [_elem_and_rank(o, f"output {j}", qualname) for j, o in enumerate(node.outputs)]
    attrs = encode_call(call.cls, items, [t for t, _ in outs], [r for _, r in outs], scope)
    replacement = ir.Node(
        "com.microsoft",
        "PythonOp",
        inputs,
        attributes=[_attr(k, v) for k, v in attrs.items()],
        num_outputs=len(node.outputs),
        name=node.name or f"PythonOp_{call.cls.__name__}",
    )
    graph.insert_before(node, replacement)
    for j, (old, new) in enumerate(zip(node.outputs, replacement.outputs)):
        new.shape = old.shape
        new.name = old.name
        old.name = None
        if outs[j][0] == _BOOL:
            new.dtype = ir.DataType.UINT8
            cast = ir.node("Cast", [new], {"to": _BOOL}, name=f"{replacement.name}/bool_out{j}")
            graph.insert_after(replacement, cast)
            cast.outputs[0].dtype = ir.DataType.BOOL
            cast.outputs[0].shape = old.shape
            result = cast.outputs[0]
            name, new.name = new.name, f"{new.name}/uint8"
            result.name = name
        else:
            new.dtype = old.dtype
            result = new
        old.replace_all_uses_with(result, replace_graph_outputs=True)
    graph.remove(node, safe=True)


def _attr(key: str, value: object) -> ir.Attr:
    name, kind = key.rsplit("_", 1)
    if kind == "s":
        return ir.AttrString(name, str(value))
    if kind == "f":
        return ir.AttrFloat32s(name, [float(v) for v in value])  # type: ignore[union-attr]
    if isinstance(value, list):
        return ir.AttrInt64s(name, [int(v) for v in value])
    return ir.AttrInt64(name, int(value))  # type: ignore[arg-type]
