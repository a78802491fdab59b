"""Export with the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``).

The module is traced through the shared adapter (``export/adapter.py``). Parameters and buffers
become graph inputs (``export_params=False, keep_initializers_as_inputs=True``), so the tensors the
optimizer updates in place are what each step feeds. Buffers returned unchanged are pruned by a
pass; the ones that change become outputs copied back after each forward.

Every dimension of every input is dynamic, so a new batch size or sequence length reuses the graph.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import onnx
import torch
from torch import nn

from .._compat import torch as compat
from ..bridge.symbolic import export_scope
from ..errors import ExportError, output_error_in
from ..graph.model import ExportedModel
from .adapter import Adapter, finish_export, no_ambient_autocast, preserved_state, state_tensors
from .context import capture_context
from .symbolics import ortwrap_symbolics


@contextlib.contextmanager
def _buffers_as_inputs(module: nn.Module) -> Iterator[None]:
    """The TorchScript exporter feeds only ``state_dict()`` entries as inputs and bakes the rest in:
    a non-persistent buffer (rotary tables, masks) would become a constant, stale once the module
    changes it. During export every buffer is persistent, so each one is a graph input."""
    saved = [(s, set(s)) for s in map(compat.non_persistent_buffers, module.modules()) if s]
    for names, _ in saved:
        names.clear()
    try:
        yield
    finally:
        for names, kept in saved:
            names.update(kept)


@dataclass
class TorchScriptCapture:
    """What the TorchScript exporter produced: already ONNX (it translates while it traces)."""

    model: onnx.ModelProto
    adapter: Adapter
    input_names: list[str]
    bridge: Any
    static_reasons: list[str]
    static_spatial: bool


def capture_torchscript(
    module: nn.Module,
    flat_inputs: list[torch.Tensor],
    in_spec: tuple,
    input_paths: list[str],
    *,
    training: bool,
    opset: int,
    static_spatial: bool = False,
    with_backward: bool = True,
    inline_functions: tuple[str, ...] = (),
    aten_ops: tuple[str, ...] = (),
    autocast: tuple | None = None,
    probe: bool = True,
) -> TorchScriptCapture:
    """Export ``module`` called with the inputs that ``in_spec`` and ``flat_inputs`` describe.

    Args:
        module: the user's module.
        flat_inputs: the flat tensor inputs of this call.
        in_spec: tree spec of ``(args, kwargs)``.
        input_paths: a readable path for each flat input (``"x"``, ``"batch['ids']"``).
        training: export in training mode (dropout on, batch statistics) or eval mode.
        opset: ONNX opset to target.
        static_spatial: make only dimension 0 of each input dynamic (see :data:`ortwrap.export.adapter.STATIC_SPATIAL_OPS`).
        with_backward: the graph will get a backward (PythonOps keep their contexts).
        inline_functions: qualified names of autograd.Functions to export as ops, not PythonOps.
        aten_ops: names of aten ops to export as ATen nodes (PyTorch's kernels) in any case.
        probe: where the trace turned a traced value into a Python constant, trace again at other
            sizes to find out whether the graph depends on them (see :func:`_size_dependence`).

    Raises:
        ExportError: chained to the exporter's error.
    """
    adapter = Adapter(module, in_spec, autocast)
    input_names = [f"input:{p}" for p in input_paths]
    dims = (lambda t: range(min(t.dim(), 1))) if static_spatial else (lambda t: range(t.dim()))
    dynamic_axes = {name: {d: f"{name}.dim{d}" for d in dims(t)} for name, t in zip(input_names, flat_inputs)}
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    f = io.BytesIO()
    was_training = module.training
    try:
        with (
            preserved_state(module),
            no_ambient_autocast(),
            _buffers_as_inputs(module),
            export_scope(with_backward=with_backward, inline=frozenset(inline_functions)) as bridge,
            ortwrap_symbolics(opset, aten_ops, with_backward) as symbolic_reasons,
            capture_context(),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            torch.onnx.export(
                adapter,
                tuple(t.detach() for t in flat_inputs),
                f,
                dynamo=False,
                export_params=False,
                keep_initializers_as_inputs=True,
                training=mode,
                do_constant_folding=False,
                opset_version=opset,
                input_names=input_names,
                dynamic_axes=dynamic_axes,
                # With Functions to inline, each call keeps its forward's ops as a sub-block of its
                # prim::PythonOp, which ortwrap's symbolic exports for those (bridge/symbolic.py).
                # Off otherwise: torch's sub-block conversion fails on some Functions it never needs.
                autograd_inlining=bool(inline_functions),
                # Ops without an ONNX translation become ATen nodes that run PyTorch's kernels.
                operator_export_type=torch.onnx.OperatorExportTypes.ONNX_ATEN_FALLBACK,
            )
    except Exception as e:
        if (outputs := output_error_in(e)) is not None:
            raise outputs from None
        text = str(e)
        if len(text) > 500:  # the exporter appends whole graphs; the chained cause keeps them
            text = text[:500] + " ... (full message in the chained exception)"
        raise ExportError(
            f"torch.onnx.export (TorchScript) failed for {type(module).__name__}: {type(e).__name__}: {text}. "
            "Check that the module's forward is traceable, or run it without ORTWrap."
        ) from e
    finally:
        module.train(was_training)
    model = onnx.load_model_from_string(f.getvalue())
    reasons = list(symbolic_reasons)
    if probe and not static_spatial:
        baked = [str(w.message) for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
        baked = [m for m in baked if any(k in m for k in _BAKED)]
        again = dict(training=training, opset=opset, with_backward=with_backward, inline_functions=inline_functions,
                     aten_ops=aten_ops, autocast=autocast)  # fmt: skip
        reason = _size_dependence(module, flat_inputs, in_spec, input_paths, model, baked[:1], again)
        if reason is not None:
            reasons.append(reason)
    if probe and any(n.op_type == "NonZero" and n.domain in ("", "ai.onnx") for n in model.graph.node):
        again = dict(training=training, opset=opset, with_backward=with_backward, inline_functions=inline_functions,
                     aten_ops=aten_ops, autocast=autocast, static_spatial=static_spatial)  # fmt: skip
        reason = _value_dependence(module, flat_inputs, in_spec, input_paths, model, again)
        if reason is not None:
            raise ExportError(f"the TorchScript trace of {type(module).__name__} is refused: {reason}")
    return TorchScriptCapture(model, adapter, input_names, bridge, reasons, static_spatial)


def _value_dependence(
    module: nn.Module, flat_inputs: list[torch.Tensor], in_spec: tuple, input_paths: list[str], model, kw: dict
) -> str | None:
    """Why the trace is valid only for its inputs' values, or None.

    NOTE: a graph with ``NonZero`` has sizes that depend on values (MoE routing: which experts got
    tokens). Python code that loops over such a count or branches on it (Mixtral's and DBRX's
    eager experts: ``for expert in expert_hit``) is traced for this batch's routing: a batch
    routed to fewer experts fails in ORT, one routed to more loses the experts the trace did not
    see. The module is traced again on inputs of the same shapes whose values come from this
    call's own: each tensor filled with its first element (every token alike: the fewest experts),
    then each tensor's elements sampled with replacement (token ids stay valid ids, labels valid
    labels). A graph that differs depends on the values: no graph can be reused.
    """
    g = torch.Generator().manual_seed(0)
    alike = [t.detach().reshape(-1)[:1].expand(t.shape).clone() if t.numel() else t.detach() for t in flat_inputs]
    drawn = []
    for t in flat_inputs:
        flat = t.detach().reshape(-1)
        pick = torch.randint(0, max(flat.numel(), 1), (flat.numel(),), generator=g).to(flat.device)
        drawn.append(flat[pick].reshape(t.shape) if flat.numel() else t.detach())
    mine = _structure(model)
    for values in (alike, drawn):
        try:
            other = capture_torchscript(module, values, in_spec, input_paths, probe=False, **kw)
        except ExportError:
            continue
        if _structure(other.model) != mine:
            break
    else:
        return None
    return (
        "the traced graph depends on the input values (traced again on other values of the same shapes, it "
        "differs: a Python loop or branch over a data-dependent count, such as the experts a batch routes to); "
        "use exporter='dynamo' where it captures the module (a transformers MoE: its default "
        "experts_implementation), or run it in PyTorch (fallback=True)"
    )


#: TracerWarnings that say the trace turned a traced value (a size) into a Python constant: a loop
#: count, a branch, an index (quoted in the reason; a size unpacked from ``x.shape`` warns of nothing).
_BAKED = ("Converting a tensor to a Python", "Iterating over a tensor", "results are registered as constants")


def _size_dependence(
    module: nn.Module,
    flat_inputs: list[torch.Tensor],
    in_spec: tuple,
    input_paths: list[str],
    model: onnx.ModelProto,
    warnings_: list[str],
    kw: dict,
) -> str | None:
    """Why the trace is valid only at its inputs' non-batch sizes, or None.

    NOTE: the TorchScript exporter makes every dimension a graph input, but Python code that turns
    a size into a constant (RecurrentGemma's and Mamba's ``for t in range(seq_len)``) is traced
    once, at this call's size: reused at another length, the unrolled loop silently computes the
    first length (or fails). The tracer does not always warn (a size unpacked from ``x.shape`` is
    a plain int), so every dynamic trace is checked: the module is traced again with one size
    grown by one (each input's dims of that size, by repeating their last slice: token ids
    stay valid ids, masks stay masks); a graph that differs from this one depends on the size, and
    is exported with static non-batch dimensions instead: one graph per size, never reused. A
    size whose grown inputs the module rejects says nothing; the two most frequent sizes are tried.
    """
    counts: dict[int, int] = {}
    for t in flat_inputs:
        for s in t.shape[1:]:
            if s > 1:
                counts[s] = counts.get(s, 0) + 1
    for size in sorted(counts, key=lambda s: -counts[s])[:2]:
        grown = [_grow(t, size) for t in flat_inputs]
        try:
            other = capture_torchscript(module, grown, in_spec, input_paths, probe=False, **kw)
        except ExportError:
            continue
        if _structure(other.model) != _structure(model):
            said = f"; the tracer said: {warnings_[0].splitlines()[0][:200]}" if warnings_ else ""
            return (
                f"the traced graph depends on the inputs' size {size} (traced again at {size + 1}, it differs: "
                f"a Python loop or branch over a size{said})"
            )
        return None
    return None


def _grow(t: torch.Tensor, size: int) -> torch.Tensor:
    """``t`` with each non-batch dimension of ``size`` grown by one, repeating its last slice."""
    out = t.detach()
    for d in range(1, out.dim()):
        if out.shape[d] == size:
            out = torch.cat([out, out.narrow(d, size - 1, 1)], d)
    return out


def _structure(model: onnx.ModelProto) -> list[tuple]:
    """The graph's nodes with values numbered by first use (names differ between traces), with the
    standard ops' attributes (constants included); other domains' attributes hold object ids."""
    numbers: dict[str, int] = {}

    def number(name: str) -> int:
        return numbers.setdefault(name, len(numbers)) if name else -1

    for i in model.graph.input:
        number(i.name)
    out: list[tuple] = []
    for node in model.graph.node:
        attrs = (
            tuple(sorted((a.name, a.SerializeToString()) for a in node.attribute))
            if node.domain in ("", "ai.onnx")
            else ()
        )
        out.append((node.domain, node.op_type, tuple(map(number, node.input)), tuple(map(number, node.output)), attrs))
    out.append(tuple(number(o.name) for o in model.graph.output))
    return out


def forget_traced_shapes(model: onnx.ModelProto) -> bool:
    """Forget the sizes the exporter traced for PythonOp outputs and every value computed from them.

    The exporter's shape inference cannot see into a ``PythonOp`` (an ``autograd.Function``): it
    records the traced sizes of its outputs, and every value computed from them inherits those
    numbers (``[4, 6, 8]`` for a batch of 4 and a sequence of 6) although they change with the
    inputs. ORT trusts a fully static type: it folds ``Shape`` of such a value into a constant, so
    the ``Shape`` that a ``Reshape``'s gradient reads came out as the first step's shape and a later
    step with other input sizes failed (or, where the sizes still fit, reshaped wrongly). The
    outputs get symbolic dims (``<node>/out<j>_dim<d>``, as ``passes/pythonop_context.py`` names
    them) and the values downstream lose their shapes: type inference infers them again from the
    symbolic ones. Returns whether anything changed.
    """
    graph = model.graph
    symbolic: dict[str, str] = {}  # PythonOp output -> the pattern of its dims' names
    tainted: set[str] = set()
    for i, node in enumerate(graph.node):
        if node.domain == "com.microsoft" and node.op_type == "PythonOp":
            name = node.name or f"PythonOp_{i}"
            # The context output comes later (AddPythonOpContextPass): output j here is its tensor j.
            for j, o in enumerate(node.output):
                if o:
                    symbolic[o] = f"{name}/out{j}_dim{{}}"
            tainted.update(o for o in node.output if o)
        elif any(x in tainted for x in node.input):
            tainted.update(o for o in node.output if o)
    changed = False
    for v in (*graph.value_info, *graph.output):
        if v.name not in tainted or not v.type.tensor_type.HasField("shape"):
            continue
        dims = v.type.tensor_type.shape.dim
        if v.name in symbolic:
            for d, dim in enumerate(dims):
                dim.Clear()
                dim.dim_param = symbolic[v.name].format(d)
        else:
            v.type.tensor_type.ClearField("shape")
        changed = True
    return changed


def aten_ops_as_aten_nodes(model: onnx.ModelProto) -> list[str]:
    """Write each ``org.pytorch.aten::<op>`` node as ``org.pytorch.aten::ATen(operator=<op>)``.

    For some ops without an ONNX form (``feature_dropout``, which ``dropout2d``/``dropout3d`` call;
    ``unfold`` of a dynamic size; ``index_add``) the TorchScript exporter writes the aten op itself as
    a node of the ATen domain, every argument an input, which ORT cannot load ("is not a registered
    function/op"). As ``ATen`` nodes they run PyTorch's kernel, and the ATen bridge differentiates
    them with PyTorch's autograd (the overload resolved as for any ATen node without one).
    Returns the ops rewritten.

    Raises:
        ExportError: a random op (``feature_dropout``): the ATen bridge's gradient recomputes the op,
            which would draw another mask than the forward's.
    """
    from ..bridge.aten import ATEN_DOMAIN

    rewritten = []
    for node in model.graph.node:
        if node.domain != ATEN_DOMAIN or node.op_type == "ATen" or node.attribute:
            continue
        packet = getattr(torch.ops.aten, node.op_type, None)
        if packet is None:
            continue
        if any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads()):
            raise ExportError(
                f"aten::{node.op_type} has no ONNX form, and it is random: as an ATen node its gradient would "
                "recompute it with another random draw than its forward's (F.dropout2d/dropout3d in training: "
                "use nn.Dropout, or run the module without ORTWrap)"
            )
        node.attribute.extend(
            [onnx.helper.make_attribute("operator", node.op_type), onnx.helper.make_attribute("overload_name", "")]
        )
        rewritten.append(node.op_type)
        node.op_type = "ATen"
    return rewritten


def _overload_by_arity(
    name: str, computed: list[bool], scalars: list[bool] | None = None, absent: list[bool] | None = None
) -> str | None:
    """The one overload of ``aten::<name>`` (no ``out=``, no named dims) with as many arguments as
    the node has inputs, a tensor argument for each ``computed`` one (not a constant: ``trapezoid``'s
    ``x`` overload, not ``dx``); None if there is none or several. Among several, a 0-d constant
    (``scalars``: a Python number in the trace) picks the overload taking a number there
    (``quantile.scalar``, not ``quantile``'s float64 ``q`` tensor), and overloads that differ only in
    arguments the node leaves ``absent`` are the same call (``linalg_pinv``'s ``atol_rtol_float``
    and ``atol_rtol_tensor`` without atol and rtol): the first is taken."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return None
    found = _overloads_by_arity(packet, computed)
    if len(found) > 1 and scalars is not None:
        numeric = [
            o
            for o in found
            if all(
                "Tensor" not in str(a.type)
                for a, k in zip(compat.op_schema(getattr(packet, o)).arguments, scalars)
                if k
            )
        ]
        found = numeric or found
    if len(found) > 1 and absent is not None:
        kinds = {
            tuple(str(a.type) for a, gone in zip(compat.op_schema(getattr(packet, o)).arguments, absent) if not gone)
            for o in found
        }
        if len(kinds) == 1:
            return found[0]
    return found[0] if len(found) == 1 else None


def _overloads_by_arity(packet, computed: list[bool]) -> list[str]:
    found = []
    for overload in packet.overloads():
        arguments = compat.op_schema(getattr(packet, overload)).arguments
        if any(a.alias_info is not None and a.alias_info.is_write for a in arguments):
            continue
        if any("Dimname" in str(a.type) for a in arguments) or len(arguments) != len(computed):
            continue
        if any(c and "Tensor" not in str(a.type) for a, c in zip(arguments, computed)):
            continue
        found.append(overload)
    return found


#: the element types of a traced Python number (a 0-d constant)
_NUMBER_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT64, onnx.TensorProto.BOOL}
)


