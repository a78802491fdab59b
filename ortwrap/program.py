"""A compiled program: what one input schema of one module runs, and how it was built.

``compile_program`` runs the build as data (``pipeline.py``): the export stages of an exporter
(``export_stages``: capture, translate), then ``build_stages`` (native kernels, type inference,
each graph pass, host split, ATen gradients, gradient build, session, program). Each stage
declares what it requires and provides and returns it; each is timed and, with ``debug_dir``,
snapshotted. Each raises its own ortwrap error; the caller (``ORTWrap``) decides whether to fall back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import onnx
import onnx_ir as ir
import torch
from torch import nn

from . import cache as build_cache
from . import gemm_choice as gemms
from . import integrations, kernels
from ._compat import torch as compat
from ._logging import BuildProgress, logger, ort_log_wanted
from ._ort import C
from .bridge import aten
from .bridge.aten import ATEN_DOMAIN, infer_types
from .errors import ExportError, GradientBuildError, PassError, UnsupportedInputError, UnsupportedOutputError
from .export import ExportedModel
from .export.dynamo import capture_dynamo, translate_dynamo
from .export.torchscript import capture_torchscript, translate_torchscript
from .grad import TrainingGraph, build_graph
from .grad.recompute import RecomputeReport, recompute_segments
from .options import Options, build_cache_dir
from .passes import PassRecord, default_passes, run_pass
from .passes.half_matmul import TorchGemmOnCPUPass
from .passes.half_precision import FuseHalfInitializersPass
from .passes.half_values import HalfValuesOnCPUPass
from .passes.host_shapes import HostShapeSplit, HostShapeSplitPass
from .passes.native_attention import NativeAttentionPass
from .passes.native_cpu_kernels import NativeCPUKernelsPass
from .passes.pythonop_context import CONTEXT_OUTPUT_PREFIX
from .passes.stop_gradient import STOP_GRADIENT_SUFFIX
from .pipeline import Stage, StageRecord, run_stages, stage
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
        stage_seconds: wall time of each stage of the build (``pipeline.Stage``), in order.
        stages: each stage's record (time, debug snapshots).
        cached: the program came from the build cache (``exports`` is 0).
        recompute: with ``recompute``, what the rewrite kept and recomputed (grad/recompute.py);
            ``None`` otherwise, and for programs loaded from the build cache.
        gemm_choice: which library runs the GEMMs (``gemm``, ``half_compute``) and, for ``"auto"``,
            the measured rates it chose by (``gemm_choice.GemmChoice``; ``.summary()``); ``None``
            for programs loaded from the build cache.
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
    stage_seconds: dict[str, float] = field(default_factory=dict)
    stages: list[StageRecord] = field(default_factory=list)
    cached: bool = False
    recompute: RecomputeReport | None = None
    gemm_choice: gemms.GemmChoice | None = None

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


_dict_item = dict.__getitem__


class Program:
    """One compiled input schema: the runner, and how flat inputs map to graph feeds."""

    def __str__(self) -> str:
        return self._label

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
        # state: the owning submodule's _parameters or _buffers dict, read at ``attr`` every step;
        # -2 instead of -1 feeds a float32 copy of half-precision state (``graph.float_feeds``).
        self._plan: list[tuple[int, dict[str, torch.Tensor] | None, str | None]] = []
        for name in graph.feed_names:
            if name in index_of:
                self._plan.append((index_of[name], None, None))
            else:
                ref = refs[exported.state_names[name]]
                self._plan.append((-2 if name in graph.float_feeds else -1, ref.table(), ref.attr))
        outputs = list(graph.info.user_output_names)
        #: outputs that depend on no graph input, ``(index, value)``: not outputs of the graph, put
        #: back by ``outputs`` (grad/builder.py's split_constant_outputs)
        self.constant_outputs = tuple((i, value.to(runner.device)) for i, _, value in graph.constant_outputs)
        for i, name, _ in graph.constant_outputs:
            outputs.insert(i, name)
        self.n_outputs = len(exported.output_names)
        # the graph's own user outputs (RunTrainingGraph's indices count only the graph's outputs)
        n_graph = self.n_outputs - sum(i < self.n_outputs for i, _ in self.constant_outputs)
        self._label = f"{'training' if self.with_backward else 'inference'} program for {type(module).__name__}"
        #: forward runs that succeeded (the first failure of a program that never ran falls back)
        self.runs = 0
        if outputs[: self.n_outputs] != exported.output_names:
            raise AssertionError(f"graph outputs {outputs} do not start with {exported.output_names}")
        rest = outputs[self.n_outputs :]
        #: PythonOp context ids, the last outputs (see passes/pythonop_context.py).
        self.n_contexts = sum(name.startswith(CONTEXT_OUTPUT_PREFIX) for name in rest)
        buffer_names = rest[: len(rest) - self.n_contexts]
        self.buffer_outputs = [exported.buffer_outputs[name] for name in buffer_names]
        #: Outputs autograd must not differentiate: ORT's non-differentiable ones, buffers, context ids.
        self.non_differentiable = tuple(
            i
            for i in range(len(graph.info.user_output_names))
            if i in graph.info.non_differentiable_outputs or i >= n_graph
        )
        #: User outputs ORT's backward reads: saved with save_for_backward, so that autograd's
        #: version counters catch an in-place edit before the backward, as in eager.
        self.saved_outputs = tuple(i for i in graph.info.saved_output_indices if i < n_graph)
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
                # NOTE: dict's own lookup: DeepSpeed ZeRO-3's parameter dicts gather a partitioned
                # parameter on item access (and register it as its module's external parameter);
                # the graph feeds what the module holds now (zero3_gather="submodule" gathers inside).
                t = _dict_item(table, attr)
                if i == -2:  # fed as a float32 copy (fuse_initializers)
                    push(cache.float_copy(j, t))
                elif cached_tensors[j] is t and pointers[j] == t.data_ptr():
                    push(values[j])
                else:
                    push(cache.refresh(j, t))
            append(t)
        return feeds, vec


class ProgramSet:
    """The programs of one input schema: the one kind of value ``ORTWrap`` caches per schema key.

    Usually a single program (every input dimension dynamic). A graph whose non-batch dimensions
    are static has one program per such shape; a dynamo capture that fixed or tied dimensions has
    one per set of shape guards, and the first whose guards hold serves a call.
    """

    __slots__ = ("_by_shape", "_dynamic", "_guarded")

    def __init__(self) -> None:
        self._dynamic: Program | None = None
        self._by_shape: dict[tuple, Program] = {}
        self._guarded: list[Program] = []

    def find(self, leaves: list[torch.Tensor]) -> Program | None:
        """The program that serves these inputs, or None (a build is needed, or, for an input with a
        zero-size dimension, a run in PyTorch: ``ORTWrap.forward``)."""
        # NOTE: no program serves a zero-size input, though a dynamic batch dimension (the TorchScript
        # exporter's) admits 0: ORT kernels reject empty tensors (Gemm's gradient with K = 0) and the
        # trace dropped any branch of forward() on an empty batch. (The dynamo exporter's programs
        # guard each dynamic size to be at least 2: torch.export specializes 0 and 1.) Checked on
        # every call: one numel() a leaf.
        for t in leaves:
            if not t.numel():
                return None
        if self._dynamic is not None:
            return self._dynamic
        if self._by_shape:
            program = self._by_shape.get(tuple(tuple(t.shape[1:]) for t in leaves))
            if program is not None:
                return program
        for program in self._guarded:
            if program.shape_guards.check(leaves):
                return program
        return None

    @property
    def guarded(self) -> bool:
        """Whether the schema's programs carry shape guards (a miss means: new shapes)."""
        return bool(self._guarded)

    def add(self, program: Program, leaves: list[torch.Tensor]) -> None:
        if program.static_spatial:
            self._by_shape[tuple(tuple(t.shape[1:]) for t in leaves)] = program
        elif program.shape_guards:
            self._guarded.append(program)
        else:
            self._dynamic = program

    def remove(self, program: Program) -> None:
        if self._dynamic is program:
            self._dynamic = None
        self._by_shape = {k: p for k, p in self._by_shape.items() if p is not program}
        self._guarded = [p for p in self._guarded if p is not program]

    def __iter__(self):
        if self._dynamic is not None:
            yield self._dynamic
        yield from self._by_shape.values()
        yield from self._guarded

    def __bool__(self) -> bool:
        return self._dynamic is not None or bool(self._by_shape) or bool(self._guarded)


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


