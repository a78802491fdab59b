"""What a build is asked (:class:`BuildRequest`) and what it gives back (:class:`BuildArtifacts`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import onnx
import torch
from torch import nn

from .. import gemm_choice as gemms
from ..grad import TrainingGraph
from ..grad.recompute import RecomputeReport
from ..options import Options
from ..passes import PassRecord
from ..passes.host_shapes import HostShapeSplit
from .pipeline import StageRecord

__all__ = ["BuildArtifacts", "BuildRequest"]


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
    #: the autocast state the call ran under (``dispatch.autocast_state()``), or None
    autocast: tuple | None = None

    @property
    def kind(self) -> str:
        return "train" if self.with_backward else ("infer_trainmode" if self.training else "infer")

    def describe(self) -> str:
        return f"{'training' if self.with_backward else 'inference'} program for {type(self.module).__name__}"


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
