"""Write ``Conv``'s ``auto_pad="SAME_*"`` as explicit pads (and a ``Pad`` for an uneven split).

The TorchScript exporter writes ``nn.Conv*d(padding="same")`` as ``auto_pad=SAME_UPPER``. ORT 1.19.2
then goes wrong twice: its ``ConvGrad`` ignores ``auto_pad`` (a kernel of even size, whose padding
is uneven, got silently wrong weight and input gradients), and its CPU ``Conv`` refuses ``SAME_*``
with a dilation at run time. With stride 1 (the only stride PyTorch allows for "same") the padding
does not depend on the input size: ``dilation * (kernel - 1)`` per axis, the odd element at the end
for ``SAME_UPPER`` (PyTorch's split) and at the start for ``SAME_LOWER``. The even part becomes
``Conv``'s own symmetric ``pads``; the rest a constant ``Pad`` before it, as the dynamo exporter
writes it. Same values.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._build import NodeBuilder, ints_attr


class ExplicitConvPadsPass(ir.passes.InPlacePass):
    """Replace ``auto_pad=SAME_UPPER|SAME_LOWER`` of stride-1 ``Conv`` nodes with explicit padding."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "Conv" or node.domain not in ("", "ai.onnx"):
                continue
            auto_pad = node.attributes.get("auto_pad")
            mode = auto_pad.as_string() if auto_pad is not None else "NOTSET"
            if mode not in ("SAME_UPPER", "SAME_LOWER"):
                continue
            w = node.inputs[1]
            kernel = ints_attr(node, "kernel_shape", [])
            if not kernel and w is not None and w.shape is not None and all(isinstance(d, int) for d in w.shape[2:]):
                kernel = [int(d) for d in w.shape[2:]]
            if not kernel:
                continue  # the kernel's size is unknown: left to ORT
            rank = len(kernel)
            if any(s != 1 for s in ints_attr(node, "strides", [1] * rank)):
                continue  # the padding depends on the input size
            dilations = ints_attr(node, "dilations", [1] * rank)
            total = [d * (k - 1) for d, k in zip(dilations, kernel)]
            begin = [t // 2 if mode == "SAME_UPPER" else t - t // 2 for t in total]
            end = [t - b for t, b in zip(total, begin)]
            even = [min(b, e) for b, e in zip(begin, end)]
            extra_begin = [b - s for b, s in zip(begin, even)]
            extra_end = [e - s for e, s in zip(end, even)]
            if any(extra_begin) or any(extra_end):
                x = node.inputs[0]
                b = NodeBuilder(f"{node.name or f'conv_{id(node):x}'}/same")
                padded = b.op("Pad", x, b.const(np.array([0, 0, *extra_begin, 0, 0, *extra_end], dtype=np.int64)))
                padded.dtype = x.dtype
                if x.shape is not None and len(x.shape) == rank + 2:
                    dims = list(x.shape)
                    for i in range(rank):
                        if isinstance(dims[2 + i], int):
                            dims[2 + i] += extra_begin[i] + extra_end[i]
                        else:
                            dims[2 + i] = None
                    padded.shape = ir.Shape(dims)
                graph.insert_before(node, b.nodes)
                node.replace_input_with(0, padded)
            node.attributes.pop("auto_pad")
            node.attributes["pads"] = ir.AttrInt64s("pads", even + even)
            modified = True
        return ir.passes.PassResult(model, modified=modified)