@dataclass(frozen=True)
class BuildRequest:
    """What every build stage may read: the module, this call's inputs and how to build."""

    module: nn.Module
    leaves: list[torch.Tensor]
    in_spec: tuple
    input_paths: list[str]
    training: bool
    with_backward: bool
    device: torch.device
    options: Options
    #: the autocast state the call ran under (``api.autocast_state()``), or None
    autocast: tuple | None = None

    @property
    def kind(self) -> str:
        return "train" if self.with_backward else ("infer_trainmode" if self.training else "infer")

    def describe(self) -> str:
        return f"{'training' if self.with_backward else 'inference'} program for {type(self.module).__name__}"


#: exporter name -> (capture, translate): the two export stages of each exporter.
_EXPORTERS = {
    "torchscript": (capture_torchscript, translate_torchscript),
    "dynamo": (capture_dynamo, translate_dynamo),
}


def export_stages(exporter: str) -> list[Stage]:
    """The export stages of ``exporter``: capture the module, translate the capture to ONNX."""
    capture_fn, translate_fn = _EXPORTERS[exporter]

    @stage("export", ("request", "static_spatial"), ("capture",), group="export")
    def capture(request: BuildRequest, static_spatial: bool) -> dict:
        o = request.options
        return {
            "capture": capture_fn(
                request.module,
                request.leaves,
                request.in_spec,
                request.input_paths,
                training=request.training,
                opset=o.opset,
                static_spatial=static_spatial,
                with_backward=request.with_backward,
                inline_functions=o.inline_functions,
                aten_ops=o.aten_ops,
                autocast=request.autocast,
            )
        }

    @stage("translate", ("capture",), ("exported",), group="export")
    def translate(capture: Any) -> dict:
        return {"exported": translate_fn(capture)}

    return [capture, translate]


