"""What both exporters share: the adapter module they capture, and turning a capture into an
:class:`ExportedModel`.

The adapter's forward takes the flat tensor inputs, rebuilds the user's ``args``/``kwargs``
(non-tensor values are baked in as constants), calls the module, and returns the flat tensor
outputs followed by every buffer. Its parameters and buffers are named ``module.<name>`` in the
exported graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import torch
from torch import nn

from .. import _tree
from ..errors import ExportError, UnsupportedOutputError
from ..graph.model import ExportedModel
from ..graph.names import BUFFER_OUTPUT_PREFIX, STATE_PREFIX
from .grad_mode import no_grad_boundaries


class _Traced:
    """What tracing the adapter found out: the output tree spec, the number of tensor outputs and
    their dtypes (what eager returns)."""

    __slots__ = ("n_outputs", "out_dtypes", "out_ranks", "out_spec")

    def __init__(self) -> None:
        self.out_spec: tuple | None = None
        self.n_outputs = 0
        self.out_dtypes: list[torch.dtype] = []
        self.out_ranks: list[int] = []


class Adapter(nn.Module):
    """Calls ``module`` with inputs rebuilt from flat tensors; returns flat tensor outputs + buffers."""

    def __init__(self, module: nn.Module, in_spec: tuple, autocast: tuple | None = None) -> None:
        super().__init__()
        self.module = module
        self._in_spec = in_spec
        #: the autocast state to capture under (``api.autocast_state()``): applied inside forward,
        #: where both exporters record its casts (torch.export does not see an ambient autocast)
        self._autocast = autocast
        #: the buffers returned after the outputs (floating point and int64 ones)
        self.buffer_names = [n for n, b in module.named_buffers() if b.is_floating_point() or b.dtype == torch.int64]
        # torch.export (non-strict) restores the module's attributes, containers included, after
        # tracing: the trace's findings go to an object it does not look into.
        self._traced = _Traced()

    @property
    def out_spec(self) -> tuple | None:
        return self._traced.out_spec

    @property
    def n_outputs(self) -> int:
        return self._traced.n_outputs

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = _tree.unflatten(self._in_spec, flat)
        with autocast_contexts(self._autocast), no_grad_boundaries():
            out = self.module(*args, **kwargs)
        leaves: list[torch.Tensor] = []
        holding: list[str] = []  # opaque outputs that hold tensors

        def opaque(path: str, value: Any) -> tuple:
            if _tree.holds_tensors(value):
                holding.append(f"`{path}` ({type(value).__module__}.{type(value).__qualname__})")
            return ("O", value)

        self._traced.out_spec = _tree.flatten(out, "output", leaves, opaque, objects=True)
        if holding:
            # NOTE: never the object built while exporting: its tensors are the export trace's.
            raise UnsupportedOutputError(
                f"forward() output {', '.join(holding)} holds tensors in an object ORTWrap cannot take apart "
                "(it has no __dict__ and no pytree registration). Return tensors nested in tuples, lists, dicts, "
                "dataclasses (transformers' ModelOutput), namedtuples or plain objects, or register the class "
                "with torch.utils._pytree.register_pytree_node"
            )
        self._traced.n_outputs = len(leaves)
        self._traced.out_dtypes = [t.dtype for t in leaves]
        self._traced.out_ranks = [t.dim() for t in leaves]
        buffers = dict(self.module.named_buffers())
        return (*leaves, *(buffers[n] for n in self.buffer_names))


@contextlib.contextmanager
def autocast_contexts(state: tuple | None) -> Iterator[None]:
    """Enter the autocast state ``state`` (``api.autocast_state()``); None: nothing."""
    if state is None:
        yield
        return
    devices, cache = state
    with contextlib.ExitStack() as stack:
        for device_type, dtype in devices:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
        yield


@contextlib.contextmanager
def no_ambient_autocast() -> Iterator[None]:
    """Autocast off around a capture (the adapter enters the call's own state inside), its cast
    cache empty on entry and on exit.

    NOTE: autocast caches the half-precision copy of each leaf parameter it casts until the
    outermost autocast region exits. A copy made before the capture in the same region (the user's
    eager forward of the module, or an earlier capture of it: the first try of a graph exported
    again with static image sizes) is a plain tensor requiring grad to the tracer, which the
    TorchScript exporter refuses as a constant ("Cannot insert a Tensor that requires grad as a
    constant"); a copy made during the capture belongs to the trace and must not reach a later
    eager forward or capture either.
    """
    from .._compat.torch import AUTOCAST_DEVICES

    with contextlib.ExitStack() as stack:
        stack.callback(torch.clear_autocast_cache)
        torch.clear_autocast_cache()
        for device_type in AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def state_tensors(adapter: Adapter) -> dict[str, torch.Tensor]:
    """Graph name -> tensor of every parameter and buffer of the adapted module."""
    named = dict(adapter.named_parameters(remove_duplicate=False))
    named.update(adapter.named_buffers(remove_duplicate=False))
    return named


@contextlib.contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Tracing runs the forward once: undo its buffer updates and its use of the RNG."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, v in saved:
                    b.copy_(v)


def finish_export(
    adapter: Adapter,
    model: onnx.ModelProto | ir.Model,
    input_names: list[str],
    state_inputs: dict[str, torch.Tensor],
    *,
    static_reasons: list[str],
    static_spatial: bool,
    bridge: Any,
    shape_guards: Any = None,
) -> ExportedModel:
    """Name the outputs of a captured ``model`` and describe how it maps to the module.

    Args:
        adapter: the adapter that was captured (its trace found the output structure).
        model: the captured graph (a proto, or the dynamo exporter's onnx_ir model, taken over);
            its inputs are ``input_names`` then state inputs.
        input_names: graph input name of each flat user input.
        state_inputs: graph input name -> parameter or buffer tensor.
        static_reasons: the exporter's own reasons for static spatial shapes.
        static_spatial: the capture fixed every non-batch dimension.
        bridge: the export scope of the bridged Functions (``keepalive``, ``functions``).
        shape_guards: the capture's shape assumptions (dynamo).
    """
    assert adapter.out_spec is not None
    module = adapter.module
    n_out = adapter.n_outputs
    buffer_names = adapter.buffer_names
    output_names = [f"output:{i}" for i in range(n_out)] + [f"{BUFFER_OUTPUT_PREFIX}{b}" for b in buffer_names]
    model = name_outputs(model, output_names, adapter._traced.out_dtypes, adapter._traced.out_ranks)
    present = {i.name for i in model.graph.input}
    buffers = dict(module.named_buffers())
    return ExportedModel(
        model=model,
        user_input_names=[n if n in present else None for n in input_names],
        state_inputs=state_inputs,
        output_names=output_names[:n_out],
        out_spec=adapter.out_spec,
        buffer_outputs={o: buffers[b] for o, b in zip(output_names[n_out:], buffer_names)},
        state_names={n: n[len(STATE_PREFIX) :] if n.startswith(STATE_PREFIX) else n for n in state_inputs},
        static_reasons=list(static_reasons) + graph_static_reasons(model),
        static_spatial=static_spatial,
        keepalive=bridge.keepalive,
        functions=bridge.functions,
        shape_guards=shape_guards,
    )


#: Ops whose ORT 1.19.2 gradient (or its rewrite) needs static non-batch dimensions: pooling grads
#: size their result from statically inferred shapes (MaxPoolGrad crashes with dynamic H/W), and
#: the Resize rewrite tabulates fixed interpolation matrices.
STATIC_SPATIAL_OPS = frozenset({"MaxPool", "AveragePool", "Resize", "Upsample", "LpPool", "MaxUnpool"})


_IR_FLOAT_TYPES = {
    torch.float32: ir.DataType.FLOAT,
    torch.float16: ir.DataType.FLOAT16,
    torch.bfloat16: ir.DataType.BFLOAT16,
    torch.float64: ir.DataType.DOUBLE,
}


def graph_static_reasons(model: onnx.ModelProto) -> list[str]:
    nodes = [n for n in model.graph.node if n.domain in ("", "ai.onnx")]
    found = sorted({n.op_type for n in nodes if n.op_type in STATIC_SPATIAL_OPS})
    reasons = [f"{op} needs static spatial shapes for its gradient" for op in found]
    if any(n.op_type == "If" for n in nodes):
        # The exporter writes shape-dependent ops (squeeze of a dynamic dim, ...) as If nodes, on
        # which ORT 1.19.2's gradient builder aborts the process; static dims make them plain ops.
        reasons.append("an If node (a shape-dependent op such as squeeze on a dynamic dimension)")
    return reasons


def _inferred_rank(model: onnx.ModelProto, index: int) -> int | None:
    """The rank ONNX shape inference gives graph output ``index`` of ``model`` from its producer
    (its declared shape forgotten), or None where inference cannot tell."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    name = probe.graph.output[index].name
    if probe.graph.output[index].type.HasField("tensor_type"):
        probe.graph.output[index].type.tensor_type.ClearField("shape")
    kept = [v for v in probe.graph.value_info if v.name != name]
    del probe.graph.value_info[:]
    probe.graph.value_info.extend(kept)
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False)
    except Exception:
        return None
    out = inferred.graph.output[index]
    if not out.type.HasField("tensor_type") or not out.type.tensor_type.HasField("shape"):
        return None
    return len(out.type.tensor_type.shape.dim)


def name_outputs(
    model: onnx.ModelProto | ir.Model, names: list[str], dtypes: list[torch.dtype] = (), ranks: list[int] = ()
) -> onnx.ModelProto:
    """Rename the graph outputs to ``names``; an output that is a graph input or repeats an earlier
    output first gets its own Identity node, so every output is a distinct value. A floating-point
    output whose graph dtype differs from ``dtypes`` (what the module returned while traced) is
    cast to it: the TorchScript exporter computes some float16 ops in float32 (LayerNorm, MatMul
    of a transposed weight) and returns float32 where eager returns float16.

    ``ranks``: the rank of each output the module returned. A 0-d output is reshaped to 0-d, as the
    graph may compute it with another rank (torch's symbolics write constants such as ``log(10)``
    as ``[1]`` tensors, and broadcasting makes ``log10`` of a 0-d input ``[1]``); any other rank
    difference is a wrong translation, refused (:class:`ExportError`).

    ``model`` may be an onnx_ir model (the dynamo exporter's), edited in place: that saves a
    serialization and a parse of the whole graph (the same nodes; onnx_ir may name the values
    added here otherwise)."""
    if isinstance(model, ir.Model):
        ir_model, proto = model, None
    else:
        ir_model, proto = ir.serde.deserialize_model(model), model
    graph = ir_model.graph
    for i, rank in enumerate(ranks):
        value = graph.outputs[i]
        have = None if value.shape is None else len(value.shape)
        producer = value.producer()
        if rank != 0 and (have == rank or (producer is not None and producer.op_type in ("If", "Loop", "Scan"))):
            continue  # (the exporter guesses a control-flow output's shape; such graphs are refused later)
        if rank == 0:
            # Always: the TorchScript exporter also declares 0-d some values its ops make [1] (atan2).
            shape = ir.node(
                "Constant",
                [],
                {"value": ir.tensor(np.zeros((0,), dtype=np.int64))},
                name=f"ortwrap/output_rank/{i}/shape",
            )
            node = ir.node("Reshape", [value, shape.outputs[0]], name=f"ortwrap/output_rank/{i}")
            graph.append(shape)
            graph.append(node)
            node.outputs[0].dtype = value.dtype
            node.outputs[0].shape = ir.Shape([])
            graph.outputs[i] = node.outputs[0]
        elif (
            have is not None
            and _inferred_rank(ir.serde.serialize_model(ir_model) if proto is None else proto, i) == rank
        ):
            # The exporter declared a wrong shape for a value its op computes right (dynamo's
            # ``nll_loss(reduction="none")`` is declared 0-d, like the loss it usually is): ONNX's
            # inference from the node itself gives the module's rank, and the declaration goes.
            value.shape = None
        elif have is not None:
            raise ExportError(
                f"the exported graph's output {i} has rank {have} where the module returns a rank-{rank} "
                "tensor: an op of the module is translated wrongly"
            )
    for i, dtype in enumerate(dtypes):
        value = graph.outputs[i]
        want = _IR_FLOAT_TYPES.get(dtype)
        if (
            want is not None
            and value.dtype is not None
            and value.dtype != want
            and value.dtype in _IR_FLOAT_TYPES.values()
        ):
            node = ir.node("Cast", [value], {"to": int(want)}, name=f"ortwrap/output_dtype/{i}")
            graph.append(node)
            node.outputs[0].dtype = want
            node.outputs[0].shape = value.shape
            graph.outputs[i] = node.outputs[0]
    if len(graph.outputs) != len(names):
        raise ExportError(f"the exported graph has {len(graph.outputs)} outputs, expected {len(names)}")
    inputs = {id(v) for v in graph.inputs}
    seen: set[int] = set()
    for i, value in enumerate(list(graph.outputs)):
        if id(value) in inputs or id(value) in seen:
            node = ir.node("Identity", [value], name=f"ortwrap/output_copy/{i}")
            graph.append(node)
            value = node.outputs[0]
            graph.outputs[i] = value
        seen.add(id(value))
        value.name = names[i]
    if "" not in ir_model.opset_imports and any(n.domain == "" for n in graph):
        # A graph of ATen nodes only (dynamo's ``dropout2d``) imports no ONNX opset; the nodes
        # added here need one.
        ir_model.opset_imports[""] = 18
    return ir.serde.serialize_model(ir_model)
