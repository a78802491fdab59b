"""The result of exporting: an ONNX model plus the names that tie it back to the module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx
import torch


@dataclass
class ExportedModel:
    """An exported ONNX model and how its graph inputs and outputs map to the module.

    Attributes:
        model: the ONNX model; passes rewrite it in place.
        user_input_names: graph input name of each flat tensor input, in flattening order. An
            input the graph does not use is ``None``.
        state_inputs: graph input name -> the parameter or buffer tensor fed to it every step.
        output_names: graph output name of each flat tensor output, in flattening order.
        out_spec: the tree spec that rebuilds the module's output from those tensors.
        buffer_outputs: graph output name -> the buffer that receives its value after each forward
            (buffers the module updates, such as BatchNorm running statistics).
        state_names: graph input name -> the module's own name for that parameter or buffer.
        static_reasons: why this graph needs static non-batch dimensions (empty if it does not).
        static_spatial: the export made only dimension 0 of each input dynamic.
        keepalive: objects the graph's PythonOps point to; whoever runs the graph holds them.
        functions: unique names of the autograd.Functions bridged as PythonOps (one per call).
    """

    model: onnx.ModelProto
    user_input_names: list[str | None]
    state_inputs: dict[str, torch.Tensor]
    output_names: list[str]
    out_spec: tuple
    buffer_outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    state_names: dict[str, str] = field(default_factory=dict)
    static_reasons: list[str] = field(default_factory=list)
    static_spatial: bool = False
    keepalive: list[object] = field(default_factory=list)
    functions: list[str] = field(default_factory=list)
    #: dynamo exports only: the shape assumptions of the capture (``export.dynamo.ShapeGuards``).
    shape_guards: Any = None