def _export(
    request: BuildRequest, records: list[StageRecord], debug: dict
) -> tuple[ExportedModel | None, int, list[str], str, str | None, build_cache.CacheEntry | None]:
    """Run the export stages of the first of ``request.options.exporters`` that succeeds: (the export,
    how many exports it took, why its non-batch dimensions are static, the exporter's name, the
    build cache key, the cache entry that serves this build).

    Between each exporter's first capture and its translation the build cache is looked up
    (``cache_lookup``): on a hit the translation never runs, and the export is None.

    A graph that needs static non-batch dimensions (see ``export.adapter``) is exported again
    with them. Only the successful exporter's exports are counted.

    Raises:
        ExportError: the first exporter's error (naming the others'), when every exporter failed.
    """
    exporters = request.options.exporters
    errors: list[tuple[str, ExportError]] = []
    for name in exporters:
        capture_stage, translate_stage = export_stages(name)
        exports = 0
        cache_key: str | None = None
        try:
            try:
                values, cache_key, hit = _capture(request, capture_stage, name, False, True, records, debug)
                if hit is not None:
                    return None, 0, [], name, cache_key, hit
                values = run_stages([translate_stage], values, records=records, **debug)
                exported: ExportedModel | None = values["exported"]
            except ExportError as e:
                # Some symbolics (adaptive pooling to a size > 1) need the traced spatial sizes.
                if "input size not accessible" not in str(e):
                    raise
                exported = None
                reasons = ["the exporter needs static spatial sizes"]
            else:
                reasons = list(exported.static_reasons)
            exports += 1
            if exported is None or (exported.static_reasons and not exported.static_spatial):
                logger.info("exporting with static non-batch dimensions: %s", "; ".join(reasons))
                # the first capture's key serves (its entries record their static shape); when the
                # first capture failed, this one's
                values, key, hit = _capture(request, capture_stage, name, True, cache_key is None, records, debug)
                cache_key = cache_key or key
                if hit is not None:
                    return None, 0, [], name, cache_key, hit
                values = run_stages([translate_stage], values, records=records, **debug)
                exported = values["exported"]
                exports += 1
        except UnsupportedOutputError:
            # The module's outputs, not the exporter, are the problem: every exporter would refuse them.
            raise
        except ExportError as e:
            errors.append((name, e))
            continue
        # NOTE: said only once a later exporter succeeded: when every exporter fails, the caller
        # first checks whether eager raises on this input (a bad batch gets eager's exception and
        # no word about exporters), else warns of the fallback with every exporter's error.
        for failed, e in errors:
            logger.warning(
                "the %s exporter failed for %s (%s); the %s exporter is used",
                failed,
                type(request.module).__name__,
                str(e).split(". ")[0][:300],
                name,
            )
        return exported, exports, reasons, name, cache_key, None
    name, first = errors[0]
    if len(errors) == 1:
        raise first
    others = "; ".join(
        f"the {n} exporter also failed: {str(e).removeprefix('[ortwrap:export] ')}" for n, e in errors[1:]
    )
    raise type(first)(f"{str(first).removeprefix('[ortwrap:export] ')} ({others})") from first


def _capture(
    request: BuildRequest,
    capture_stage: Stage,
    exporter: str,
    static_spatial: bool,
    lookup: bool,
    records: list[StageRecord],
    debug: dict,
) -> tuple[dict[str, Any], str | None, build_cache.CacheEntry | None]:
    """Run an exporter's capture stage; with ``lookup``, then the build cache's lookup
    (``cache_lookup``). Returns the stage values, the cache key and the entry that fits, if any."""
    start = {"request": request, "static_spatial": static_spatial, "exporter": exporter}
    values = run_stages([capture_stage], start, records=records, **debug)
    if not lookup:
        return values, None, None
    run_stages([cache_lookup], values, records=records, **debug)
    return values, values["cache_key"], values["cached"]


