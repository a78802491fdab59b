"""The one stage plan of a build: the export stages of each exporter (:func:`export_stages`:
capture, translate) and every stage after them (:func:`build_stages`: native kernels, type
inference, GEMM choice, each pass of ``passes/pipeline.py``'s list, serialization, ATen gradients,
the gradient build, recompute, the integrations' rewrites, the session, the program).

Each stage declares the values it requires and provides (``build/pipeline.py``). A pass's stage
runs where the build values its entry ``requires`` are true, and gives the build the values its
entry ``provides``, read from the pass's typed result.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import onnx
import onnx_ir as ir
import torch
from torch import nn

from .. import gemm_choice as gemms
from .. import integrations, kernels
from .._logging import logger
from ..bridge import aten
from ..bridge.aten import ATEN_DOMAIN
from ..errors import GradientBuildError, PassError, UnsupportedInputError
from ..export import ExportedModel
from ..export.dynamo import capture_dynamo, translate_dynamo
from ..export.torchscript import capture_torchscript, translate_torchscript
from ..export.type_inference import infer_types
from ..grad import TrainingGraph, build_graph
from ..grad import aten as grad_aten
from ..grad.recompute import recompute_segments
from ..passes import PassRecord, PlannedPass, planned_passes, run_pass
from ..passes.host_shapes import HostShapeSplit
from ..passes.stop_gradient import STOP_GRADIENT_SUFFIX
from ..runtime import InferenceRunner, TrainingRunner
from ..runtime.host_shapes import HostShapeRunner
from ..runtime.program import Program
from .pipeline import Stage, stage
from .request import BuildRequest

__all__ = ["build_stages", "export_stages"]


#: exporter name -> its (capture, translate) functions, the two export stages of each exporter
#: (the values ``Options.exporter`` accepts: ``options.EXPORTER_CHOICES``).
_CAPTURE_AND_TRANSLATE = {
    "torchscript": (capture_torchscript, translate_torchscript),
    "dynamo": (capture_dynamo, translate_dynamo),
}


def export_stages(exporter: str) -> list[Stage]:
    """The export stages of ``exporter``: capture the module, translate the capture to ONNX."""
    capture_fn, translate_fn = _CAPTURE_AND_TRANSLATE[exporter]

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


def build_stages(request: BuildRequest) -> list[Stage]:
    """Every stage after the export, in order: native kernels, type inference, the GEMM choice,
    each entry of ``passes.planned_passes`` (fuse_initializers, the graph passes, the host split),
    serialization, ATen gradients, the gradient build, recompute, the integrations' rewrites, the
    session, the program."""
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
        # the example inputs' sizes of the graph inputs' symbolic dims (stand-ins where an op needs them)
        shapes = {name: t.shape for name, t in zip(exported.user_input_names, request.leaves) if name is not None}
        sizes = {
            d.dim_param: shapes[v.name][i]
            for v in exported.model.graph.input
            if v.name in shapes and len(v.type.tensor_type.shape.dim) == len(shapes[v.name])
            for i, d in enumerate(v.type.tensor_type.shape.dim)
            if d.dim_param
        }
        try:
            typed = infer_types(exported.model, sizes=sizes)
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

    stage_names: dict[str, int] = {}

    def pass_stage(entry: PlannedPass) -> Stage:
        """The build stage of one entry of the pass list (``passes/pipeline.py``): it runs where
        the build values its entry requires are true (``GATES``), and gives the build the side
        results its entry provides, read from the pass's typed result."""
        # a pass that runs twice (TorchGemmOnCPUPass for bf16, then for float32) names its second stage
        # "<name>_2": stage names key BuildArtifacts.stage_seconds and the debug snapshots
        name = entry.name
        stage_names[name] = stage_names.get(name, 0) + 1
        if stage_names[name] > 1:
            name = f"{name}_{stage_names[name]}"
        gates, inputs = entry.gates, entry.inputs
        provided = tuple(value for value, _, _ in entry.provides)
        requires = ("ir_model", "pass_records", *inputs)
        if "native" in gates:
            requires += ("native",)
        if any(g != "native" for g in gates):
            requires += ("gemm_choice",)

        def run(ir_model: ir.Model, pass_records: list[PassRecord], **values: Any) -> dict:
            p = entry.instance(**{k: values[k] for k in inputs})
            if p is None or not all(_gate_open(g, values) for g in gates):
                return {"ir_model": ir_model, "pass_records": pass_records, **{v: d for v, _, d in entry.provides}}
            try:
                result, records = _recorded(p, ir_model, pass_records)
            except PassError as e:
                named = _with_module_classes(e.detail, request.module)
                if named == e.detail:
                    raise
                raise PassError(named) from e
            side = {v: getattr(result, f) for v, f, _ in entry.provides}
            return {"ir_model": result.model, "pass_records": records, **side}

        snapshot_if = None if entry.snapshot_always else _modified
        return Stage(name, requires, ("ir_model", "pass_records", *provided), run, "passes", snapshot_if)

    @stage("serialize", ("ir_model",), ("pre_grad",), group="passes")
    def serialize(ir_model: ir.Model) -> dict:
        return {"pre_grad": ir.serde.serialize_model(ir_model)}

    @stage("aten_gradients", ("pre_grad",), ("pre_grad",), group="gradient_build")
    def aten_gradients(pre_grad: onnx.ModelProto) -> dict:
        """ATen nodes: install the executor, declare their output types, register their gradients."""
        if any(n.domain == ATEN_DOMAIN for n in pre_grad.graph.node):
            aten.install()
            grad_aten.declare_output_types(pre_grad)
            grad_aten.mark_bool_inputs(pre_grad)
            if with_backward:
                try:
                    grad_aten.register_gradients(pre_grad)
                except Exception as e:
                    raise GradientBuildError(f"registering the gradients of ATen nodes failed: {e}") from e
        return {"pre_grad": pre_grad}

    @stage("gradient_build", ("pre_grad", "exported", "host_split", "float_feeds"), ("graph", "fed_export"),
           group="gradient_build")  # fmt: skip
    def gradient_build(
        pre_grad: onnx.ModelProto, exported: ExportedModel, host_split: HostShapeSplit | None, float_feeds: frozenset
    ) -> dict:
        fed = _fed_export(exported, pre_grad, host_split)
        trainable = [
            n
            for n, t in fed.state_inputs.items()
            if isinstance(t, nn.Parameter) and t.requires_grad and not n.endswith(STOP_GRADIENT_SUFFIX)
        ]
        require_grad = [
            name
            for name, t in zip(fed.user_input_names, request.leaves)
            if name is not None and t.requires_grad and (t.is_floating_point() or t.is_complex())
        ]
        graph = build_graph(
            pre_grad,
            state_names=list(fed.state_inputs),
            trainable_names=trainable if with_backward else [],
            input_names_require_grad=require_grad if with_backward else [],
            build_gradient=with_backward,
            log_level=logger.getEffectiveLevel(),  # (ORT's C++ log only at DEBUG)
            propagate_casts=device.type != "cpu",
        )
        if float_feeds:
            graph = dataclasses.replace(graph, float_feeds=frozenset(float_feeds))
        return {"graph": graph, "fed_export": fed}

    @stage("recompute", ("graph", "fed_export"), ("graph", "recompute"), group="gradient_build")
    def recompute(graph: TrainingGraph, fed_export: ExportedModel) -> dict:
        """With ``recompute`` (``"cheap"`` by default): the backward recomputes activations (grad/recompute.py)."""
        if not with_backward or o.recompute == "none":
            return {"graph": graph, "recompute": None}
        model = graph.model()
        try:
            report = recompute_segments(model, {n for n in fed_export.user_input_names if n is not None}, o.recompute)
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

    @stage("ort_threads", ("graph", "gemm_choice"), ("graph",), group="gradient_build")
    def ort_threads(graph: TrainingGraph, gemm_choice: gemms.GemmChoice | None) -> dict:
        """ORT's intra-op threads: one for a CPU training graph of small kernels, unless
        ``intra_op_threads`` is given (``gemm_choice.decide_pool``). Kept with the graph in the build
        cache: decided at one thread (slower measured rates) it keeps the pool more often, not less."""
        threads = torch.get_num_threads()
        if not with_backward or device.type != "cpu" or o.intra_op_threads or gemm_choice is None:
            return {"graph": graph}
        matrix_s = gemm_choice.ort_matrix_seconds()
        if matrix_s is None or gemm_choice.largest_elements >= gemms.POOL_BIG_ELEMENTS:
            return {"graph": graph}
        nodes = len(graph.model().graph.node)
        if gemms.decide_pool(matrix_s, nodes, gemm_choice.largest_elements):
            return {"graph": graph}
        logger.debug(
            "ORT runs this graph on 1 intra-op thread, not %d: its GEMMs and convolutions take ~%.1f us a step "
            "for each of its %d nodes (< %.0f us) and its largest value has %d elements",
            threads, matrix_s / nodes * 1e6, nodes, gemms.POOL_MIN_NODE_S * 1e6, gemm_choice.largest_elements,
        )  # fmt: skip
        return {"graph": dataclasses.replace(graph, ort_threads=1)}

    @stage("session", ("graph",), ("runner",), group="session")
    def session(graph: TrainingGraph) -> dict:
        return {"runner": (TrainingRunner if with_backward else InferenceRunner)(graph, device, o)}

    @stage("program", ("fed_export", "graph", "runner", "host_split"), ("program",), group="session")
    def program(
        fed_export: ExportedModel, graph: TrainingGraph, runner: Any, host_split: HostShapeSplit | None
    ) -> dict:
        prog = Program(fed_export, graph, runner, request.module)
        if host_split is not None and host_split.feeds:
            host_index = {
                n: i for i, n in enumerate(fed_export.user_input_names[: len(request.leaves)]) if n is not None
            }
            prog.host_shapes_runner = HostShapeRunner(host_split, host_index)
        return {"program": prog}

    passes = planned_passes(
        with_backward=with_backward,
        device_type=device.type,
        native_kernels=True,
        fusions=o.fusions,
        # every pass a route may need; gemm_choice's decision gates them (their ``requires``)
        native_bf16=o.half_compute != "float32",
        torch_gemm=o.gemm != "ort",
        fuse_initializers=o.fuse_initializers,
        host_split=o.aggressive_cpu_fallback,
    )
    return [
        native_kernels,
        type_inference,
        gemm_choice,
        *[pass_stage(entry) for entry in passes],
        serialize,
        aten_gradients,
        gradient_build,
        recompute,
        integration_rewrites,
        ort_threads,
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


def _gate_open(gate: str, values: dict[str, Any]) -> bool:
    """Whether the build value a pass requires (``passes.pipeline.GATES``) is true: ``native`` is the
    native_kernels stage's answer; a GEMM route, whether ``gemm_choice`` chose it."""
    if gate == "native":
        return values["native"]
    return getattr(values["gemm_choice"], gate)


def _modified(out: dict) -> bool:
    """Snapshot a pass's result only when it changed the model."""
    records = out["pass_records"]
    return bool(records) and records[-1].modified


def _fed_export(exported: ExportedModel, pre_grad: onnx.ModelProto, host_split: HostShapeSplit | None) -> ExportedModel:
    """The export as the built graph is fed: the rewritten model, the host-fed inputs after the
    user's tensors, the buffer outputs the passes kept, the stop-gradient duplicates' tensors."""
    remaining = {o.name for o in pre_grad.graph.output}
    fed = dataclasses.replace(
        exported,
        model=pre_grad,
        user_input_names=[*exported.user_input_names, *(f.name for f in (host_split.feeds if host_split else []))],
        state_inputs=dict(exported.state_inputs),
        state_names=dict(exported.state_names),
        buffer_outputs={k: v for k, v in exported.buffer_outputs.items() if k in remaining},
    )
    _add_stop_gradient_inputs(fed)
    return fed


def _add_stop_gradient_inputs(exported: ExportedModel) -> None:
    """Frozen duplicate inputs made by the stop-gradient pass are fed the tensor they duplicate."""
    for value in exported.model.graph.input:
        name = value.name
        if name.endswith(STOP_GRADIENT_SUFFIX) and name not in exported.state_inputs:
            base = name[: -len(STOP_GRADIENT_SUFFIX)]
            exported.state_inputs[name] = exported.state_inputs[base]
            exported.state_names[name] = exported.state_names[base]
