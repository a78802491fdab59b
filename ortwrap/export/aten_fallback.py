"""ATen nodes from the dynamo exporter: PyTorch's own kernel for an op ONNX cannot express.

The TorchScript exporter, run with ``ONNX_ATEN_FALLBACK``, writes an op it has no symbolic for as an
``org.pytorch.aten::ATen`` node, which ORT runs through ortwrap's ATen bridge (``bridge/aten.py``:
PyTorch's kernel forward, PyTorch's autograd for the gradient). This module gives the dynamo exporter
the same: :func:`fallback_translations` returns ``custom_translation_table`` entries for

- every op of the captured graph that neither torchlib nor ortwrap translates (after the exporter's
  decompositions: an op that decomposes into translatable ops is decomposed instead), and
- every overload of the ops ``Options.aten_ops`` lists (PyTorch's kernels by choice), and
- every call of an op ``ops.ATEN_OPS`` names for dynamo where a call needs it (its ``when``):
  translations that train wrong (``avg_pool2d`` with ``divisor_override``, p-norms at zero).

Each entry writes a placeholder node (``bridge/dynamo.py``'s per-arity schema) that
:meth:`~ortwrap.bridge.dynamo.CaptureScope.finish` turns into the ATen node, with the argument
encoding the ATen bridge decodes (its module docstring): tensors as inputs (an absent optional one
as an empty input), numbers as 0-d tensors, lists as 1-D tensors, strings as UTF-8 bytes, dtypes as
torch's ScalarType codes.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._compat import torch as compat
from ..graph.names import COMPLEX_MARK
from ..ops.values import constant_array

#: torch dtype -> torch's ScalarType code (the ATen bridge's decoding, inverted).
_SCALAR_TYPE_CODES = {
    torch.uint8: 0,
    torch.int8: 1,
    torch.int16: 2,
    torch.int32: 3,
    torch.int64: 4,
    torch.float16: 5,
    torch.float32: 6,
    torch.float64: 7,
    torch.bool: 11,
    torch.bfloat16: 15,
}


@dataclass
class AtenCall:
    """One ATen node to write: the op, its overload, and which of its inputs are absent."""

    operator: str
    overload: str
    absent: list[int] = field(default_factory=list)


def _kind(t: Any) -> str:
    kind = t.kind()
    if kind == "OptionalType":
        t = t.getElementType()
        kind = t.kind()
    if kind == "ListType":
        return "list:" + t.getElementType().kind()
    return kind if kind != "ScalarTypeType" else "ScalarType"


def _constant(value: Any, kind: str, where: str) -> np.ndarray:
    """The ATen bridge's encoding of a non-tensor argument (``ops.values.constant_array``; a dtype as
    torch's ScalarType code)."""
    if isinstance(value, torch.dtype) or str(kind) == "ScalarType":
        if value not in _SCALAR_TYPE_CODES:
            raise NotImplementedError(f"{where}: dtype {value} cannot be passed to an ATen node")
        return np.array(_SCALAR_TYPE_CODES[value], dtype=np.int64)
    try:
        return constant_array(value)
    except TypeError:
        raise NotImplementedError(
            f"{where}: argument {value!r} ({type(value).__name__}) cannot be passed to an ATen node inside ONNX Runtime"
        ) from None


