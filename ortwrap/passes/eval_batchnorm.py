"""Decompose inference-mode BatchNormalization when a backward is built.

ORT 1.19.2's gradient builder differentiates BatchNormalization only in training mode: it turns an
inference-mode node (``training_mode=0``, from a module in ``eval()``) into ``BatchNormInternal``
with training statistics, so the forward normalizes with the *batch* statistics instead of the
running ones. A module trained or fine-tuned in eval mode (frozen BatchNorm) would silently compute
a different function. This pass rewrites such nodes into elementwise ops that ORT differentiates::

    k = scale / sqrt(var + eps)                  (per channel)
    y = x * reshape(k, [C, 1, ...]) + reshape(bias - mean * k, [C, 1, ...])
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._build import NodeBuilder


class DecomposeEvalBatchNormPass(ir.passes.InPlacePass):
    """Replace ``BatchNormalization(training_mode=0)`` with ``Mul``/``Add`` on per-channel factors."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "BatchNormalization" or node.domain != "":
                continue
            attr = node.attributes.get("training_mode")
            if attr is not None and attr.as_int() == 1:
                continue
            x, scale, bias, mean, var = node.inputs[:5]
            eps = node.attributes["epsilon"].as_float() if "epsilon" in node.attributes else 1e-5
            np_dtype = (var.dtype or ir.DataType.FLOAT).numpy()
            b = NodeBuilder(node.name or "batchnorm")
            if x.shape is not None:
                bshape = b.const(np.array([-1] + [1] * (len(x.shape) - 2), dtype=np.int64))
            else:  # rank known only at run time: [-1] + [1] * (rank - 2)
                rank = b.op("Size", b.op("Shape", x))
                n_ones = b.op(
                    "Reshape",
                    b.op("Sub", rank, b.const(np.array(2, dtype=np.int64))),
                    b.const(np.array([1], dtype=np.int64)),
                )
                ones = b.op("ConstantOfShape", n_ones, value=ir.tensor(np.array([1], dtype=np.int64)))
                bshape = b.op("Concat", b.const(np.array([-1], dtype=np.int64)), ones, axis=0)
            k = b.op("Div", scale, b.op("Sqrt", b.op("Add", var, b.const(np.array(eps, dtype=np_dtype)))))
            shift = b.op("Sub", bias, b.op("Mul", mean, k))
            y = b.op("Add", b.op("Mul", x, b.op("Reshape", k, bshape)), b.op("Reshape", shift, bshape))
            b.replace(graph, node, [y])
            modified = True
        return ir.passes.PassResult(model, modified=modified)
