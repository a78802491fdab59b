"""Refuse control flow in graphs that get a backward.

ORT 1.19.2's gradient builder aborts the whole process (a failed bounds assertion in its C++) on
``If`` nodes, and has no gradients for ``Loop``/``Scan``. The exporter emits ``If`` for
shape-dependent ops such as ``squeeze`` of a dynamic dimension; ortwrap first re-exports with
static non-batch dimensions, which removes most of them. Whatever remains is refused here, naming
the node, so that ortwrap falls back to PyTorch instead of crashing.

First, an ``If`` whose condition is known from static ranks and shapes (torch's TorchScript
symbolics test ``Size(Shape(x)) == 0`` for ``scatter``/``scatter_reduce`` of a 0-d tensor, where the
rank is known) is replaced by the branch it takes (:func:`fold_static_ifs`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..errors import PassError, describe_origin, node_origin
from ._build import NodeBuilder, constant_value

CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


class RefuseControlFlowPass(ir.passes.InPlacePass):
    """Raise :class:`PassError` if a control-flow node is left in a graph that gets a backward."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = fold_static_ifs(model.graph)
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
        return ir.passes.PassResult(model, modified=modified)


_COMPARE = {"Equal": np.equal, "Greater": np.greater, "Less": np.less, "GreaterOrEqual": np.greater_equal,
            "LessOrEqual": np.less_equal, "And": np.logical_and, "Or": np.logical_or}  # fmt: skip


def _static(value: ir.Value | None, depth: int = 0) -> np.ndarray | None:
    """``value`` where static ranks and shapes fix it (``Size(Shape(x))`` of a tensor of known
    rank, comparisons of such values), or None."""
    if value is None or depth > 8:
        return None
    known = constant_value(value)
    if known is not None:
        return known
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Size":
        if _is_shape_of_known_rank(node.inputs[0]):
            return np.array(len(node.inputs[0].producer().inputs[0].shape), dtype=np.int64)
        shape = node.inputs[0].shape
        if shape is not None and all(isinstance(d, int) for d in shape):
            return np.array(int(np.prod(list(shape), dtype=np.int64)), dtype=np.int64)
        a = _static(node.inputs[0], depth + 1)
        return None if a is None else np.array(a.size, dtype=np.int64)
    if node.op_type in ("Add", "Sub", "Mul") and len(node.inputs) == 2:
        a, b = _static(node.inputs[0], depth + 1), _static(node.inputs[1], depth + 1)
        if a is None or b is None:
            return None
        return {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}[node.op_type](a, b)
    if node.op_type == "Shape" and not node.attributes:
        shape = node.inputs[0].shape
        if shape is not None and all(isinstance(d, int) for d in shape):
            return np.array(list(shape), dtype=np.int64)
        return None
    if node.op_type in _COMPARE and len(node.inputs) == 2:
        a, b = _static(node.inputs[0], depth + 1), _static(node.inputs[1], depth + 1)
        return None if a is None or b is None else np.asarray(_COMPARE[node.op_type](a, b))
    if node.op_type == "Not":
        a = _static(node.inputs[0], depth + 1)
        return None if a is None else np.logical_not(a)
    return None


def _is_shape_of_known_rank(value: ir.Value | None) -> bool:
    node = value.producer() if value is not None else None
    return (
        node is not None
        and node.op_type == "Shape"
        and not node.attributes
        and node.inputs[0] is not None
        and node.inputs[0].shape is not None
    )


def fold_static_ifs(graph: ir.Graph) -> bool:
    """Replace each ``If`` of ``graph`` whose condition :func:`_static` knows by its branch's nodes;
    True if any changed."""
    changed = again = False
    for node in list(graph):
        if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
            continue
        cond = _static(node.inputs[0])
        if cond is None or cond.size != 1:
            continue
        branch = node.attributes["then_branch" if bool(cond.reshape(())) else "else_branch"].as_graph()
        inner = list(branch)
        for n in inner:
            branch.remove(n)
        graph.insert_before(node, inner)
        b = NodeBuilder(node.name or "If")
        b.replace(graph, node, [b.op("Identity", v) for v in branch.outputs])
        changed = True
        again = again or any(n.op_type == "If" for n in inner)
    if again:  # Ifs the branch held
        fold_static_ifs(graph)
    return changed
