"""Keep the exported erf GELU in elementwise ops, so its CPU gradient runs on every thread.

Both exporters write ``F.gelu(x)`` (``approximate="none"``) as ``0.5 * x * (1 + Erf(x / sqrt(2)))``.
ORT 1.19.2's ``GeluFusion`` turns that into ``com.microsoft::Gelu``, whose gradient is ``GeluGrad``;
on CPU, ``GeluGrad`` evaluates erf and exp over the whole tensor in one Eigen expression on one
thread: ~4 ms per GELU of a 8x128x1024 activation, 18 ms of a ~180 ms GPT step on 2 cores. The
gradient ORT builds from the elementwise ops (``Mul``, ``Erf``, ``Exp``, ...) uses all intra-op
threads: ~11 ms for the forward and backward of the four GELUs instead of ~22 ms (measured with
``benchmarks/profile_lm.py``; eager PyTorch takes ~6 ms).

``GeluFusion`` matches only ``Div(x, sqrt(2))``; this pass writes the same value as
``Mul(x, 1/sqrt(2))``, which differs from the division by at most one rounding of the Erf input
(fp32: a few 1e-8 relative). CPU only: the CUDA ``GeluGrad`` kernel is the faster choice there.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ._build import NodeBuilder, constant_value


class UnfuseErfGeluPass(ir.passes.InPlacePass):
    """Replace ``Div(x, sqrt(2))`` feeding only an ``Erf`` with ``Mul(x, 1/sqrt(2))``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "Div" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
                continue
            uses = list(node.outputs[0].uses())
            if len(uses) != 1 or uses[0][0].op_type != "Erf" or node.outputs[0].is_graph_output():
                continue
            divisor = constant_value(node.inputs[1])
            if divisor is None or divisor.size != 1 or divisor.dtype.kind != "f":
                continue
            if abs(float(divisor.reshape(-1)[0]) - math.sqrt(2.0)) > 1e-6:
                continue
            b = NodeBuilder(node.name or f"gelu_{id(node):x}")
            factor = b.const(np.array(1.0 / math.sqrt(2.0), dtype=divisor.dtype).reshape(divisor.shape))
            b.replace(graph, node, [b.op("Mul", node.inputs[0], factor)])
            modified = True
        return ir.passes.PassResult(model, modified=modified)
