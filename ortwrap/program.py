"""A compiled program: what one input schema of one module runs, and how it was built.

``compile_program`` runs the stages in order: export -> passes -> gradient build -> session. Each
stage raises its own ortwrap error; the caller (``ORTWrap``) decides whether to fall back.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import onnx
import torch
from torch import nn

from . import kernels
from ._compat import torch as compat
from ._logging import logger
from ._ort import C
from .bridge import aten
from .bridge.aten import ATEN_DOMAIN
from .errors import ExportError, GradientBuildError
from .export import ExportedModel, export_dynamo, export_torchscript
from .grad import TrainingGraph, build_graph
from .options import Options
from .passes import PassRecord, default_passes, run_passes
from .passes.host_shapes import HostShapeSplit, HostShapeSplitPass
from .passes.pythonop_context import CONTEXT_OUTPUT_PREFIX
from .passes.stop_gradient import STOP_GRADIENT_SUFFIX
from .runtime import InferenceRunner, TrainingRunner
from .runtime.dlpack import StateValueCache, push_tensor
from .runtime.host_shapes import HostShapeRunner


@dataclass
class BuildArtifacts:
    """Everything one build produced, for users and tests to inspect.

    Attributes:
        exported: the ONNX model as the exporter produced it (after output naming).
        pre_grad: the model after ortwrap's passes, as given to the gradient builder.
        graph: the built graph; ``graph.model()`` is the forward+backward (or inference) ONNX.
        passes: what each pass did.
        seconds: wall time of each stage.
        training: exported in training mode.
        with_backward: built with a backward graph.
        exports: how many exports the build took (2 when a graph needed static spatial shapes).
        exporter: the exporter that produced the graph (``"dynamo"`` or ``"torchscript"``).
        static_reasons: why the graph's non-batch dimensions are static (empty when all are dynamic).
        host_shapes: with ``aggressive_cpu_fallback``, the host shape program, the graph inputs it
            feeds and which nodes moved and why (``host_shapes.summary()``); else ``None``.
    """

    exported: onnx.ModelProto
    pre_grad: onnx.ModelProto
    graph: TrainingGraph
    passes: list[PassRecord]
    seconds: dict[str, float] = field(default_factory=dict)
    training: bool = True
    with_backward: bool = True
    exports: int = 1
    static_reasons: list[str] = field(default_factory=list)
    host_shapes: HostShapeSplit | None = None
    exporter: str = ""

    def save(self, directory: str, index: int) -> list[str]:
        """Write the three models to ``directory``; return their paths."""
        os.makedirs(directory, exist_ok=True)
        kind = "train" if self.with_backward else ("infer_trainmode" if self.training else "infer")
        paths = []
        for name, model in (("exported", self.exported), ("pre_grad", self.pre_grad)):
            path = os.path.join(directory, f"build{index:02d}_{kind}_{name}.onnx")
            onnx.save_model(model, path)
            paths.append(path)
        path = os.path.join(
            directory, f"build{index:02d}_{kind}_{'forward_backward' if self.with_backward else 'forward'}.onnx"
        )
        with open(path, "wb") as f:
            f.write(self.graph.model_bytes)
        paths.append(path)
        if self.host_shapes is not None:
            paths += self.host_shapes.save(directory, f"build{index:02d}_{kind}_host_shapes")
        return paths


@dataclass
class _StateRef:
    """Where a parameter or buffer lives, so each step feeds the module's current tensor."""

    owner: nn.Module
    attr: str
    is_param: bool

    def table(self) -> dict[str, torch.Tensor]:
        """The owner's ``_parameters`` or ``_buffers``: the dict that ``table()[attr]`` reads."""
        return compat.parameter_table(self.owner) if self.is_param else compat.buffer_table(self.owner)


