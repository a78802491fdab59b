"""Write ``Log(Sigmoid(x))`` (and ``Log(1 - Sigmoid(x))``) in a form that does not underflow.

Both exporters write ``F.logsigmoid`` (and so ``binary_cross_entropy_with_logits`` and
``multilabel_soft_margin_loss``) as ``Log(Sigmoid(x))``. In float32, ``Sigmoid`` underflows to 0
below x = -88 and loses all digits of ``1 - sigmoid`` long before: ORT gave -inf from x = -17 on
and -14.84 at x = -15 (eager: -15), silently. This pass rewrites it as
``Min(x, 0) - Log(1 + Exp(-Abs(x)))``, PyTorch's own formula, whose ops ORT differentiates
(``Exp`` of a non-positive value cannot overflow). Same values where the old form was exact.
``Log(1 - Sigmoid(x))``, TorchScript's other half of ``binary_cross_entropy_with_logits`` (NaN
from x = 17 on: ``0 * -inf``), is ``logsigmoid(-x)``, rewritten the same way.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._build import NodeBuilder, constant_value

_FLOATS = {ir.DataType.FLOAT: np.float32, ir.DataType.DOUBLE: np.float64, ir.DataType.FLOAT16: np.float16}


def _sigmoid_input(value: ir.Value | None) -> tuple[ir.Value, ir.Node] | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Sigmoid" or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
        return None
    return node.inputs[0], node


def _log_sigmoid_argument(log: ir.Node) -> tuple[ir.Value, bool, list[ir.Node]] | None:
    """(x, whether it is negated, the nodes the rewrite may leave unread) for ``Log(Sigmoid(x))``
    and ``Log(1 - Sigmoid(x))`` (= ``logsigmoid(-x)``: TorchScript's binary cross-entropy with logits)."""
    direct = _sigmoid_input(log.inputs[0])
    if direct is not None:
        return direct[0], False, [direct[1]]
    sub = log.inputs[0].producer() if log.inputs[0] is not None else None
    if sub is None or sub.op_type != "Sub" or sub.domain not in ("", "ai.onnx"):
        return None
    one = constant_value(sub.inputs[0])
    inner = _sigmoid_input(sub.inputs[1])
    if one is None or inner is None or one.size != 1 or float(one.reshape(-1)[0]) != 1.0:
        return None
    return inner[0], True, [sub, inner[1]]


class LogSigmoidPass(ir.passes.InPlacePass):
    """``Log(Sigmoid(x))`` -> ``Min(x, 0) - Log(1 + Exp(-Abs(x)))``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "Log" or node.domain not in ("", "ai.onnx"):
                continue
            found = _log_sigmoid_argument(node)
            if found is None:
                continue
            x, negate, dead = found
            dtype = _FLOATS.get(x.dtype)
            if dtype is None:
                continue
            b = NodeBuilder(node.name or f"log_sigmoid_{id(node):x}")
            if negate:
                x = b.op("Neg", x)
                x.dtype = found[0].dtype
            zero, one = b.const(np.array(0, dtype=dtype)), b.const(np.array(1, dtype=dtype))
            tail = b.op("Log", b.op("Add", one, b.op("Exp", b.op("Neg", b.op("Abs", x)))))
            out = b.op("Sub", b.op("Min", x, zero), tail)
            for v in b.nodes:
                for o in v.outputs:
                    if o.dtype is None and o is not zero and o is not one:
                        o.dtype = x.dtype
            out.dtype, out.shape = node.outputs[0].dtype, node.outputs[0].shape
            graph.insert_before(node, b.nodes)
            name = node.outputs[0].name
            node.outputs[0].replace_all_uses_with(out, replace_graph_outputs=True)
            graph.remove(node, safe=True)
            if name:
                out.name = name
            for producer in dead:  # (the Sub, then the Sigmoid, where nothing else reads them)
                if not producer.outputs[0].uses():
                    graph.remove(producer, safe=True)
            modified = True
        return ir.passes.PassResult(model, modified=modified)