def build_stages(request: BuildRequest) -> list[Stage]:
    """Every stage after the export, in order: native kernels, type inference, each graph pass
    (``passes.default_passes``), the host split (``aggressive_cpu_fallback``), ATen gradients, the
    gradient build, the session, the program."""
    o = request.options
    with_backward, device = request.with_backward, request.device

    @stage("native_kernels", (), ("native",), group="passes")
    def native_kernels() -> dict:
        """Whether ortwrap's CPU kernels serve this build (compiled on first use in a process)."""
        native = (
            o.native_kernels
            and with_backward
            and device.type == "cpu"
            and kernels.available(o.intra_op_threads or torch.get_num_threads())
        )
        return {"native": native}

    @stage("type_inference", ("exported",), ("ir_model", "pass_records"), group="passes")
    def type_inference(exported: ExportedModel) -> dict:
        """ONNX shape inference, extended through ATen nodes; the model as onnx_ir for the passes."""
        try:
            typed = infer_types(exported.model)
        except Exception as e:
            raise PassError(f"type inference failed: {type(e).__name__}: {e}") from e
        return {"ir_model": ir.serde.deserialize_model(typed), "pass_records": []}

    @stage("gemm_choice", ("ir_model", "exported"), ("gemm_choice",), group="passes")
    def gemm_choice(ir_model: ir.Model, exported: ExportedModel) -> dict:
        """Which library runs the GEMMs: ``gemm`` and ``half_compute`` as given, or for ``"auto"`` the
        faster on this graph's shapes (measured once per machine and cached, ``gemm_choice.py``)."""
        names = list(exported.user_input_names[: len(request.leaves)])
        choice = gemms.choose(
            ir_model, exported.model, names, request.leaves, options=o, device_type=device.type,
            with_backward=with_backward,
        )  # fmt: skip
        return {"gemm_choice": choice}

    @stage("fuse_initializers", ("ir_model", "pass_records", "exported"), ("ir_model", "pass_records", "float_feeds"),
           group="passes", snapshot_if=_modified)  # fmt: skip
    def fuse_initializers(ir_model: ir.Model, pass_records: list[PassRecord], exported: ExportedModel) -> dict:
        """With ``fuse_initializers`` on CPU: frozen half-precision parameters and buffers enter the
        graph as float32, fed from copies made once (``FuseHalfInitializersPass``)."""
        if not (o.fuse_initializers and device.type == "cpu"):
            return {"ir_model": ir_model, "pass_records": pass_records, "float_feeds": frozenset()}
        names = {
            n
            for n, t in exported.state_inputs.items()
            if t.dtype in (torch.bfloat16, torch.float16) and not t.requires_grad
        }
        p = FuseHalfInitializersPass(names)
        result, records = _recorded(p, ir_model, pass_records)
        return {"ir_model": result.model, "pass_records": records, "float_feeds": frozenset(p.converted)}

    stage_names: dict[str, int] = {}

    def pass_stage(p: ir.passes.PassBase) -> Stage:
        # a pass that runs twice (TorchGemmOnCPUPass for bf16, then for float32) names its second stage
        # "<name>_2": stage names key BuildArtifacts.stage_seconds and the debug snapshots
        name = type(p).__name__
        stage_names[name] = stage_names.get(name, 0) + 1
        if stage_names[name] > 1:
            name = f"{name}_{stage_names[name]}"

        def run(ir_model: ir.Model, pass_records: list[PassRecord]) -> dict:
            try:
                result, records = _recorded(p, ir_model, pass_records)
            except PassError as e:
                named = _with_module_classes(e.detail, request.module)
                if named == e.detail:
                    raise
                raise PassError(named) from e
            return {"ir_model": result.model, "pass_records": records}

        return Stage(name, ("ir_model", "pass_records"), ("ir_model", "pass_records"), run, "passes", _modified)

    @stage("host_split", ("ir_model", "pass_records", "exported"), ("ir_model", "pass_records", "host_split"), "passes")
    def host_split(ir_model: ir.Model, pass_records: list[PassRecord], exported: ExportedModel) -> dict:
        """With ``aggressive_cpu_fallback``: shape computations move to a host-side program (last:
        it splits the final forward graph)."""
        if not o.aggressive_cpu_fallback:
            return {"ir_model": ir_model, "pass_records": pass_records, "host_split": None}
        p = HostShapeSplitPass({n for n in exported.user_input_names if n is not None})
        result, records = _recorded(p, ir_model, pass_records)
        return {"ir_model": result.model, "pass_records": records, "host_split": result.split}

    @stage("serialize", ("ir_model",), ("pre_grad",), group="passes")
    def serialize(ir_model: ir.Model) -> dict:
        return {"pre_grad": ir.serde.serialize_model(ir_model)}

    @stage("aten_gradients", ("pre_grad",), ("pre_grad",), group="gradient_build")
    def aten_gradients(pre_grad: onnx.ModelProto) -> dict:
        """ATen nodes: install the executor, declare their output types, register their gradients."""
        if any(n.domain == ATEN_DOMAIN for n in pre_grad.graph.node):
            aten.install()
            aten.declare_output_types(pre_grad)
            aten.mark_bool_inputs(pre_grad)
            if with_backward:
                try:
                    aten.register_gradients(pre_grad)
                except Exception as e:
                    raise GradientBuildError(f"registering the gradients of ATen nodes failed: {e}") from e
        return {"pre_grad": pre_grad}

    @stage("gradient_build", ("pre_grad", "exported", "host_split", "float_feeds"), ("graph", "feeds"),
           group="gradient_build")  # fmt: skip
    def gradient_build(
        pre_grad: onnx.ModelProto, exported: ExportedModel, host_split: HostShapeSplit | None, float_feeds: frozenset
    ) -> dict:
        feeds = _final_feeds(exported, pre_grad, host_split)
        trainable = [
            n
            for n, t in feeds.state_inputs.items()
            if isinstance(t, nn.Parameter) and t.requires_grad and not n.endswith(STOP_GRADIENT_SUFFIX)
        ]
        require_grad = [
            name
            for name, t in zip(feeds.user_input_names, request.leaves)
            if name is not None and t.requires_grad and (t.is_floating_point() or t.is_complex())
        ]
        graph = build_graph(
            pre_grad,
            state_names=list(feeds.state_inputs),
            trainable_names=trainable if with_backward else [],
            input_names_require_grad=require_grad if with_backward else [],
            build_gradient=with_backward,
            log_level=logger.getEffectiveLevel(),  # (ORT's C++ log only at DEBUG)
            propagate_casts=device.type != "cpu",
        )
        if float_feeds:
            graph = dataclasses.replace(graph, float_feeds=frozenset(float_feeds))
        return {"graph": graph, "feeds": feeds}

    @stage("recompute", ("graph", "feeds"), ("graph", "recompute"), group="gradient_build")
    def recompute(graph: TrainingGraph, feeds: ExportedModel) -> dict:
        """With ``recompute`` (``"cheap"`` by default): the backward recomputes activations (grad/recompute.py)."""
        if not with_backward or o.recompute == "none":
            return {"graph": graph, "recompute": None}
        model = graph.model()
        try:
            report = recompute_segments(model, {n for n in feeds.user_input_names if n is not None}, o.recompute)
        except Exception as e:
            if o.recompute == "cheap":
                # NOTE: the default's rewrite only saves memory: when it fails the builder's graph
                # (every activation stashed) runs, and the log says so; 'layers' was asked for.
                logger.warning(
                    "recompute='cheap' could not rewrite the training graph (%s); its backward keeps every "
                    "activation it reads (recompute='none')",
                    e,
                )
                return {"graph": graph, "recompute": None}
            raise GradientBuildError(f"recompute={o.recompute!r} could not rewrite the training graph: {e}") from e
        logger.debug("%s", report.summary())
        return {"graph": dataclasses.replace(graph, model_bytes=model.SerializeToString()), "recompute": report}

    @stage("integration_rewrites", ("graph",), ("graph",), group="gradient_build")
    def integration_rewrites(graph: TrainingGraph) -> dict:
        """The integrations' rewrites of the built graph (``integrations.Integration.rewrite_graph``)."""
        try:
            return {"graph": integrations.rewrite_graph(graph)}
        except UnsupportedInputError:
            raise
        except Exception as e:
            raise GradientBuildError(f"rewriting the built graph failed: {type(e).__name__}: {e}") from e

    @stage("session", ("graph",), ("runner",), group="session")
    def session(graph: TrainingGraph) -> dict:
        return {"runner": (TrainingRunner if with_backward else InferenceRunner)(graph, device, o)}

    @stage("program", ("feeds", "graph", "runner", "host_split"), ("program",), group="session")
    def program(feeds: ExportedModel, graph: TrainingGraph, runner: Any, host_split: HostShapeSplit | None) -> dict:
        prog = Program(feeds, graph, runner, request.module)
        if host_split is not None and host_split.feeds:
            host_index = {n: i for i, n in enumerate(feeds.user_input_names[: len(request.leaves)]) if n is not None}
            prog.host_shapes_runner = HostShapeRunner(host_split, host_index)
        return {"program": prog}

    passes = default_passes(
        with_backward=with_backward,
        device_type=device.type,
        native_kernels=True,
        fusions=o.fusions,
        # every pass a route may need; gemm_choice's decision gates them (``_route_gate``)
        native_bf16=o.half_compute != "float32",
        torch_gemm=o.gemm != "ort",
    )
    return [
        native_kernels,
        type_inference,
        gemm_choice,
        fuse_initializers,
        *[_route_gate(p, pass_stage(p)) for p in passes],
        host_split,
        serialize,
        aten_gradients,
        gradient_build,
        recompute,
        integration_rewrites,
        session,
        program,
    ]