class Program:
    """One compiled input schema: the runner, and how flat inputs map to graph feeds."""

    def __init__(self, exported: ExportedModel, graph: TrainingGraph, runner, module: nn.Module) -> None:
        self.graph = graph
        self.runner = runner
        self.with_backward = graph.has_backward
        #: Non-batch dimensions are part of the graph: each new one needs its own program.
        self.static_spatial = exported.static_spatial
        #: dynamo exports: dims the capture fixed or tied; a call that breaks them needs a new program.
        self.shape_guards = exported.shape_guards or None
        self.out_spec = exported.out_spec
        index_of = {name: i for i, name in enumerate(exported.user_input_names) if name is not None}
        refs = _state_refs(module)
        # Each feed is (flat index, None, None) for a user input, or (-1, table, attr) for module
        # state: the owning submodule's _parameters or _buffers dict, read at ``attr`` every step.
        self._plan: list[tuple[int, dict[str, torch.Tensor] | None, str | None]] = []
        for name in graph.feed_names:
            if name in index_of:
                self._plan.append((index_of[name], None, None))
            else:
                ref = refs[exported.state_names[name]]
                self._plan.append((-1, ref.table(), ref.attr))
        outputs = list(graph.info.user_output_names)
        self.n_outputs = len(exported.output_names)
        if outputs[: self.n_outputs] != exported.output_names:
            raise AssertionError(f"graph outputs {outputs} do not start with {exported.output_names}")
        rest = outputs[self.n_outputs :]
        #: PythonOp context ids, the last outputs (see passes/pythonop_context.py).
        self.n_contexts = sum(name.startswith(CONTEXT_OUTPUT_PREFIX) for name in rest)
        buffer_names = rest[: len(rest) - self.n_contexts]
        self.buffer_outputs = [exported.buffer_outputs[name] for name in buffer_names]
        #: Outputs autograd must not differentiate: ORT's non-differentiable ones, buffers, context ids.
        self.non_differentiable = tuple(
            i for i in range(len(outputs)) if i in graph.info.non_differentiable_outputs or i >= self.n_outputs
        )
        self._state_cache = StateValueCache(len(self._plan))
        # NOTE: the graph's PythonOps hold the addresses of these objects: they live exactly as long
        # as this program (and its session) can run.
        self.keepalive = exported.keepalive
        self.n_pythonops = len(exported.functions)
        #: with aggressive_cpu_fallback: computes the host-fed inputs from the user's tensors
        self.host_shapes_runner: HostShapeRunner | None = None

    def forget_state_values(self) -> None:
        """Drop the cached OrtValues of parameters and buffers, and the memory they keep alive (DeepSpeed
        ZeRO-3 partitions the parameters between steps: their gathered memory must be freed)."""
        self._state_cache = StateValueCache(len(self._plan))

    def bind(self, leaves: list[torch.Tensor]) -> tuple[list[torch.Tensor], C.OrtValueVector]:
        """The tensors of every graph feed, in feed order (user inputs, then parameters and buffers),
        and the same as an OrtValueVector; parameters and buffers reuse their cached OrtValues.

        One pass over the feeds: this runs on every step (see runtime/function.py's NOTE)."""
        if self.host_shapes_runner is not None:  # the host-fed inputs follow the user's tensors
            leaves = [*leaves, *self.host_shapes_runner(leaves)]
        vec = C.OrtValueVector()
        push = vec.push_back
        cache = self._state_cache
        cached_tensors, pointers, values = cache.tensors, cache.pointers, cache.values
        feeds: list[torch.Tensor] = []
        append = feeds.append
        for j, (i, table, attr) in enumerate(self._plan):
            if table is None:
                t = leaves[i]
                push_tensor(vec, t)
            else:
                t = table[attr]
                if cached_tensors[j] is t and pointers[j] == t.data_ptr():
                    push(values[j])
                else:
                    push(cache.refresh(j, t))
            append(t)
        return feeds, vec


def _add_stop_gradient_inputs(exported: ExportedModel) -> None:
    """Frozen duplicate inputs made by the stop-gradient pass are fed the tensor they duplicate."""
    for value in exported.model.graph.input:
        name = value.name
        if name.endswith(STOP_GRADIENT_SUFFIX) and name not in exported.state_inputs:
            base = name[: -len(STOP_GRADIENT_SUFFIX)]
            exported.state_inputs[name] = exported.state_inputs[base]
            exported.state_names[name] = exported.state_names[base]


def _state_refs(module: nn.Module) -> dict[str, _StateRef]:
    refs: dict[str, _StateRef] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr in compat.parameter_table(sub):
            refs.setdefault(f"{prefix}.{attr}" if prefix else attr, _StateRef(sub, attr, True))
        for attr in compat.buffer_table(sub):
            refs.setdefault(f"{prefix}.{attr}" if prefix else attr, _StateRef(sub, attr, False))
    return refs


_EXPORTERS = {"torchscript": export_torchscript, "dynamo": export_dynamo}


def _export(
    module: nn.Module,
    leaves: list[torch.Tensor],
    in_spec: tuple,
    input_paths: list[str],
    exporters: tuple[str, ...],
    export_kw: dict,
) -> tuple[ExportedModel, int, list[str], str]:
    """Export with the first of ``exporters`` that succeeds: (the export, how many exports it took,
    why its non-batch dimensions are static, the exporter's name).

    Raises:
        ExportError: the first exporter's error, when every exporter failed.
    """
    errors: list[tuple[str, ExportError]] = []
    for i, name in enumerate(exporters):
        export = _EXPORTERS[name]
        exports = 0  # of this exporter (a failed attempt of another one is not counted)
        try:
            try:
                exported: ExportedModel | None = export(module, leaves, in_spec, input_paths, **export_kw)
            except ExportError as e:
                # Some symbolics (adaptive pooling to a size > 1) need the traced spatial sizes.
                if "input size not accessible" not in str(e):
                    raise
                exported = None
                reasons = ["the exporter needs static spatial sizes"]
            else:
                reasons = list(exported.static_reasons)
            exports += 1
            if exported is None or exported.static_reasons:
                logger.info("exporting with static non-batch dimensions: %s", "; ".join(reasons))
                exported = export(module, leaves, in_spec, input_paths, static_spatial=True, **export_kw)
                exports += 1
        except ExportError as e:
            errors.append((name, e))
            if i + 1 < len(exporters):
                logger.warning(
                    "the %s exporter failed for %s (%s); trying the %s exporter",
                    name,
                    type(module).__name__,
                    str(e).split(". ")[0][:300],
                    exporters[i + 1],
                )
            continue
        return exported, exports, reasons, name
    name, first = errors[0]
    if len(errors) == 1:
        raise first
    others = "; ".join(
        f"the {n} exporter also failed: {str(e).removeprefix('[ortwrap:export] ')}" for n, e in errors[1:]
    )
    raise type(first)(f"{str(first).removeprefix('[ortwrap:export] ')} ({others})") from first


