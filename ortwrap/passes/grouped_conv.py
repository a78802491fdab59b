"""Run grouped 1-D ``Conv`` as a 2-D ``Conv`` with a height of 1 in CPU training graphs.

ORT 1.19.2's CPU ``ConvGrad`` computes the input gradient of a convolution whose kernel is not 2-D
with ``Col2imNd``, passing it the size of the whole image (``C * input_image_size``) while it steps
through the groups ``C / group`` channels at a time. ``Col2imNd`` first zeroes that many elements
from the group's offset, so for every group after the first, and past the last image, it writes
zeros beyond the end of the gradient buffer: ``(group - 1) / group`` of an image's worth of floats.
The gradient itself comes out right; whatever ORT (or the heap) put next to it is overwritten with
zeros, so another value of the backward, one that no convolution touches, is silently wrong
(wav2vec2's grouped positional convolution zeroed an attention layer's saved softmax probabilities,
and which value it hit moved with the memory layout), or the process dies in ``free()``.

The 2-D path (``Col2im`` with ``C / group`` channels) is correct, so a grouped 1-D convolution
becomes one::

    Y = Squeeze(Conv(Unsqueeze(X, 2), Unsqueeze(W, 2), B, kernel_shape=[1, k],
                     pads=[0, p0, 0, p1], strides=[1, s], dilations=[1, d], group=g), 2)

Same arithmetic, one kernel; the reshapes cost nothing. Grouped 3-D convolutions hit the same bug
and have no 2-D form: each group becomes its own ``Conv`` (``Split`` of X, W and B, ``Concat`` of
the results), whose ``ConvGrad`` with ``group=1`` zeroes exactly its own image.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._build import NodeBuilder, ints_attr


def _spatial_rank(node: ir.Node) -> int | None:
    """The number of spatial dims of a Conv (from its kernel_shape, else its inputs' ranks)."""
    k = ints_attr(node, "kernel_shape")
    if k is not None:
        return len(k)
    for v in node.inputs[:2]:
        if v is not None and v.shape is not None:
            return len(v.shape) - 2
    return None


class GroupedConvGradPass(ir.passes.InPlacePass):
    """Rewrite grouped non-2-D ``Conv`` nodes into forms whose CPU ``ConvGrad`` stays in bounds."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if graph.opset_imports.get("", 13) < 13:
            return ir.passes.PassResult(model, modified=False)  # Unsqueeze/Split with attribute axes
        modified = False
        for node in list(graph):
            if node.op_type != "Conv" or node.domain not in ("", "ai.onnx"):
                continue
            group = node.attributes["group"].as_int() if "group" in node.attributes else 1
            if group <= 1:
                continue
            rank = _spatial_rank(node)
            if rank == 1:
                self._as_2d(graph, node, group)
                modified = True
            elif rank == 3:
                modified = self._per_group(graph, node, group) or modified
        return ir.passes.PassResult(model, modified=modified)

    @staticmethod
    def _as_2d(graph: ir.Graph, node: ir.Node, group: int) -> None:
        x, w, *rest = node.inputs
        b = NodeBuilder(node.name or "grouped_conv1d")
        axis = b.const(np.array([2], np.int64))
        attrs: dict = {"group": group}
        k = ints_attr(node, "kernel_shape")
        if k is not None:
            attrs["kernel_shape"] = [1, *k]
        pads = ints_attr(node, "pads")
        if pads is not None:
            attrs["pads"] = [0, pads[0], 0, pads[1]]
        for name in ("strides", "dilations"):
            v = ints_attr(node, name)
            if v is not None:
                attrs[name] = [1, *v]
        if "auto_pad" in node.attributes:
            attrs["auto_pad"] = node.attributes["auto_pad"].as_string()
        y = b.op("Conv", b.op("Unsqueeze", x, axis), b.op("Unsqueeze", w, axis), *rest, **attrs)
        b.replace(graph, node, [b.op("Squeeze", y, axis)])

    @staticmethod
    def _per_group(graph: ir.Graph, node: ir.Node, group: int) -> bool:
        x, w, *rest = node.inputs
        bias = rest[0] if rest else None
        shape = w.shape if w is not None else None
        if shape is None or not isinstance(shape[0], int) or not isinstance(shape[1], int) or shape[0] % group:
            return False  # the channels per group must be known to split X, W and B
        b = NodeBuilder(node.name or "grouped_conv3d")
        attrs = {}
        for a in node.attributes.values():
            if a.name == "group":
                continue
            attrs[a.name] = a.as_string() if a.type == ir.AttributeType.STRING else list(a.as_ints())
        x_sizes = b.const(np.full([group], shape[1], np.int64))
        w_sizes = b.const(np.full([group], shape[0] // group, np.int64))
        xs = b.node("Split", [x, x_sizes], outputs=group, axis=1).outputs
        ws = b.node("Split", [w, w_sizes], outputs=group, axis=0).outputs
        bs = b.node("Split", [bias, w_sizes], outputs=group, axis=0).outputs if bias is not None else [None] * group
        ys = [b.op("Conv", xi, wi, *([bi] if bi is not None else []), **attrs) for xi, wi, bi in zip(xs, ws, bs)]
        b.replace(graph, node, [b.op("Concat", *ys, axis=1)])
        return True
