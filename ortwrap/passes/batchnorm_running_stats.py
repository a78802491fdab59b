"""Route BatchNormalization's updated running statistics to the buffer outputs.

In training mode the TorchScript exporter emits ``BatchNormalization(training_mode=1)`` with the
updated running mean and variance as outputs 1 and 2, but the running-mean buffer it returns is the
unchanged graph input. This pass makes the buffer's graph output take the node's updated value::

    y, m1, v1 = BatchNormalization(x, s, b, m, v)    out:buf.m = Identity(m)
      ->  out:buf.m = Identity(m1 * c + m * (1 - c)) ...

ONNX computes ``m1 = m * momentum + mean * (1 - momentum)`` and ``v1`` from the *biased* batch
variance, while PyTorch updates ``running_var`` with the *unbiased* one. The variance output is
therefore rebuilt as ``v * momentum + var_b * n / (n - 1) * (1 - momentum)``, where ``var_b`` is
recovered from ``v1`` and ``n`` is the number of elements per channel.

Limitations: ``momentum=None`` (cumulative averaging) is not rewritten and fails parity; the
exporter emits a fixed momentum.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


class BatchNormRunningStatsPass(ir.passes.InPlacePass):
    """Make buffer outputs of BatchNorm running statistics carry their updated values."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        outputs = {id(v): i for i, v in enumerate(graph.outputs)}
        modified = False
        for node in list(graph):
            if node.op_type != "BatchNormalization" or node.domain != "":
                continue
            attr = node.attributes.get("training_mode")
            if attr is None or attr.as_int() != 1 or len(node.outputs) < 3:
                continue
            momentum = node.attributes["momentum"].as_float() if "momentum" in node.attributes else 0.9
            mean_in, var_in = node.inputs[3], node.inputs[4]
            for stat_in, new_value in ((mean_in, node.outputs[1]), (var_in, self._unbiased_var(graph, node, momentum))):
                for use_node, _ in list(stat_in.uses()):
                    if use_node.op_type == "Identity" and id(use_node.outputs[0]) in outputs:
                        use_node.replace_input_with(0, new_value)
                        modified = True
        return ir.passes.PassResult(model, modified=modified)

    @staticmethod
    def _unbiased_var(graph: ir.Graph, node: ir.Node, momentum: float) -> ir.Value:
        """``v * m + (v1 - v * m) * n / (n - 1)`` with ``n`` = elements per channel of ``x``.

        NOTE: ORT's training kernel (``BatchNormInternal``) may write the updated variance into the
        buffer of its running-variance input. ``v * m`` must therefore be computed before the node
        runs: the node is fed ``(v * m) / m`` instead of ``v``, which forces that order (a rounding
        difference of at most one ulp) and keeps ORT from writing into the module's buffer.
        """
        x, var_in, var_new = node.inputs[0], node.inputs[4], node.outputs[2]
        dtype = var_in.dtype or ir.DataType.FLOAT
        np_dtype = dtype.numpy()
        before: list[ir.Node] = []
        after: list[ir.Node] = []

        def op(nodes: list[ir.Node], op_type: str, *inputs: ir.Value, **attrs) -> ir.Value:
            n = ir.node(op_type, list(inputs), attributes=attrs, name=f"{node.name}/unbiased_var/{len(before) + len(after)}")
            nodes.append(n)
            return n.outputs[0]

        def const(nodes: list[ir.Node], value: float | int, dt) -> ir.Value:
            return op(nodes, "Constant", value=ir.tensor(np.array(value, dtype=dt)))

        m = const(before, momentum, np_dtype)
        old_part = op(before, "Mul", var_in, m)
        node.replace_input_with(4, op(before, "Div", old_part, m))
        graph.insert_before(node, before)

        shape = op(after, "Shape", x)
        total = op(after, "ReduceProd", shape, keepdims=0)
        channels = op(after, "Gather", shape, const(after, 1, np.int64), axis=0)
        count = op(after, "Cast", op(after, "Div", total, channels), to=int(dtype))
        correction = op(after, "Div", count, op(after, "Sub", count, const(after, 1, np_dtype)))
        result = op(after, "Add", old_part, op(after, "Mul", op(after, "Sub", var_new, old_part), correction))
        graph.insert_after(node, after)
        return result
