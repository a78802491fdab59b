"""Decompose ``InstanceNormalization`` (how the exporter writes ``nn.GroupNorm``).

ORT 1.19.2 has no gradient builder for InstanceNormalization. With ``axes = 2 .. rank-1``::

    m = ReduceMean(x, axes); d = x - m
    y = d / Sqrt(ReduceMean(d * d, axes) + eps) * Unsqueeze(scale) + Unsqueeze(bias)
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..errors import PassError
from ._build import NodeBuilder


class DecomposeInstanceNormPass(ir.passes.InPlacePass):
    """Replace ``InstanceNormalization`` by reductions and elementwise ops."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "InstanceNormalization" or node.domain != "":
                continue
            x, scale, bias = node.inputs[:3]
            if x.shape is None:
                raise PassError(f"node {node.name!r}: InstanceNormalization input rank is unknown")
            rank = len(x.shape)
            axes = list(range(2, rank))
            eps = node.attributes["epsilon"].as_float() if "epsilon" in node.attributes else 1e-5
            b = NodeBuilder(node.name or "instance_norm")
            channel_axes = b.const(np.array(list(range(1, rank - 1)), dtype=np.int64))
            if model.opset_imports.get("", 17) >= 18:  # ReduceMean's axes became an input
                axes_in = b.const(np.array(axes, dtype=np.int64))
                mean = b.op("ReduceMean", x, axes_in, keepdims=1)
                d = b.op("Sub", x, mean)
                var = b.op("ReduceMean", b.op("Mul", d, d), axes_in, keepdims=1)
            else:
                mean = b.op("ReduceMean", x, axes=axes, keepdims=1)
                d = b.op("Sub", x, mean)
                var = b.op("ReduceMean", b.op("Mul", d, d), axes=axes, keepdims=1)
            eps_v = b.const(np.array(eps, dtype=(x.dtype or ir.DataType.FLOAT).numpy()))
            normed = b.op("Div", d, b.op("Sqrt", b.op("Add", var, eps_v)))
            y = b.op(
                "Add",
                b.op("Mul", normed, b.op("Unsqueeze", scale, channel_axes)),
                b.op("Unsqueeze", bias, channel_axes),
            )
            b.replace(graph, node, [y])
            modified = True
        return ir.passes.PassResult(model, modified=modified)
