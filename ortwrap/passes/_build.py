"""A small helper for passes that replace one node with a few new ones."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


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


def constant_value(value: ir.Value | None) -> np.ndarray | None:
    """The value of a tensor computed from constants only (Constant, Concat, Cast, Identity)."""
    if value is None:
        return None
    if value.const_value is not None:
        # NOTE: a writable copy, whatever the storage (raw bytes, a read-only mapping, a torch
        # tensor): callers may use numpy's iterators and in-place operations on it.
        return np.array(value.const_value.numpy())
    node = value.producer()
    if node is None:
        return None
    if node.op_type == "Constant" and "value" in node.attributes:
        return np.array(node.attributes["value"].as_tensor().numpy())
    if node.op_type == "Constant" and "value_float" in node.attributes:
        return np.array(node.attributes["value_float"].as_float(), dtype=np.float32)
    if node.op_type == "Constant" and "value_int" in node.attributes:
        return np.array(node.attributes["value_int"].as_int(), dtype=np.int64)
    if node.op_type == "Constant" and "value_floats" in node.attributes:
        return np.array(node.attributes["value_floats"].as_floats(), dtype=np.float32)
    if node.op_type == "Constant" and "value_ints" in node.attributes:
        return np.array(node.attributes["value_ints"].as_ints(), dtype=np.int64)
    if node.op_type not in ("Concat", "Identity", "Cast"):
        return None  # before recursing: walking every producer up a deep graph takes exponential time
    args = [constant_value(v) for v in node.inputs]
    if any(a is None for a in args):
        return None
    if node.op_type == "Concat":
        return np.concatenate(args, axis=node.attributes["axis"].as_int())
    if node.op_type == "Identity":
        return args[0]
    if node.op_type == "Cast":
        return args[0].astype(ir.DataType(node.attributes["to"].as_int()).numpy())
    return None
