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

from ._build import NodeBuilder


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
        before = NodeBuilder(f"{node.name}/unbiased_var_pre")
        m = before.const(np.array(momentum, dtype=np_dtype))
        old_part = before.op("Mul", var_in, m)
        node.replace_input_with(4, before.op("Div", old_part, m))
        graph.insert_before(node, before.nodes)

        after = NodeBuilder(f"{node.name}/unbiased_var")
        shape = after.op("Shape", x)
        total = after.op("ReduceProd", shape, keepdims=0)
        channels = after.op("Gather", shape, after.const(np.array(1, dtype=np.int64)), axis=0)
        count = after.op("Cast", after.op("Div", total, channels), to=int(dtype))
        correction = after.op("Div", count, after.op("Sub", count, after.const(np.array(1, dtype=np_dtype))))
        result = after.op("Add", old_part, after.op("Mul", after.op("Sub", var_new, old_part), correction))
        graph.insert_after(node, after.nodes)
        return result
