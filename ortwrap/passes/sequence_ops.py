"""Refuse sequence ops where gradients flow.

ORT 1.19.2's gradient builder has no gradients for the ``Sequence*`` ops and does not fail on
them: it silently drops the gradient that flows through them (a feasibility check measured rotary
q/k gradients off by about 2e-3, with no error). The dynamo exporter emits such ops for
``torch.split``/``unbind``/``chunk``; the onnxscript optimizer turns the common forms into
``Split``, and whatever is left on a path from a floating-point graph input (a parameter or a
differentiable input) is refused here, naming the node, so that ortwrap raises or falls back
instead of training with wrong gradients. Sequence ops that carry only integer values (shape
computations) are left alone.
"""

from __future__ import annotations

import onnx_ir as ir

from ..errors import PassError, describe_origin, node_origin

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
        return ir.passes.PassResult(model, modified=False)
