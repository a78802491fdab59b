"""Rewrite ``NegativeLogLikelihoodLoss`` into ops ORT differentiates.

ORT 1.19.2 has no gradient builder for ``NegativeLogLikelihoodLoss`` (the exporter fuses
``nll_loss(log_softmax(x))`` into ``SoftmaxCrossEntropyLoss``, but ``nll_loss`` on any other input
stays)::

    safe = Where(t == ignore, 0, t)
    v    = Where(t == ignore, 0, -GatherElements(x, Unsqueeze(safe, 1), axis=1))   (squeezed)
    mean: ReduceSum(v) / count(t != ignore);  sum: ReduceSum(v);  none: v

With class weights ``w``, each ``v`` is scaled by ``w[safe]`` and ``mean`` divides by the sum of
the weights of the targets not ignored (PyTorch's weighted mean).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._build import NodeBuilder


class DecomposeNLLLossPass(ir.passes.InPlacePass):
    """Replace ``NegativeLogLikelihoodLoss`` (class weights too) by GatherElements and reductions."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "NegativeLogLikelihoodLoss" or node.domain != "":
                continue
            x, t = node.inputs[0], node.inputs[1]
            weight = node.inputs[2] if len(node.inputs) > 2 else None
            reduction = node.attributes["reduction"].as_string() if "reduction" in node.attributes else "mean"
            ignore = node.attributes["ignore_index"].as_int() if "ignore_index" in node.attributes else None
            dtype = (x.dtype or ir.DataType.FLOAT).numpy()
            b = NodeBuilder(node.name or "nll")
            one = b.const(np.array([1], dtype=np.int64))
            target = t
            ignored = None
            if ignore is not None:
                ignored = b.op("Equal", t, b.const(np.array(ignore, dtype=np.int64)))
                target = b.op("Where", ignored, b.const(np.array(0, dtype=np.int64)), t)
            picked = b.op("Squeeze", b.op("GatherElements", x, b.op("Unsqueeze", target, one), axis=1), one)
            v = b.op("Neg", picked)
            zero = b.const(np.array(0.0, dtype=dtype))
            w = None
            if weight is not None:
                w = b.op("Gather", weight, target, axis=0)  # each target's class weight
                v = b.op("Mul", v, w)
            if ignored is not None:
                v = b.op("Where", ignored, zero, v)
            if reduction == "none":
                result = v
            elif reduction == "sum":
                result = b.op("ReduceSum", v, keepdims=0)
            elif w is not None:
                counted = b.op("Where", ignored, zero, w) if ignored is not None else w
                result = b.op("Div", b.op("ReduceSum", v, keepdims=0), b.op("ReduceSum", counted, keepdims=0))
            else:
                kept = b.op("Not", ignored) if ignored is not None else b.op("Equal", t, t)
                result = b.op(
                    "Div",
                    b.op("ReduceSum", v, keepdims=0),
                    b.op("ReduceSum", b.op("Cast", kept, to=int(ir.DataType.from_numpy(np.dtype(dtype)))), keepdims=0),
                )
            b.replace(graph, node, [result])
            modified = True
        return ir.passes.PassResult(model, modified=modified)