def _with_module_classes(text: str, module: nn.Module) -> str:
    """``text`` with the class of each submodule it names (``module `bag```, as the TorchScript
    exporter's node names give them) added: ``module `bag` (EmbeddingBag)``."""

    def named(m: re.Match) -> str:
        try:
            sub = module.get_submodule(m.group(1))
        except AttributeError:
            return m.group(0)
        return f"{m.group(0)} ({type(sub).__name__})"

    return re.sub(r"module `([\w.]+)`(?! \()", named, text)


def _recorded(p: ir.passes.PassBase, ir_model: ir.Model, pass_records: list[PassRecord]) -> tuple[Any, list]:
    """Run pass ``p``; its result and ``pass_records`` with its record (name, modified, seconds) added."""
    start = time.perf_counter()
    result = run_pass(p, ir_model)
    return result, [*pass_records, PassRecord(type(p).__name__, result.modified, time.perf_counter() - start)]


def _native_gate(st: Stage) -> Stage:
    """The CPU-kernel passes run only where the ``native_kernels`` stage found the kernels usable."""

    def run(ir_model: ir.Model, pass_records: list[PassRecord], native: bool) -> dict:
        if not native:
            return {"ir_model": ir_model, "pass_records": pass_records}
        return st.run(ir_model=ir_model, pass_records=pass_records)

    return Stage(st.name, (*st.requires, "native"), st.provides, run, st.group, st.snapshot_if)


