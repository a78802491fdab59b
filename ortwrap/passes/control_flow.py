"""Refuse control flow in graphs that get a backward.

ORT 1.19.2's gradient builder aborts the whole process (a failed bounds assertion in its C++) on
``If`` nodes, and has no gradients for ``Loop``/``Scan``. The exporter emits ``If`` for
shape-dependent ops such as ``squeeze`` of a dynamic dimension; ortwrap first re-exports with
static non-batch dimensions, which removes most of them. Whatever remains is refused here, naming
the node, so that ortwrap falls back to PyTorch instead of crashing.
"""

from __future__ import annotations

import onnx_ir as ir

from ..errors import PassError

CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


class RefuseControlFlowPass(ir.passes.InPlacePass):
    """Raise :class:`PassError` if a control-flow node is left in a graph that gets a backward."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        for node in model.graph:
            if node.domain in ("", "ai.onnx") and node.op_type in CONTROL_FLOW:
                raise PassError(
                    f"node {node.name!r} is a {node.op_type}: ONNX Runtime 1.19.2 cannot build gradients through "
                    "control flow (its gradient builder aborts the process on If). It often comes from a "
                    "shape-dependent op on a dynamic dimension, such as squeeze(dim) on the batch dimension; "
                    "use reshape/view with explicit sizes, or run this module without ORTWrap."
                )
        return ir.passes.PassResult(model, modified=False)