def compile_program(
    module: nn.Module,
    leaves: list[torch.Tensor],
    in_spec: tuple,
    input_paths: list[str],
    *,
    training: bool,
    with_backward: bool,
    device: torch.device,
    options: Options,
) -> tuple[Program, BuildArtifacts]:
    """Export, rewrite, build and load ``module`` for one input schema.

    Raises:
        ExportError, PassError, GradientBuildError, SessionError: from the stage that failed.
    """
    seconds: dict[str, float] = {}
    export_kw = dict(
        training=training,
        opset=options.opset,
        with_backward=with_backward,
        inline_functions=options.inline_functions,
        aten_ops=options.aten_ops,
    )
    t0 = time.perf_counter()
    exported, exports, reasons, exporter = _export(module, leaves, in_spec, input_paths, options.exporters, export_kw)
    exported_proto = onnx.ModelProto()
    exported_proto.CopyFrom(exported.model)
    t1 = time.perf_counter()
    seconds["export"] = t1 - t0
    native = (
        options.native_kernels
        and with_backward
        and device.type == "cpu"
        and kernels.available(options.intra_op_threads or torch.get_num_threads())
    )
    passes = default_passes(with_backward=with_backward, device_type=device.type, native_kernels=native)
    host_pass = None
    if options.aggressive_cpu_fallback:  # last: it splits the final forward graph
        host_pass = HostShapeSplitPass({n for n in exported.user_input_names if n is not None})
        passes.append(host_pass)
    exported.model, records = run_passes(exported.model, passes)
    host_index = {n: i for i, n in enumerate(exported.user_input_names) if n is not None}
    if host_pass is not None:  # the host-fed inputs follow the user's flat tensors
        exported.user_input_names += [f.name for f in host_pass.split.feeds]
    t2 = time.perf_counter()
    seconds["passes"] = t2 - t1
    remaining = {o.name for o in exported.model.graph.output}
    exported.buffer_outputs = {k: v for k, v in exported.buffer_outputs.items() if k in remaining}
    _add_stop_gradient_inputs(exported)
    if any(n.domain == ATEN_DOMAIN for n in exported.model.graph.node):
        aten.install()
        aten.declare_output_types(exported.model)
        if with_backward:
            try:
                aten.register_gradients(exported.model)
            except Exception as e:
                raise GradientBuildError(f"registering the gradients of ATen nodes failed: {e}") from e
    state = list(exported.state_inputs)
    trainable = [
        n
        for n, t in exported.state_inputs.items()
        if isinstance(t, nn.Parameter) and t.requires_grad and not n.endswith(STOP_GRADIENT_SUFFIX)
    ]
    require_grad = [
        name
        for name, t in zip(exported.user_input_names, leaves)
        if name is not None and t.requires_grad and (t.is_floating_point() or t.is_complex())
    ]
    graph = build_graph(
        exported.model,
        state_names=state,
        trainable_names=trainable if with_backward else [],
        input_names_require_grad=require_grad if with_backward else [],
        build_gradient=with_backward,
        log_level=options.logging_level,
    )
    t3 = time.perf_counter()
    seconds["gradient_build"] = t3 - t2
    runner = (TrainingRunner if with_backward else InferenceRunner)(graph, device, options)
    seconds["session"] = time.perf_counter() - t3
    program = Program(exported, graph, runner, module)
    if host_pass is not None and host_pass.split.feeds:
        program.host_shapes_runner = HostShapeRunner(host_pass.split, host_index)
    artifacts = BuildArtifacts(
        exported_proto,
        exported.model,
        graph,
        records,
        seconds,
        training,
        with_backward,
        exports,
        sorted(set(reasons + exported.static_reasons)) if exported.static_spatial else [],
        host_pass.split if host_pass is not None else None,
        exporter,
    )
    if logger.isEnabledFor(logging.INFO):
        logger.info(
            "built %s program for %s in %.2fs (%s)",
            "training" if with_backward else "inference",
            type(module).__name__,
            sum(seconds.values()),
            ", ".join(f"{k} {v:.2f}s" for k, v in seconds.items()),
        )
    return program, artifacts