def _route_gate(p: ir.passes.PassBase, st: Stage) -> Stage:
    """A pass of one GEMM route runs only where ``gemm_choice`` chose that route (the float32 torch
    GEMM rewrite: ``torch_gemm``; the bf16 GEMM rewrite, the bf16 values and attention between them:
    ``native_bf16``); the CPU-kernel passes only where ortwrap's kernels are usable (``_native_gate``)."""
    if isinstance(p, (NativeCPUKernelsPass, NativeAttentionPass)):
        st = _native_gate(st)
    if isinstance(p, TorchGemmOnCPUPass):
        route = "torch_gemm" if p.dtype == ir.DataType.FLOAT else "native_bf16"
    elif isinstance(p, (HalfValuesOnCPUPass, NativeAttentionPass)):
        route = "native_bf16"
    else:
        return st

    def run(gemm_choice: gemms.GemmChoice, **values) -> dict:
        if not getattr(gemm_choice, route):
            return {"ir_model": values["ir_model"], "pass_records": values["pass_records"]}
        return st.run(**values)

    return Stage(st.name, (*st.requires, "gemm_choice"), st.provides, run, st.group, st.snapshot_if)


def _modified(out: dict) -> bool:
    """Snapshot a pass's result only when it changed the model."""
    records = out["pass_records"]
    return bool(records) and records[-1].modified


def _final_feeds(
    exported: ExportedModel, pre_grad: onnx.ModelProto, host_split: HostShapeSplit | None
) -> ExportedModel:
    """The export as the built graph is fed: the rewritten model, the host-fed inputs after the
    user's tensors, the buffer outputs the passes kept, the stop-gradient duplicates' tensors."""
    remaining = {o.name for o in pre_grad.graph.output}
    feeds = dataclasses.replace(
        exported,
        model=pre_grad,
        user_input_names=[*exported.user_input_names, *(f.name for f in (host_split.feeds if host_split else []))],
        state_inputs=dict(exported.state_inputs),
        state_names=dict(exported.state_names),
        buffer_outputs={k: v for k, v in exported.buffer_outputs.items() if k in remaining},
    )
    _add_stop_gradient_inputs(feeds)
    return feeds


# ------------------------------------------------------------------------------------ the build cache


def _schema(request: BuildRequest) -> tuple:
    return (
        request.in_spec,
        tuple((t.dim(), str(t.dtype), str(t.device), t.requires_grad) for t in request.leaves),
        request.training,
        request.with_backward,
        str(request.device),
        repr(request.autocast),
        gemms.schema_key(request.options),  # "auto": chosen by a measurement on this machine
    )


def _static_shape(leaves: list[torch.Tensor]) -> tuple:
    return tuple(tuple(t.shape[1:]) for t in leaves)


def _entry_fits(entry: build_cache.CacheEntry, leaves: list[torch.Tensor]) -> bool:
    if entry.static_spatial and entry.static_shape != _static_shape(leaves):
        return False
    return entry.shape_guards is None or entry.shape_guards.check(leaves)


@stage("cache_lookup", ("request", "capture", "exporter"), ("cached", "cache_key"), group="export")
def cache_lookup(request: BuildRequest, capture: Any, exporter: str) -> dict:
    """The build cache's entry for this capture, schema and options that fits these inputs, if any
    (the key is made from the capture: ``cache.py``)."""
    o = request.options
    if not o.build_cache:
        return {"cached": None, "cache_key": None}
    native = o.native_kernels and request.with_backward and request.device.type == "cpu"
    try:
        key = build_cache.build_key(request.module, _schema(request), o, native, exporter=exporter, capture=capture)
    except build_cache.Uncacheable as e:
        logger.info("build cache: %s cannot be cached: %s", type(request.module).__name__, e)
        return {"cached": None, "cache_key": None}
    except Exception as e:  # the cache never fails a build: a capture the key does not know is a miss
        logger.warning(
            "build cache: no key for %s's capture (%s: %s); it is built without the cache",
            type(request.module).__name__,
            type(e).__name__,
            e,
        )
        return {"cached": None, "cache_key": None}
    entries = build_cache.load(build_cache_dir(), key) or []
    entry = next((e for e in entries if _entry_fits(e, request.leaves)), None)
    return {"cached": entry, "cache_key": key}


@stage("cache_store", ("request", "cache_key", "feeds", "graph", "host_split", "exported_proto", "pre_grad",
                       "pass_records", "exporter", "exports", "static_reasons"), (), group="session")  # fmt: skip
