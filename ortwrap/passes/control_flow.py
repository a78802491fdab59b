"""Refuse control flow in graphs that get a backward.

ORT 1.19.2's gradient builder aborts the whole process (a failed bounds assertion in its C++) on
``If`` nodes, and has no gradients for ``Loop``/``Scan``. The exporter emits ``If`` for
shape-dependent ops such as ``squeeze`` of a dynamic dimension; ortwrap first re-exports with
static non-batch dimensions, which removes most of them. Whatever remains is refused here, naming
the node, so that ortwrap falls back to PyTorch instead of crashing.
"""

from __future__ import annotations

import onnx_ir as ir

from ..errors import PassError, describe_origin, node_origin

CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


class RefuseControlFlowPass(ir.passes.InPlacePass):
    """Raise :class:`PassError` if a control-flow node is left in a graph that gets a backward."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        for node in model.graph:
            if node.domain in ("", "ai.onnx") and node.op_type in CONTROL_FLOW:
                origin = node_origin(node.name or "", dict(node.metadata_props))
                where = describe_origin(origin)
                op = origin.get("op", "")
                if op and not op.endswith(("squeeze", "unsqueeze")):
                    name = op.split(".")[-1]
                    hint = (
                        f"the exporter writes {op} as a {node.op_type}; run it with PyTorch's own kernel and "
                        f'gradient inside the graph, ORTWrap(..., aten_ops=("{name}",)), or run this module '
                        "without ORTWrap."
                    )
                elif "path" in origin and not op:
                    hint = (
                        "one of its ops has no ONNX form without control flow: name that op in ORTWrap(..., "
                        "aten_ops=(...)) to run it with PyTorch's own kernel and gradient inside the graph (the dynamo "
                        "exporter's error names the op); a squeeze(dim) of a dynamic dimension is better written "
                        "as reshape/view with explicit sizes; or run this module without ORTWrap."
                    )
                else:
                    hint = (
                        "it often comes from a shape-dependent op on a dynamic dimension, such as squeeze(dim) on the "
                        "batch dimension; use reshape/view with explicit sizes, or run this module without ORTWrap."
                    )
                raise PassError(
                    f"{where + ': ' if where else ''}node {node.name!r} is a {node.op_type}, and ONNX Runtime 1.19.2 "
                    f"cannot build gradients through control flow (its gradient builder aborts the process on If): "
                    f"{hint}"
                )
        return ir.passes.PassResult(model, modified=False)
