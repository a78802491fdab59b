"""Export with the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``).

The module is exported through an adapter whose forward takes the flat tensor inputs, rebuilds the
user's ``args``/``kwargs`` (non-tensor values are baked in as constants), calls the module, and
returns the flat tensor outputs followed by every buffer. Parameters and buffers become graph inputs
(``export_params=False, keep_initializers_as_inputs=True``), so the tensors the optimizer updates in
place are what each step feeds. Buffers returned unchanged are pruned by a pass; the ones that
change become outputs copied back after each forward.

Every dimension of every input is dynamic, so a new batch size or sequence length reuses the graph.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from typing import Any

import onnx
import onnx_ir as ir
import torch
from torch import nn

from .. import _tree
from ..bridge.symbolic import export_scope
from ..errors import ExportError
from ..integrations.distributed import collective_stubs
from ..passes.prune_buffer_outputs import BUFFER_OUTPUT_PREFIX
from .model import ExportedModel
from .symbolics import ortwrap_symbolics

_PREFIX = "module."


class _Traced:
    """What tracing the adapter found out: the output tree spec and the number of tensor outputs."""

    __slots__ = ("n_outputs", "out_spec")

    def __init__(self) -> None:
        self.out_spec: tuple | None = None
        self.n_outputs = 0


class _Adapter(nn.Module):
    """Calls ``module`` with inputs rebuilt from flat tensors; returns flat tensor outputs + buffers."""

    def __init__(self, module: nn.Module, in_spec: tuple, buffer_names: list[str]) -> None:
        super().__init__()
        self.module = module
        self._in_spec = in_spec
        self._buffer_names = buffer_names
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
        out = self.module(*args, **kwargs)
        leaves: list[torch.Tensor] = []
        self._traced.out_spec = _tree.flatten(out, "output", leaves, _opaque_output)
        self._traced.n_outputs = len(leaves)
        buffers = dict(self.module.named_buffers())
        return (*leaves, *(buffers[n] for n in self._buffer_names))


def _opaque_output(path: str, value: Any) -> tuple:
    return ("O", value)


@contextlib.contextmanager
def _buffers_as_inputs(module: nn.Module) -> Iterator[None]:
    """The TorchScript exporter feeds only ``state_dict()`` entries as inputs and bakes the rest in:
    a non-persistent buffer (rotary tables, masks) would become a constant, stale once the module
    changes it. During export every buffer is persistent, so each one is a graph input."""
    saved = [(m, set(m._non_persistent_buffers_set)) for m in module.modules() if m._non_persistent_buffers_set]
    for m, _ in saved:
        m._non_persistent_buffers_set.clear()
    try:
        yield
    finally:
        for m, names in saved:
            m._non_persistent_buffers_set.update(names)


@contextlib.contextmanager
def _preserved_state(module: nn.Module) -> Iterator[None]:
    """Tracing runs the forward once: undo its buffer updates and its use of the RNG."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, v in saved:
                    b.copy_(v)