def cache_store(
    request, cache_key, feeds, graph, host_split, exported_proto, pre_grad, pass_records, exporter, exports,
    static_reasons,
):
    """Add this build to the cache (not graphs with PythonOps or a host shape program); with the
    reasons its dims are static (the export's and the exporter loop's, e.g. a size probe's)."""
    if feeds.functions or host_split is not None:
        return {}
    by_id = {id(b): n for n, b in request.module.named_buffers(remove_duplicate=False)}
    try:
        buffers = {g: by_id[id(b)] for g, b in feeds.buffer_outputs.items()}
    except KeyError:
        return {}
    out_spec, dropped = build_cache.portable_out_spec(feeds.out_spec)
    entry = build_cache.CacheEntry(
        model_bytes=graph.model_bytes,
        graph=graph,
        exported=exported_proto.SerializeToString(),
        pre_grad=pre_grad.SerializeToString(),
        user_input_names=list(feeds.user_input_names),
        output_names=list(feeds.output_names),
        out_spec=out_spec,
        state_names=dict(feeds.state_names),
        buffer_outputs=buffers,
        static_reasons=list(static_reasons),
        static_spatial=feeds.static_spatial,
        shape_guards=feeds.shape_guards,
        exporter=exporter,
        exports=exports,
        pass_names=[r.name for r in pass_records if r.modified],
        static_shape=_static_shape(request.leaves) if feeds.static_spatial else None,
        dropped_outputs=dropped,
    )
    directory = build_cache_dir()
    entries = [e for e in (build_cache.load(directory, cache_key, warn=False) or []) if not _same_fit(e, entry)]
    build_cache.store(directory, cache_key, [*entries, entry])
    return {}


def _same_fit(a: build_cache.CacheEntry, b: build_cache.CacheEntry) -> bool:
    return (
        a.static_spatial == b.static_spatial and a.static_shape == b.static_shape and a.shape_guards == b.shape_guards
    )


def _from_cache(
    request: BuildRequest, entry: build_cache.CacheEntry, records: list[StageRecord], debug: dict, t0: float
):
    """A program from a cache entry: a session over the stored graph, mapped to this module."""

    @stage("cache_load", ("request", "cached"), ("feeds", "graph"), group="export")
    def cache_load(request: BuildRequest, cached: build_cache.CacheEntry) -> dict:
        named = dict(request.module.named_parameters(remove_duplicate=False))
        named.update(request.module.named_buffers(remove_duplicate=False))
        feeds = ExportedModel(
            model=onnx.load_model_from_string(cached.pre_grad),
            user_input_names=list(cached.user_input_names),
            state_inputs={g: named[n] for g, n in cached.state_names.items()},
            output_names=list(cached.output_names),
            out_spec=cached.out_spec,
            buffer_outputs={g: named[n] for g, n in cached.buffer_outputs.items()},
            state_names=dict(cached.state_names),
            static_reasons=list(cached.static_reasons),
            static_spatial=cached.static_spatial,
            shape_guards=cached.shape_guards,
        )
        if any(n.domain == ATEN_DOMAIN for n in feeds.model.graph.node):
            aten.install()
            if any(
                n.op_type == "ATen" and _operator(n).startswith(aten.NATIVE_PREFIX) for n in cached_graph_nodes(cached)
            ):
                kernels.available(request.options.intra_op_threads or torch.get_num_threads())
        return {"feeds": feeds, "graph": cached.graph}

    if entry.dropped_outputs:
        logger.warning(
            "forward() output %s, the object the export built, could not be kept in the build cache: "
            "this process returns None for it (return tensors in tuples, dicts or dataclasses)",
            ", ".join(entry.dropped_outputs),
        )
    stages = [cache_load, *[s for s in build_stages(request) if s.name in ("session", "program")]]
    values = run_stages(stages, {"request": request, "cached": entry, "host_split": None}, records=records, **debug)
    seconds: dict[str, float] = {"export": 0.0, "passes": 0.0, "gradient_build": 0.0, "session": 0.0}
    for r in records:
        seconds[r.group] = seconds.get(r.group, 0.0) + r.seconds
    artifacts = BuildArtifacts(
        onnx.load_model_from_string(entry.exported),
        values["feeds"].model,
        entry.graph,
        [PassRecord(n, True, 0.0) for n in entry.pass_names],
        seconds,
        request.training,
        request.with_backward,
        0,
        sorted(entry.static_reasons) if entry.static_spatial else [],
        None,
        entry.exporter,
        {r.name: r.seconds for r in records},
        records,
        cached=True,
    )
    return values["program"], artifacts


def _operator(node: onnx.NodeProto) -> str:
    return next((a.s.decode() for a in node.attribute if a.name == "operator"), "")


def cached_graph_nodes(entry: build_cache.CacheEntry) -> list[onnx.NodeProto]:
    """The nodes of a cached built graph."""
    return list(onnx.load_model_from_string(entry.model_bytes).graph.node)


#: Allocations between two young-generation collections during a build (Python's default is 700).
_BUILD_GC_YOUNG_THRESHOLD = 20_000


