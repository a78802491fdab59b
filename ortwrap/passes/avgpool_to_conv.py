"""Rewrite ``AveragePool`` as a depthwise ``Conv``.

ORT 1.19.2's CPU ``AveragePoolGrad`` sizes its result from the statically inferred shape of the
forward node: with a dynamic batch it returns a gradient of batch 0 (silently wrong), and a later
``ConvGrad`` dies with SIGFPE. A depthwise Conv with constant weights computes the same average and
its gradient is shape-agnostic::

    no padding, or count_include_pad=1:  y = Conv(x, full(1 / prod(k)), group=C)
    padding with count_include_pad=0:    y = Conv(x, ones, group=C) / Conv(ones_like_spatial, ones)

Needs a static channel count and ``ceil_mode=0``; other AveragePools are left to
``TorchGradientsPass`` (PyTorch's ``avg_pool``, ``ortwrap/ops/mappers.py``); ``auto_pad`` is refused.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..errors import PassError
from ._build import NodeBuilder, ints_attr


class AveragePoolToConvPass(ir.passes.InPlacePass):
    """Replace ``AveragePool`` with an equivalent depthwise ``Conv``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "AveragePool" or node.domain != "":
                continue
            x = node.inputs[0]
            k = ints_attr(node, "kernel_shape", [])
            nd = len(k)
            if "ceil_mode" in node.attributes and node.attributes["ceil_mode"].as_int() != 0:
                continue  # TorchGradientsPass: PyTorch's avg_pool (ortwrap/ops/mappers.py)
            if "auto_pad" in node.attributes and node.attributes["auto_pad"].as_string() not in ("NOTSET", ""):
                raise PassError(f"node {node.name!r}: AveragePool with auto_pad is not supported")
            channels = x.shape[1] if x.shape is not None and len(x.shape) == nd + 2 else None
            if not isinstance(channels, int):
                continue  # TorchGradientsPass
            pads = ints_attr(node, "pads", [0] * (2 * nd))
            conv = {
                "kernel_shape": k,
                "pads": pads,
                "strides": ints_attr(node, "strides", [1] * nd),
                "dilations": ints_attr(node, "dilations", [1] * nd),
            }
            dtype = (x.dtype or ir.DataType.FLOAT).numpy()
            include_pad = "count_include_pad" in node.attributes and node.attributes["count_include_pad"].as_int() == 1
            b = NodeBuilder(node.name or "avgpool")
            if include_pad or not any(pads):
                w = b.const(np.full([channels, 1, *k], 1.0 / float(np.prod(k)), dtype=dtype))
                y = b.op("Conv", x, w, group=channels, **conv)
            else:
                total = b.op("Conv", x, b.const(np.ones([channels, 1, *k], dtype=dtype)), group=channels, **conv)
                spatial = b.op(
                    "Slice", b.op("Shape", x), b.const(np.array([2], np.int64)), b.const(np.array([2 + nd], np.int64))
                )
                shape = b.op("Concat", b.const(np.array([1, 1], np.int64)), spatial, axis=0)
                ones = b.op("ConstantOfShape", shape, value=ir.tensor(np.array([1], dtype=dtype)))
                count = b.op("Conv", ones, b.const(np.ones([1, 1, *k], dtype=dtype)), **conv)
                y = b.op("Div", total, count)
            b.replace(graph, node, [y])
            modified = True
        return ir.passes.PassResult(model, modified=modified)
