"""The pass pipeline: the one ordered list of ortwrap's graph passes, with their conditions.

:func:`planned_passes` is that list. Conditions known before the build (the options, the device,
whether a backward is built) decide whether an entry is in it; conditions the build finds out (are
ortwrap's CPU kernels usable, which GEMM route did ``gemm_choice`` pick) are each entry's
``requires`` (:data:`GATES`), checked by the build stage that runs it (``build/stages.py``). A pass
whose run gives the build a value returns it in a typed result (a :class:`PassResult` subclass),
which its entry's ``provides`` names: nothing reads attributes back from a pass object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import onnx_ir as ir
import torch

from ..errors import PassError
from .aten_types import ATenStringArgumentsPass
from .avgpool_to_conv import AveragePoolToConvPass
from .batchnorm_running_stats import BatchNormRunningStatsPass
from .bidirectional_rnn import BidirectionalRNNPass
from .control_flow import RefuseControlFlowPass
from .conv_pads import ExplicitConvPadsPass
from .conv_transpose_matmul import ConvTransposeToMatMulPass
from .double_precision import DoublePrecisionOnCPUPass
from .einsum import EinsumToMatMulPass
from .eval_batchnorm import DecomposeEvalBatchNormPass
from .fusions import StandardOpFusionPass
from .gather_to_gathernd import GatherToGatherNDPass
from .gelu_unfuse import UnfuseErfGeluPass
from .grouped_conv import GroupedConvGradPass
from .half_matmul import TorchGemmOnCPUPass
from .half_precision import FuseHalfInitializersPass, HalfPrecisionOnCPUPass
from .half_values import HalfValuesOnCPUPass
from .host_shapes import HostShapeSplitPass
from .instance_norm import DecomposeInstanceNormPass
from .linear_to_gemm import LinearToGemmPass
from .log_sigmoid import LogSigmoidPass
from .native_attention import NativeAttentionPass
from .native_cpu_kernels import NativeCPUKernelsPass
from .nll_loss import DecomposeNLLLossPass
from .optional_outputs import RestoreOptionalOutputsPass
from .prune_buffer_outputs import PruneUnchangedBufferOutputsPass
from .pythonop_context import AddPythonOpContextPass
from .repeated_inputs import RepeatedGraphInputsPass
from .resize_to_matmul import ResizeToMatMulPass
from .scalar_gradients import ScalarGradientShapesPass
from .sequence_ops import RefuseSequenceOpsPass
from .shapes_for_gradients import ShapesForGradientsPass
from .stop_gradient import ResolveStopGradientPass
from .torch_conv import TorchConvOnCPUPass
from .torch_gradients import TorchGradientsPass
from .unbatched_loss import UnbatchedLossPass
from .vector_matmul import VectorMatMulPass
from .where_broadcast import WhereBroadcastPass


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: its name, whether it modified the model, and how long it took."""

    name: str
    modified: bool
    seconds: float


#: What a pass may require of the build, besides the model: it runs only where the value is true.
GATES: dict[str, str] = {
    "native": "ortwrap's CPU kernels are usable (the build's native_kernels stage; ortwrap.kernels)",
    "torch_gemm": "gemm_choice chose PyTorch's float32 GEMMs (Options.gemm)",
    "native_bf16": "gemm_choice chose PyTorch's bf16 GEMMs (Options.half_compute)",
}