@contextlib.contextmanager
def _build_gc() -> Iterator[None]:
    """During a build, the cyclic garbage collector looks only at objects the build created, and
    less often.

    NOTE: a build allocates enough (the exporter's imports, fake tensors, ONNX IR) to trigger full
    collections, and each one walks every object of the process: torch's and the user's, millions
    of them, ~0.15 CPU s each. A process's first dynamo build ran three to four of them and ~450
    young ones: 0.45 CPU s of the benchmark LM's 2.4 (docs/performance.md). ``gc.freeze()`` sets the
    objects that existed before the build aside for its duration, and ``gc.unfreeze()`` hands them
    back to the oldest generation afterwards: nothing is collected that would not have been, only
    later (cycles among the older objects wait for the first full collection after the build).
    Young collections run every ``_BUILD_GC_YOUNG_THRESHOLD`` allocations instead of 700 (0.1 CPU s
    less): the build's short-lived cycles are mostly fx nodes, fake tensors and IR values, which
    hold no tensor data.
    Thresholds are restored afterwards. Left alone when the collector is off or something else
    froze objects (``gc.get_freeze_count()``: the user's own ``gc.freeze()``, or a build within a
    build), whose ``unfreeze`` is not ours to call. (A ``gc.freeze()`` that another thread makes
    during a build is undone with the build's: the collector has one permanent generation.)
    """
    thresholds = gc.get_threshold()
    if gc.get_freeze_count() or not gc.isenabled() or thresholds[0] <= 0:
        yield
        return
    gc.freeze()
    gc.set_threshold(max(thresholds[0], _BUILD_GC_YOUNG_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


@_build_gc()
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
    build_index: int = 0,
    autocast: tuple | None = None,
) -> tuple[Program, BuildArtifacts]:
    """Export, rewrite, build and load ``module`` for one input schema: :func:`export_stages` (with
    the exporter fallback and static re-export of :func:`_export`), then :func:`build_stages`; with
    the garbage collector set aside as :func:`_build_gc` says.

    Raises:
        ExportError, PassError, GradientBuildError, SessionError: from the stage that failed.
    """
    request = BuildRequest(module, leaves, in_spec, input_paths, training, with_backward, device, options, autocast)
    records: list[StageRecord] = []
    debug = {
        "what": request.describe(),
        "debug_dir": options.debug_dir,
        "snapshot_prefix": f"build{build_index:02d}_{request.kind}",
    }
    t0 = time.perf_counter()
    # (torch's and the exporters' logs are muted, except at ortwrap's DEBUG verbosity)
    with BuildProgress(request.describe()) as reporter, compat.quiet_capture_logs(not ort_log_wanted()):
        program, artifacts = _compile(request, records, {**debug, "progress": reporter}, t0)
    # (after the progress reporter stopped: the summary is the build's last line)
    if artifacts.cached:
        logger.info("loaded %s from the build cache in %.2fs", request.describe(), time.perf_counter() - t0)
    elif logger.isEnabledFor(logging.INFO):
        logger.info(
            "built %s in %.2fs (%s)",
            request.describe(),
            time.perf_counter() - t0,
            ", ".join(f"{k} {v:.2f}s" for k, v in artifacts.stage_seconds.items() if v >= 0.01),
        )
    return program, artifacts


def _compile(
    request: BuildRequest, records: list[StageRecord], debug: dict, t0: float
) -> tuple[Program, BuildArtifacts]:
    """:func:`compile_program`'s build, its progress reported by ``debug["progress"]``."""
    training, with_backward = request.training, request.with_backward
    exported, exports, reasons, exporter, cache_key, cached = _export(request, records, debug)
    if cached is not None:
        return _from_cache(request, cached, records, debug, t0)
    assert exported is not None
    exported_proto = onnx.ModelProto()
    exported_proto.CopyFrom(exported.model)
    values = run_stages(build_stages(request), {"request": request, "exported": exported}, records=records, **debug)
    program = values["program"]
    if cache_key is not None:
        run_stages(
            [cache_store],
            {
                **values,
                "cache_key": cache_key,
                "exported_proto": exported_proto,
                "exporter": exporter,
                "exports": exports,
                "static_reasons": sorted(set(reasons + exported.static_reasons)),
            },
            records=records,
            **debug,
        )
    seconds: dict[str, float] = {"export": 0.0, "passes": 0.0, "gradient_build": 0.0, "session": 0.0}
    stage_seconds: dict[str, float] = {}
    for r in records:
        seconds[r.group] = seconds.get(r.group, 0.0) + r.seconds
        stage_seconds[r.name] = stage_seconds.get(r.name, 0.0) + r.seconds
    host_split = values["host_split"]
    artifacts = BuildArtifacts(
        exported_proto,
        values["pre_grad"],
        values["graph"],
        values["pass_records"],
        seconds,
        training,
        with_backward,
        exports,
        sorted(set(reasons + exported.static_reasons)) if exported.static_spatial else [],
        host_split,
        exporter,
        stage_seconds,
        records,
        recompute=values["recompute"],
        gemm_choice=values["gemm_choice"],
    )
    return program, artifacts
