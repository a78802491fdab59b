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
            new: list[ir.Node] = []

            def op(op_type: str, *inputs: ir.Value, **attrs) -> ir.Value:
                n = ir.node(op_type, list(inputs), attributes=attrs, name=f"{node.name}/eval_bn/{len(new)}")
                new.append(n)
                return n.outputs[0]

            def const(value) -> ir.Value:
                return op("Constant", value=ir.tensor(value))

            if x.shape is not None:
                bshape = const(np.array([-1] + [1] * (len(x.shape) - 2), dtype=np.int64))
            else:  # rank known only at run time: [-1] + [1] * (rank - 2)
                rank = op("Size", op("Shape", x))
                n_ones = op("Reshape", op("Sub", rank, const(np.array(2, dtype=np.int64))), const(np.array([1], dtype=np.int64)))
                ones = op("ConstantOfShape", n_ones, value=ir.tensor(np.array([1], dtype=np.int64)))
                bshape = op("Concat", const(np.array([-1], dtype=np.int64)), ones, axis=0)
            k = op("Div", scale, op("Sqrt", op("Add", var, const(np.array(eps, dtype=np_dtype)))))
            shift = op("Sub", bias, op("Mul", mean, k))
            y = op("Add", op("Mul", x, op("Reshape", k, bshape)), op("Reshape", shift, bshape))
            graph.insert_before(node, new)
            out = node.outputs[0]
            y.name, out.name = out.name, None
            ir.convenience.replace_all_uses_with(out, y)
            if out.is_graph_output():
                graph.outputs[graph.outputs.index(out)] = y
            graph.remove(node, safe=True)
            modified = True
        return ir.passes.PassResult(model, modified=modified)
