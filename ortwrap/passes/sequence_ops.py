"""Refuse sequence ops where gradients flow.

ORT 1.19.2's gradient builder has no gradients for the ``Sequence*`` ops and does not fail on
them: it silently drops the gradient that flows through them (a feasibility check measured rotary
q/k gradients off by about 2e-3, with no error). The dynamo exporter emits such ops for
``torch.split``/``unbind``/``chunk``; the onnxscript optimizer turns the common forms into
``Split``, and whatever is left on a path from a floating-point graph input (a parameter or a
differentiable input) is refused here, naming the node, so that ortwrap raises or falls back
instead of training with wrong gradients. Sequence ops that carry only integer values (shape
computations) are left alone.

Before refusing, the pass lowers the sequences whose elements are known where they are read
(:func:`lower_static_sequences`): a ``SequenceAt`` with a constant index of a ``SequenceConstruct``
is that element; of a ``SplitToSequence`` (``split``/``chunk``/``unbind``/``tensor_split`` with
constant sizes), a ``Slice`` of the input (``Squeeze`` d for ``keepdims=0``), whose gradient ORT has;
a ``ConcatFromSequence`` of a ``SequenceConstruct`` is a ``Concat`` (of ``Unsqueeze`` d elements
for ``new_axis=1``); a ``SequenceLength`` of one is a constant. Only what stays is refused.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..errors import PassError, describe_origin, node_origin
from ._build import NodeBuilder, constant_value

SEQUENCE_OPS = frozenset(
    {
        "SequenceConstruct",
        "SequenceAt",
        "SequenceInsert",
        "SequenceErase",
        "SequenceLength",
        "SequenceEmpty",
        "SplitToSequence",
        "ConcatFromSequence",
        "SequenceMap",
    }
)

_NO_GRADIENT = frozenset({"Shape", "Size", "ArgMax", "ArgMin", "NonZero", "Equal", "Less", "Greater"})
_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


class RefuseSequenceOpsPass(ir.passes.InPlacePass):
    """Raise :class:`PassError` for a sequence op that floating-point graph inputs reach."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if not any(n.op_type in SEQUENCE_OPS and n.domain in ("", "ai.onnx") for n in graph):
            return ir.passes.PassResult(model, modified=False)
        modified = lower_static_sequences(graph)
        reached: set[int] = {id(v) for v in graph.inputs if v.dtype in _FLOATS}
        for node in graph:  # topological order
            if any(v is not None and id(v) in reached for v in node.inputs):
                if node.op_type in SEQUENCE_OPS and node.domain in ("", "ai.onnx"):
                    where = describe_origin(node_origin(node.name or "", dict(node.metadata_props)))
                    raise PassError(
                        f"{where + ': ' if where else ''}node {node.name!r} is a {node.op_type} on the gradient path: "
                        "ONNX Runtime 1.19.2 silently "
                        "drops gradients through sequence ops. It usually comes from torch.split/chunk/unbind with "
                        "sizes the exporter could not fix; use fixed split sizes or slicing, or "
                        "exporter='torchscript'."
                    )
                if node.op_type in _NO_GRADIENT and node.domain in ("", "ai.onnx"):
                    continue  # metadata or integer results: no gradient flows on
                reached.update(id(v) for v in node.outputs if v.dtype is None or v.dtype in _FLOATS)
        return ir.passes.PassResult(model, modified=modified)


_INT64_MAX = np.iinfo(np.int64).max


def _is(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _split_bounds(split_node: ir.Node, index: int) -> tuple[int, int, bool] | None:
    """(start, end, squeeze) along the axis of element ``index`` of a ``SplitToSequence``, or None
    where the sizes or the count are not constant."""
    x = split_node.inputs[0]
    axis_attr = split_node.attributes.get("axis")
    axis = axis_attr.as_int() if axis_attr is not None else 0
    keep_attr = split_node.attributes.get("keepdims")
    keepdims = keep_attr.as_int() if keep_attr is not None else 1
    split_value = split_node.inputs[1] if len(split_node.inputs) > 1 else None
    if split_value is None:  # one element per index along the axis
        end = index + 1 if index != -1 else _INT64_MAX
        return index, end, not keepdims
    split = constant_value(split_value)
    if split is None:
        return None
    if split.ndim == 0:  # chunks of ``split``, the last one shorter
        size = int(split)
        if index < 0:
            dims = x.shape
            if dims is None or not isinstance(dims[axis], int) or size <= 0:
                return None
            index += -(-dims[axis] // size)
            if index < 0:
                return None
        return index * size, (index + 1) * size, False
    sizes = [int(v) for v in split.reshape(-1)]
    if index < 0:
        index += len(sizes)
    if not 0 <= index < len(sizes):
        return None
    start = sum(sizes[:index])
    return start, start + sizes[index], False


def _axis(node: ir.Node) -> int:
    a = node.attributes.get("axis")
    return a.as_int() if a is not None else 0


def lower_static_sequences(graph: ir.Graph) -> bool:
    """Lower the sequence reads whose elements are known (the module docstring); True if any changed."""
    changed = False
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.graph is not graph:
            continue
        source = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
        b = NodeBuilder(node.name or node.op_type)
        if node.op_type == "SequenceAt" and (_is(source, "SequenceConstruct") or _is(source, "SplitToSequence")):
            index = constant_value(node.inputs[1])
            if index is None or index.size != 1:
                continue
            index = int(index.reshape(()))
            if _is(source, "SequenceConstruct"):
                n = len(source.inputs)
                if not -n <= index < n:
                    continue
                b.replace(graph, node, [b.op("Identity", source.inputs[index])])
            else:
                bounds = _split_bounds(source, index)
                if bounds is None:
                    continue
                start, end, squeeze = bounds
                axis = _axis(source)
                out = b.op(
                    "Slice",
                    source.inputs[0],
                    b.const(np.array([start], dtype=np.int64)),
                    b.const(np.array([end], dtype=np.int64)),
                    b.const(np.array([axis], dtype=np.int64)),
                )
                if squeeze:
                    out = b.op("Squeeze", out, b.const(np.array([axis], dtype=np.int64)))
                b.replace(graph, node, [out])
            changed = True
        elif node.op_type == "ConcatFromSequence" and _is(source, "SequenceConstruct"):
            axis = _axis(node)
            new_axis = node.attributes.get("new_axis")
            parts = list(source.inputs)
            if new_axis is not None and new_axis.as_int():
                parts = [b.op("Unsqueeze", p, b.const(np.array([axis], dtype=np.int64))) for p in parts]
            b.replace(graph, node, [b.op("Concat", *parts, axis=axis)])
            changed = True
        elif node.op_type == "SequenceLength" and _is(source, "SequenceConstruct"):
            b.replace(graph, node, [b.const(np.array(len(source.inputs), dtype=np.int64))])
            changed = True
    if changed:  # the sequences nothing reads any more
        outputs = {id(v) for v in graph.outputs}
        for node in reversed(list(graph)):
            if (
                node.op_type in ("SequenceConstruct", "SplitToSequence")
                and node.domain in ("", "ai.onnx")
                and not any(v.uses() or id(v) in outputs for v in node.outputs)
            ):
                graph.remove(node, safe=True)
    return changed