def export_torchscript(
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
) -> ExportedModel:
    """Export ``module`` called with the inputs that ``in_spec`` and ``flat_inputs`` describe.

    Args:
        module: the user's module.
        flat_inputs: the flat tensor inputs of this call.
        in_spec: tree spec of ``(args, kwargs)``.
        input_paths: a readable path for each flat input (``"x"``, ``"batch['ids']"``).
        training: export in training mode (dropout on, batch statistics) or eval mode.
        opset: ONNX opset to target.
        static_spatial: make only dimension 0 of each input dynamic (see :data:`STATIC_SPATIAL_OPS`).
        with_backward: the graph will get a backward (PythonOps keep their contexts).
        inline_functions: qualified names of autograd.Functions to export as ops, not PythonOps.
        aten_ops: names of aten ops to export as ATen nodes (PyTorch's kernels) in any case.

    Raises:
        ExportError: chained to the exporter's error.
    """
    buffer_names = [n for n, b in module.named_buffers() if b.is_floating_point() or b.dtype == torch.int64]
    adapter = _Adapter(module, in_spec, buffer_names)
    input_names = [f"input:{p}" for p in input_paths]
    dims = (lambda t: range(min(t.dim(), 1))) if static_spatial else (lambda t: range(t.dim()))
    dynamic_axes = {name: {d: f"{name}.dim{d}" for d in dims(t)} for name, t in zip(input_names, flat_inputs)}
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    f = io.BytesIO()
    was_training = module.training
    try:
        with (
            _preserved_state(module),
            _buffers_as_inputs(module),
            export_scope(with_backward=with_backward, inline=frozenset(inline_functions)) as bridge,
            ortwrap_symbolics(opset, aten_ops) as symbolic_reasons,
            collective_stubs(),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
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
                autograd_inlining=False,
                # Ops without an ONNX translation become ATen nodes that run PyTorch's kernels.
                operator_export_type=torch.onnx.OperatorExportTypes.ONNX_ATEN_FALLBACK,
            )
    except Exception as e:
        text = str(e)
        if len(text) > 500:  # the exporter appends whole graphs; the chained cause keeps them
            text = text[:500] + " ... (full message in the chained exception)"
        raise ExportError(
            f"torch.onnx.export (TorchScript) failed for {type(module).__name__}: {type(e).__name__}: {text}. "
            "Check that the module's forward is traceable, or run it without ORTWrap."
        ) from e
    finally:
        module.train(was_training)
    n_out = adapter.n_outputs
    output_names = [f"output:{i}" for i in range(n_out)] + [f"{BUFFER_OUTPUT_PREFIX}{b}" for b in buffer_names]
    model = _name_outputs(onnx.load_model_from_string(f.getvalue()), output_names)
    graph_inputs = [i.name for i in model.graph.input]
    present = set(graph_inputs)
    named_state = dict(adapter.named_parameters(remove_duplicate=False))
    named_state.update(adapter.named_buffers(remove_duplicate=False))
    state_inputs: dict[str, torch.Tensor] = {}
    state_names: dict[str, str] = {}
    for name in graph_inputs:
        if name in input_names:
            continue
        if name not in named_state:
            raise ExportError(f"exported graph input {name!r} is neither a forward input nor a parameter or buffer")
        state_inputs[name] = named_state[name]
        state_names[name] = name[len(_PREFIX) :] if name.startswith(_PREFIX) else name
    assert adapter.out_spec is not None
    buffers = dict(module.named_buffers())
    return ExportedModel(
        model=model,
        user_input_names=[n if n in present else None for n in input_names],
        state_inputs=state_inputs,
        output_names=output_names[:n_out],
        out_spec=adapter.out_spec,
        buffer_outputs={o: buffers[b] for o, b in zip(output_names[n_out:], buffer_names)},
        state_names=state_names,
        static_reasons=list(symbolic_reasons) + _graph_static_reasons(model),
        static_spatial=static_spatial,
        keepalive=bridge.keepalive,
        functions=bridge.functions,
    )


#: Ops whose ORT 1.19.2 gradient (or its rewrite) needs static non-batch dimensions: pooling grads
#: size their result from statically inferred shapes (MaxPoolGrad crashes with dynamic H/W), and
#: the Resize rewrite tabulates fixed interpolation matrices.
STATIC_SPATIAL_OPS = frozenset({"MaxPool", "AveragePool", "Resize", "Upsample", "LpPool", "MaxUnpool"})


def _graph_static_reasons(model: onnx.ModelProto) -> list[str]:
    nodes = [n for n in model.graph.node if n.domain in ("", "ai.onnx")]
    found = sorted({n.op_type for n in nodes if n.op_type in STATIC_SPATIAL_OPS})
    reasons = [f"{op} needs static spatial shapes for its gradient" for op in found]
    if any(n.op_type == "If" for n in nodes):
        # The exporter writes shape-dependent ops (squeeze of a dynamic dim, ...) as If nodes, on
        # which ORT 1.19.2's gradient builder aborts the process; static dims make them plain ops.
        reasons.append("an If node (a shape-dependent op such as squeeze on a dynamic dimension)")
    return reasons


def _name_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """Rename the graph outputs to ``names``; an output that is a graph input or repeats an earlier
    output first gets its own Identity node, so every output is a distinct value."""
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
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
    return ir.serde.serialize_model(ir_model)