@dataclass(frozen=True)
class PlannedPass:
    """One entry of the pass list.

    Attributes:
        make: the pass, or a function that makes it from the build values named in ``requires``
            that are not :data:`GATES` (e.g. ``exported``, the export); None: the entry's condition
            is off (its stage keeps its place, changes nothing and provides the defaults).
        requires: the build values the pass needs: each :data:`GATES` name must be true for it to
            run; the others are ``make``'s arguments.
        provides: ``(build value, field of the pass's result, the value where the pass does not
            run)`` for each side result the build reads (the result a ``PassResult`` subclass, ``passes/result.py``).
        stage: the build stage's name (default: the pass class's name).
        snapshot_always: with ``debug_dir``, snapshot the model after this stage even when the pass
            changed nothing (or did not run).
    """

    make: ir.passes.PassBase | Callable[..., ir.passes.PassBase] | None
    requires: tuple[str, ...] = ()
    provides: tuple[tuple[str, str, Any], ...] = ()
    stage: str | None = None
    snapshot_always: bool = False

    @property
    def gates(self) -> tuple[str, ...]:
        return tuple(r for r in self.requires if r in GATES)

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(r for r in self.requires if r not in GATES)

    @property
    def name(self) -> str:
        if self.stage is not None:
            return self.stage
        return type(self.make).__name__

    def instance(self, **inputs: Any) -> ir.passes.PassBase | None:
        """The pass (made from ``inputs`` when ``make`` is a function), or None (off)."""
        if self.make is None or isinstance(self.make, ir.passes.PassBase):
            return self.make
        return self.make(**inputs)


def _fuse_initializers(exported: Any) -> ir.passes.PassBase:
    """Frozen half-precision parameters and buffers enter the graph as float32 (fed from copies)."""
    names = {
        n
        for n, t in exported.state_inputs.items()
        if t.dtype in (torch.bfloat16, torch.float16) and not t.requires_grad
    }
    return FuseHalfInitializersPass(names)


def _host_shape_split(exported: Any) -> ir.passes.PassBase:
    return HostShapeSplitPass({n for n in exported.user_input_names if n is not None})


def planned_passes(
    *,
    with_backward: bool,
    device_type: str = "cpu",
    native_kernels: bool = False,
    fusions: bool = True,
    native_bf16: bool = False,
    torch_gemm: bool = False,
    fuse_initializers: bool = False,
    host_split: bool = False,
) -> list[PlannedPass]:
    """Every pass a build runs, in order, with what each requires (arguments as :func:`default_passes`'s).

    Args:
        native_bf16, torch_gemm: include each GEMM route's passes (``gemm_choice`` gates them:
            ``requires`` ``native_bf16`` / ``torch_gemm``).
        native_kernels: include the passes onto ortwrap's CPU kernels (gated by ``native``).
        fuse_initializers: ``Options.fuse_initializers`` (CPU only): frozen half-precision state
            enters the graph as float32 (first; provides ``float_feeds``).
        host_split: ``Options.aggressive_cpu_fallback``: shape computations move to a host-side
            program (last: it splits the final forward graph; provides ``host_split``).
    """
    fuse = fuse_initializers and device_type == "cpu"
    return [
        PlannedPass(
            _fuse_initializers if fuse else None,
            requires=("exported",) if fuse else (),
            provides=(("float_feeds", "converted", frozenset()),),
            stage="fuse_initializers",
        ),
        *_graph_passes(
            with_backward=with_backward,
            device_type=device_type,
            native_kernels=native_kernels,
            fusions=fusions,
            native_bf16=native_bf16,
            torch_gemm=torch_gemm,
        ),
        PlannedPass(
            _host_shape_split if host_split else None,
            requires=("exported",) if host_split else (),
            provides=(("host_split", "split", None),),
            stage="host_split",
            snapshot_always=True,
        ),
    ]


