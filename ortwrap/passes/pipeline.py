"""The pass pipeline: a named, ordered list of pass instances run by one function."""

from __future__ import annotations

import time
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from ..bridge.aten import infer_types
from ..errors import PassError
from .aten_types import ATenStringArgumentsPass
from .avgpool_to_conv import AveragePoolToConvPass
from .batchnorm_running_stats import BatchNormRunningStatsPass
from .bidirectional_rnn import BidirectionalRNNPass
from .control_flow import RefuseControlFlowPass
from .conv_pads import ExplicitConvPadsPass
from .double_precision import DoublePrecisionOnCPUPass
from .einsum import EinsumToMatMulPass
from .eval_batchnorm import DecomposeEvalBatchNormPass
from .fusions import StandardOpFusionPass
from .gather_to_gathernd import GatherToGatherNDPass
from .gelu_unfuse import UnfuseErfGeluPass
from .grouped_conv import GroupedConvGradPass
from .half_matmul import TorchGemmOnCPUPass
from .half_precision import HalfPrecisionOnCPUPass
from .half_values import HalfValuesOnCPUPass
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


def default_passes(
    *,
    with_backward: bool,
    device_type: str = "cpu",
    native_kernels: bool = False,
    fusions: bool = True,
    native_bf16: bool = False,
    torch_gemm: bool = False,
) -> list[ir.passes.PassBase]:
    """The passes every export goes through, in order.

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
    passes: list[ir.passes.PassBase] = [
        AddPythonOpContextPass(),
        ATenStringArgumentsPass(),
        ResolveStopGradientPass(with_backward=with_backward),
        BatchNormRunningStatsPass(),
        PruneUnchangedBufferOutputsPass(),
        RestoreOptionalOutputsPass(),
        UnbatchedLossPass(),  # (ORT aborts on an unbatched loss: forward graphs too)
        LogSigmoidPass(),  # (Log(Sigmoid(x)) underflows: forward graphs too)
        # Conv(auto_pad=SAME_*): ORT's ConvGrad ignores auto_pad, its CPU Conv refuses it with dilations.
        ExplicitConvPadsPass(),
    ]
    if device_type == "cpu":
        if native_bf16:
            # bf16 GEMMs as PyTorch's (ATen nodes, which the next pass leaves in bf16).
            passes.append(TorchGemmOnCPUPass(with_backward=with_backward))
        if torch_gemm:
            # float32 GEMMs and attention as PyTorch's (before the next pass: only the graph's own float32 ones).
            passes.append(TorchGemmOnCPUPass(with_backward=with_backward, dtype=ir.DataType.FLOAT))
        # ORT's CPU kernels compute in float32: half-precision values become float32 between
        # their boundaries (before the rewrites below, which read dtypes).
        passes.append(HalfPrecisionOnCPUPass())
    # GELU / LayerNorm / RMSNorm into single (standard where the opset has them) ops, before ORT
    # partitions the graph. Not GELU in CPU training graphs: ortwrap's own GELU kernels (and, without
    # them, the unfused form ORT differentiates faster) beat ORT's fused Gelu there.
    if fusions:
        passes.append(StandardOpFusionPass(training=with_backward, gelu=not (with_backward and device_type == "cpu")))
    if with_backward:
        # Rewrites of ops that ORT 1.19.2 cannot differentiate (or differentiates wrongly).
        passes += [
            DecomposeEvalBatchNormPass(),
            DecomposeNLLLossPass(),
            DecomposeInstanceNormPass(),
            EinsumToMatMulPass(),
            VectorMatMulPass(),  # after EinsumToMatMulPass, which may write vector products
            AveragePoolToConvPass(),
            ResizeToMatMulPass(),
            BidirectionalRNNPass(),
            # Ops ORT cannot differentiate: PyTorch's op and its autograd (ortwrap/registry.py).
            TorchGradientsPass(device_type),
            ScalarGradientShapesPass(),
            RepeatedGraphInputsPass(),
            WhereBroadcastPass(),
            RefuseControlFlowPass(),
            RefuseSequenceOpsPass(),
        ]
        if device_type == "cpu":
            # ORT 1.19.2's CPU ConvGrad writes past its input gradient for grouped 1-D/3-D convolutions.
            passes.append(GroupedConvGradPass())
            # Forms whose gradients ORT 1.19.2's CPU kernels compute faster (same values).
            passes.append(UnfuseErfGeluPass())
            if native_kernels:
                passes.append(NativeCPUKernelsPass())
            passes += [GatherToGatherNDPass(), LinearToGemmPass()]
    if device_type == "cpu" and native_bf16:
        # bf16 values between the bf16 GEMMs, as eager keeps them (after ortwrap's GELU kernel is in).
        passes.append(HalfValuesOnCPUPass())
        if with_backward and native_kernels:
            # bf16 attention on ortwrap's kernel instead of PyTorch's flash attention (after the pass above).
            passes.append(NativeAttentionPass())
    if device_type == "cpu":
        # Last of the rewrites: the float64 ops ORT's CPU provider cannot run or differentiate
        # (of the graph as the rewrites above leave it) run as PyTorch ops.
        passes.append(DoublePrecisionOnCPUPass(with_backward))
    # Constants the rewrites left without consumers (ORT would warn about each when it loads them).
    # Not onnx_ir's RemoveUnusedNodesPass: it also trims the optional outputs the gradient builders need.
    passes.append(RemoveUnusedConstantsPass())
    if with_backward:
        passes.append(ShapesForGradientsPass())  # last: the gradient builder reads these shapes
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
    """Run one pass (a build stage each, see ``program.build_stages``).

    Raises:
        PassError: naming the pass that failed, chained to its error.
    """
    try:
        return p(model)
    except Exception as e:
        raise PassError(f"pass {type(p).__name__} failed: {type(e).__name__}: {e}") from e


def run_passes(model: onnx.ModelProto, passes: list[ir.passes.PassBase]) -> tuple[onnx.ModelProto, list[PassRecord]]:
    """Run ``passes`` over ``model`` in order; return the rewritten model and a record per pass.

    Raises:
        PassError: naming the pass that failed, chained to its error.
    """
    # Shapes let passes read ranks and static dimensions (extended through ATen nodes).
    try:
        model = infer_types(model)
    except Exception as e:
        raise PassError(f"type inference failed: {type(e).__name__}: {e}") from e
    ir_model = ir.serde.deserialize_model(model)
    records = []
    for p in passes:
        start = time.perf_counter()
        try:
            result = p(ir_model)
        except Exception as e:
            raise PassError(f"pass {type(p).__name__} failed: {type(e).__name__}: {e}") from e
        ir_model = result.model
        records.append(PassRecord(type(p).__name__, result.modified, time.perf_counter() - start))
    return ir.serde.serialize_model(ir_model), records
