"""A small helper for passes that replace one node with a few new ones (and ``constant_value``,
which ``ops/values.py`` defines: the argument mappers of ``ops/`` read constants too)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..ops.values import constant_value

__all__ = ["NodeBuilder", "constant_value", "ints_attr"]


class NodeBuilder:
    """Collects new nodes, named after the node they replace, and splices them into a graph."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[ir.Node] = []

    def op(self, op_type: str, *inputs: ir.Value | None, **attrs) -> ir.Value:
        n = ir.node(op_type, list(inputs), attributes=attrs, name=f"{self.prefix}/ortwrap/{op_type}_{len(self.nodes)}")
        self.nodes.append(n)
        return n.outputs[0]

    def node(
        self, op_type: str, inputs: list[ir.Value | None], *, domain: str = "", outputs: int = 1, **attrs
    ) -> ir.Node:
        """A new node with ``outputs`` outputs (in ``domain``), added like :meth:`op`."""
        n = ir.node(
            op_type,
            inputs,
            attributes=attrs,
            domain=domain,
            num_outputs=outputs,
            name=f"{self.prefix}/ortwrap/{op_type}_{len(self.nodes)}",
        )
        self.nodes.append(n)
        return n

    def const(self, value: np.ndarray) -> ir.Value:
        return self.op("Constant", value=ir.tensor(value))

    def replace(self, graph: ir.Graph, node: ir.Node, new_outputs: list[ir.Value]) -> None:
        """Insert the new nodes before ``node``, move the uses and names of its outputs to
        ``new_outputs`` (graph outputs included) and remove it."""
        graph.insert_before(node, self.nodes)
        for old, new in zip(node.outputs, new_outputs):
            # The same value: keep its inferred type and shape (ORT's gradient builder falls back
            # to shape-generic subgraphs downstream of values without them).
            if new.dtype is None and old.dtype is not None:
                new.dtype = old.dtype
            if new.shape is None and old.shape is not None:
                new.shape = old.shape
            name = old.name
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            old.name = None
            new.name = name
        graph.remove(node, safe=True)


def ints_attr(node: ir.Node, name: str, default: list[int] | None = None) -> list[int] | None:
    """The ints attribute ``name`` of ``node`` as a list, or ``default`` where the node has none."""
    a = node.attributes.get(name)
    return list(a.as_ints()) if a is not None else default