def default_passes(
    *,
    with_backward: bool,
    device_type: str = "cpu",
    native_kernels: bool = False,
    fusions: bool = True,
    native_bf16: bool = False,
    torch_gemm: bool = False,
) -> list[ir.passes.PassBase]:
    """The graph passes every export goes through, in order, whatever the build finds (their
    ``requires`` and the passes around them: :func:`planned_passes`).

    Args:
        with_backward: the graph will get a backward; adds the rewrites only gradients need.
        device_type: where the graph runs (``torch.device.type``); some rewrites are for CPU kernels.
        native_kernels: use ortwrap's CPU kernels (``ortwrap.kernels``, loaded by the caller) for the
            ops they cover; CPU training graphs only.
        fusions: fuse GELU / LayerNorm / RMSNorm into single ops (``passes.fusions``).
        native_bf16: on CPU, run bfloat16 MatMul/Gemm as PyTorch's bf16 GEMMs (``passes.half_matmul``;
            ``Options.half_compute``).
        torch_gemm: on CPU, run float32 MatMul/Gemm and attention as PyTorch's (the same pass in
            float32; ``Options.gemm``).
    """
    return [
        e.make() if isinstance(e.make, type) else e.make  # (a pass made from a build value: with none)
        for e in _graph_passes(
            with_backward=with_backward,
            device_type=device_type,
            native_kernels=native_kernels,
            fusions=fusions,
            native_bf16=native_bf16,
            torch_gemm=torch_gemm,
        )
    ]