def name_aten_overloads(model: onnx.ModelProto) -> None:
    """Name the overload of each ATen node that names none where the default one does not take its
    inputs: torch's symbolics write ``sum(x, dim, keepdim, dtype)`` (``masked.sum``) without an
    overload, which the ATen bridge would read as ``sum.default(x, *, dtype)``. Left alone where no
    overload, or more than one, has that many arguments."""
    from ..bridge.aten import ATEN_DOMAIN

    constants = {o for n in model.graph.node if n.op_type == "Constant" and n.domain == "" for o in n.output}
    scalar_constants = {
        o
        for n in model.graph.node
        if n.op_type == "Constant"
        and n.domain == ""
        and any(a.name == "value" and len(a.t.dims) == 0 and a.t.data_type in _NUMBER_TYPES for a in n.attribute)
        for o in n.output
    }
    for node in model.graph.node:
        if node.domain != ATEN_DOMAIN or node.op_type != "ATen":
            continue
        attrs = {a.name: a for a in node.attribute}
        if "operator" not in attrs or (attrs.get("overload_name") is not None and attrs["overload_name"].s):
            continue
        name = attrs["operator"].s.decode()
        packet = getattr(torch.ops.aten, name, None)
        if packet is None or "::" in name:
            continue
        scalars = [i in scalar_constants for i in node.input]
        default = getattr(packet, "default", None)
        if default is not None and len(compat.op_schema(default).arguments) == len(node.input):
            arguments = compat.op_schema(default).arguments
            if not any(k and "Tensor" in str(a.type) for a, k in zip(arguments, scalars)):
                continue  # (a number where ``default`` takes a tensor: an overload taking one is looked for)
        overload = _overload_by_arity(
            name, [bool(i) and i not in constants for i in node.input], scalars, [not i for i in node.input]
        )
        if overload is None or overload == "default":
            continue
        if "overload_name" in attrs:
            attrs["overload_name"].s = overload.encode()
        else:
            node.attribute.append(onnx.helper.make_attribute("overload_name", overload))


def translate_torchscript(capture: TorchScriptCapture) -> ExportedModel:
    """The capture as an :class:`ExportedModel`: inputs mapped to the module's parameters and buffers,
    outputs named (the TorchScript exporter already wrote ONNX).

    Raises:
        ExportError: a graph input is neither a forward input nor a parameter or buffer.
    """
    adapter, model, input_names = capture.adapter, capture.model, capture.input_names
    forget_traced_shapes(model)
    aten_ops_as_aten_nodes(model)
    name_aten_overloads(model)
    named_state = state_tensors(adapter)
    state_inputs: dict[str, torch.Tensor] = {}
    for name in [i.name for i in model.graph.input]:
        if name in input_names:
            continue
        if name not in named_state:
            raise ExportError(f"exported graph input {name!r} is neither a forward input nor a parameter or buffer")
        state_inputs[name] = named_state[name]
    return finish_export(
        adapter,
        model,
        input_names,
        state_inputs,
        static_reasons=capture.static_reasons,
        static_spatial=capture.static_spatial,
        bridge=capture.bridge,
    )