def _bind(schema: Any, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """(schema argument, value) for every argument of ``schema``, defaults filled in."""
    out = []
    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            value = args[i]
        elif a.name in kwargs:
            value = kwargs[a.name]
        elif a.has_default_value():
            value = a.default_value
        else:
            value = None
        out.append((a, value))
    return out


def _is_fx_node(value: Any) -> bool:
    return isinstance(value, torch.fx.Node)


def _is_complex_value(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_complex()


def _is_complex(node: torch.fx.Node) -> bool:
    """Whether an FX value is a complex tensor (torchlib writes it as a real ``[..., 2]`` one)."""
    return _is_complex_value(node.meta.get("val"))


def _runnable_op(qualified: str, overload: str) -> tuple[str, str]:
    """The (operator, overload) an ATen node runs for the op ``qualified`` (``ns::name``): aten ops by
    bare name, other namespaces kept. A ``prims`` op (left by a decomposition: ``erfinv`` becomes
    ``prims.erf_inv``) has no autograd formula, so its aten twin of the same arguments runs instead.

    Raises:
        NotImplementedError: a prims op without an aten twin (it could not be differentiated)."""
    ns, _, name = qualified.partition("::")
    if ns == "aten":
        return name, overload
    if ns != "prims":
        return qualified, overload
    for twin in dict.fromkeys((name, name.replace("_", ""))):
        packet = getattr(torch.ops.aten, twin, None)
        if packet is not None and "default" in packet.overloads():
            if [a.name for a in compat.op_schema(packet.default).arguments] == [
                a.name for a in compat.op_schema(getattr(torch.ops.prims, name).default).arguments
            ]:
                return twin, ""
    raise NotImplementedError(f"prims.{name} (left by a decomposition) has no autograd formula and no aten twin")


def _make_translation(target: Any, records: collections.deque, scope: Any) -> Callable[..., Any]:
    """The translation of ``target``: consumes one record (the FX node's own arguments) per call,
    in graph order, and writes the placeholder node."""
    schema = compat.op_schema(target)
    name = f"{schema.name.split('::', 1)[-1]}"
    overload = schema.overload_name

    def translate(*args: Any, **kwargs: Any) -> Any:
        import onnx_ir as ir
        import onnxscript
        from onnxscript import opset18 as op

        from ..bridge.dynamo import PLACEHOLDER_DOMAIN, new_call_id, placeholder_schema

        raw, complex_result = records.popleft()  # this node's FX arguments (the translated ones lose dtypes)
        bound_onnx = _bind(schema, args, kwargs)
        inputs: list[Any] = []
        absent: list[int] = []
        for i, ((a, fx_value), (_, onnx_value)) in enumerate(zip(raw, bound_onnx)):
            kind = _kind(a.type)
            where = f"aten.{name}.{overload or 'default'} argument {a.name!r}"
            if fx_value is False and re.fullmatch(r"compute_\w*grad", a.name):
                # (torch_nn::_linear_cross_entropy_batch_chunked: its backward returns what its forward
                # computed where told; the capture runs without autograd, so it was told not to)
                raise NotImplementedError(
                    f"{where} is False: the op computes its gradients in its forward only where its inputs require "
                    "grad at the capture (which runs without autograd); as an ATen node its gradient would be wrong"
                )
            if fx_value is None:
                absent.append(i)
                inputs.append(None)
            elif kind in ("list:IntType", "list:SymIntType") and any(map(_is_fx_node, fx_value)):
                # symbolic sizes (``roll``'s shifts of ``fftshift``: size // 2): one 1-D tensor
                inputs.append(
                    op.Concat(
                        *[
                            op.Reshape(v, op.Constant(value_ints=[1]))
                            if _is_fx_node(f)
                            else op.Constant(value_ints=[f])
                            for f, v in zip(fx_value, onnx_value)
                        ],
                        axis=0,
                    )
                )
            elif kind == "TensorType" or _is_fx_node(fx_value):
                if isinstance(fx_value, (list, tuple)):
                    raise NotImplementedError(f"{where}: a list of tensors cannot be passed to an ATen node")
                inputs.append(onnx_value)
            else:
                inputs.append(op.Constant(value=ir.tensor(_constant(fx_value, kind, where))))
        call_id = new_call_id()
        n_out = len(schema.returns)
        if any(_kind(r.type).startswith("list:") for r in schema.returns):
            raise NotImplementedError(f"aten.{name}: an op returning a list of tensors cannot run as an ATen node")
        operator, op_overload = _runnable_op(schema.name, overload)
        complex_inputs = [str(i) for i, (a, v) in enumerate(raw) if _is_fx_node(v) and _is_complex(v)]
        if complex_inputs or complex_result:
            if any(raw[int(i)][0].kwarg_only for i in complex_inputs):
                raise NotImplementedError(
                    f"aten.{name}: a complex keyword-only argument cannot be passed to an ATen node"
                )
            # torchlib's complex values are real [..., 2] tensors: the runner views them (COMPLEX_MARK)
            operator = f"{COMPLEX_MARK}{','.join(complex_inputs)}|{operator}"
        scope.aten_calls[call_id] = AtenCall(operator, op_overload, absent)
        placeholder = getattr(onnxscript.values.Opset(PLACEHOLDER_DOMAIN, 1), placeholder_schema(n_out))
        outs = placeholder(*[x for x in inputs if x is not None], call_id=call_id)
        return outs

    translate.value_kinds = (False, True)  # real and complex calls alike (torchlib dispatches them apart)
    return translate


def fallback_translations(
    program: torch.export.ExportedProgram,
    is_registered: Callable[[Any], bool],
    *,
    aten_ops: tuple[str, ...],
    scope: Any,
    allow_missing: bool,
) -> dict[Any, Callable[..., Any]] | None:
    """Translations that write ATen nodes for the ops of ``program`` that need them.

    Args:
        program: the captured (or decomposed) program about to be translated.
        is_registered: whether an op has a translation.
        aten_ops: op names (``"gelu"``) to run as ATen nodes whatever translations exist.
        scope: the capture's scope (``bridge.dynamo.CaptureScope``), which records the calls.
        allow_missing: also write ATen nodes for ops without a translation; if False, return None
            when there are such ops (the caller decomposes the graph first).
    """
    records: dict[Any, collections.deque] = {}
    wanted = set(aten_ops) | _wrong_translations(program)
    for node in program.graph.nodes:
        if node.op != "call_function" or not compat.is_op_overload(node.target):
            continue
        target = node.target
        op_name = compat.op_schema(target).name.split("::", 1)[-1]
        if op_name in wanted or not is_registered(target):
            if op_name not in wanted and not allow_missing:
                return None
            schema = compat.op_schema(target)
            vals = node.meta.get("val")
            complex_result = any(_is_complex_value(v) for v in (vals if isinstance(vals, (list, tuple)) else [vals]))
            records.setdefault(target, collections.deque()).append(
                (_bind(schema, node.args, node.kwargs), complex_result)
            )
    return {target: _make_translation(target, rec, scope) for target, rec in records.items()}


def _wrong_translations(program: torch.export.ExportedProgram) -> set[str]:
    """Names of the ops of ``program`` that ``ops.ATEN_OPS`` sends to PyTorch under dynamo: an
    entry without ``when``, or one whose ``when`` holds for a call (its constant arguments by
    position, defaults filled in, None for a graph value). Every call of such an op becomes an ATen node."""
    from ..ops import ATEN_OPS

    entries = {e.aten: e for e in ATEN_OPS if "dynamo" in e.exporters}
    found: set[str] = set()
    if not entries:
        return found
    for node in program.graph.nodes:
        if node.op != "call_function" or not compat.is_op_overload(node.target):
            continue
        schema = compat.op_schema(node.target)
        name = schema.name.split("::", 1)[-1]
        entry = entries.get(name)
        if entry is None or name in found:
            continue
        first = node.args[0].meta.get("val") if node.args and _is_fx_node(node.args[0]) else None
        if entry.floating_only and isinstance(first, torch.Tensor) and not first.is_floating_point():
            continue
        if entry.when is None:
            found.add(name)
            continue
        constants = [
            None if _is_fx_node(v) or (isinstance(v, (list, tuple)) and any(map(_is_fx_node, v))) else v
            for _, v in _bind(schema, node.args, node.kwargs)
        ]
        if entry.when(constants):
            found.add(name)
    return found