def _graph_passes(
    *, with_backward: bool, device_type: str, native_kernels: bool, fusions: bool, native_bf16: bool, torch_gemm: bool
) -> list[PlannedPass]:
    P = PlannedPass
    passes: list[PlannedPass] = [
        P(AddPythonOpContextPass()),
        P(ATenStringArgumentsPass()),
        P(ResolveStopGradientPass(with_backward=with_backward)),
        P(BatchNormRunningStatsPass()),
        P(PruneUnchangedBufferOutputsPass()),
        P(RestoreOptionalOutputsPass()),
        P(UnbatchedLossPass()),  # (ORT aborts on an unbatched loss: forward graphs too)
        P(LogSigmoidPass()),  # (Log(Sigmoid(x)) underflows: forward graphs too)
        # Conv(auto_pad=SAME_*): ORT's ConvGrad ignores auto_pad, its CPU Conv refuses it with dilations.
        P(ExplicitConvPadsPass()),
    ]
    if device_type == "cpu" and with_backward:
        # ConvTranspose with kernel == stride as a MatMul ORT differentiates (no CPU ConvTransposeGrad).
        passes.append(P(ConvTransposeToMatMulPass()))
        # Conv nodes where gemm_choice measured PyTorch's convolution faster (before the next passes:
        # a bf16 one stays bf16, as eager autocast's).
        passes.append(P(TorchConvOnCPUPass, requires=("gemm_choice",), stage="TorchConvOnCPUPass"))
    if device_type == "cpu":
        if native_bf16:
            # bf16 GEMMs as PyTorch's (ATen nodes, which the next pass leaves in bf16).
            passes.append(P(TorchGemmOnCPUPass(with_backward=with_backward), requires=("native_bf16",)))
        if torch_gemm:
            # float32 GEMMs and attention as PyTorch's (before the next pass: only the graph's own float32 ones).
            passes.append(
                P(TorchGemmOnCPUPass(with_backward=with_backward, dtype=ir.DataType.FLOAT), requires=("torch_gemm",))
            )
        # ORT's CPU kernels compute in float32: half-precision values become float32 between
        # their boundaries (before the rewrites below, which read dtypes).
        passes.append(P(HalfPrecisionOnCPUPass()))
    # GELU / LayerNorm / RMSNorm into single (standard where the opset has them) ops, before ORT
    # partitions the graph. Not GELU in CPU training graphs: ortwrap's own GELU kernels (and, without
    # them, the unfused form ORT differentiates faster) beat ORT's fused Gelu there.
    if fusions:
        passes.append(
            P(StandardOpFusionPass(training=with_backward, gelu=not (with_backward and device_type == "cpu")))
        )
    if with_backward:
        # Rewrites of ops that ORT 1.19.2 cannot differentiate (or differentiates wrongly).
        passes += [
            P(DecomposeEvalBatchNormPass()),
            P(DecomposeNLLLossPass()),
        ]
        if device_type == "cpu" and native_kernels:
            # float32 InstanceNormalization (nn.GroupNorm) on ortwrap's kernel, before the decomposition below;
            # MaxPool on ortwrap's before TorchGradientsPass takes those ORT would crash on (unknown H/W).
            ops = ("InstanceNormalization", "MaxPool")
            passes.append(P(NativeCPUKernelsPass(ops), requires=("native",), stage="NativeEarly"))
        passes += [
            P(DecomposeInstanceNormPass()),
            P(EinsumToMatMulPass()),
            P(VectorMatMulPass()),  # after EinsumToMatMulPass, which may write vector products
            P(AveragePoolToConvPass()),
            P(ResizeToMatMulPass()),
            P(BidirectionalRNNPass()),
            # Ops ORT cannot differentiate: PyTorch's op and its autograd (ortwrap/registry.py).
            P(TorchGradientsPass(device_type)),
            P(ScalarGradientShapesPass()),
            P(RepeatedGraphInputsPass()),
            P(WhereBroadcastPass()),
            P(RefuseControlFlowPass()),
            P(RefuseSequenceOpsPass()),
        ]
        if device_type == "cpu":
            # ORT 1.19.2's CPU ConvGrad writes past its input gradient for grouped 1-D/3-D convolutions.
            passes.append(P(GroupedConvGradPass()))
            # Forms whose gradients ORT 1.19.2's CPU kernels compute faster (same values).
            passes.append(P(UnfuseErfGeluPass()))
            if native_kernels:
                passes.append(P(NativeCPUKernelsPass(), requires=("native",)))
            passes += [P(GatherToGatherNDPass()), P(LinearToGemmPass())]
    if device_type == "cpu" and native_bf16:
        # bf16 values between the bf16 GEMMs, as eager keeps them (after ortwrap's GELU kernel is in).
        passes.append(P(HalfValuesOnCPUPass(), requires=("native_bf16",)))
        if with_backward and native_kernels:
            # bf16 attention on ortwrap's kernel instead of PyTorch's flash attention (after the pass above).
            passes.append(P(NativeAttentionPass(), requires=("native", "native_bf16")))
    if device_type == "cpu":
        # Last of the rewrites: the float64 ops ORT's CPU provider cannot run or differentiate
        # (of the graph as the rewrites above leave it) run as PyTorch ops.
        passes.append(P(DoublePrecisionOnCPUPass(with_backward)))
    # Constants the rewrites left without consumers (ORT would warn about each when it loads them).
    # Not onnx_ir's RemoveUnusedNodesPass: it also trims the optional outputs the gradient builders need.
    passes.append(P(RemoveUnusedConstantsPass()))
    if with_backward:
        passes.append(P(ShapesForGradientsPass()))  # last: the gradient builder reads these shapes
    return passes


class RemoveUnusedConstantsPass(ir.passes.InPlacePass):
    """Remove ``Constant`` nodes and initializers (not graph inputs) whose value nothing reads."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        outputs = {id(v) for v in graph.outputs}
        unused = [
            n
            for n in graph
            if n.op_type == "Constant"
            and n.domain == ""
            and not n.outputs[0].uses()
            and id(n.outputs[0]) not in outputs
        ]
        for node in unused:
            graph.remove(node, safe=True)
        inputs = {id(v) for v in graph.inputs}
        dead = [
            name
            for name, v in graph.initializers.items()
            if not v.uses() and id(v) not in outputs and id(v) not in inputs
        ]
        for name in dead:
            del graph.initializers[name]
        return ir.passes.PassResult(model, modified=bool(unused or dead))


def run_pass(p: ir.passes.PassBase, model: ir.Model) -> ir.passes.PassResult:
    """Run one pass (a build stage each, see ``build/stages.py``).

    Raises:
        PassError: naming the pass that failed, chained to its error.
    """
    try:
        return p(model)
    except Exception as e:
        raise PassError(f"pass {type(p).__name__} failed: {type(e).__name__}: {e}") from e
