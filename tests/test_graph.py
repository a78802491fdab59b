"""ortwrap/graph/: the contract under every stage (names, the ATen node builder)."""

from __future__ import annotations

import ast
import os

import onnx_ir as ir

import ortwrap
from ortwrap.graph import names
from ortwrap.graph.nodes import aten_node

GRAPH = os.path.join(os.path.dirname(os.path.abspath(ortwrap.__file__)), "graph")


def test_aten_node_writes_the_operator_and_types_its_outputs():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.DOUBLE), shape=ir.Shape([2, 3]))
    node = aten_node("detach", [x], dtypes=[ir.DataType.DOUBLE], shapes=[ir.Shape([2, 3])], name="d")
    assert (node.domain, node.op_type, node.name) == (names.ATEN_DOMAIN, "ATen", "d")
    assert node.attributes["operator"].as_string() == "detach"
    assert node.attributes["overload_name"].as_string() == ""
    assert node.outputs[0].dtype == ir.DataType.DOUBLE and list(node.outputs[0].shape) == [2, 3]
    two = aten_node("max", [x, None], overload="dim", outputs=2, dtypes=[ir.DataType.DOUBLE])
    assert len(two.outputs) == 2 and two.outputs[1].dtype is None
    assert two.attributes["overload_name"].as_string() == "dim" and list(two.inputs) == [x, None]


def test_the_two_bool_marks_are_distinct_and_each_read_where_it_is_written():
    """An ATen node's bool-input mark and a PythonOp's are different strings (they were both
    ``BOOL_MARK``); each is written and read through graph/names.py only."""
    assert names.ATEN_BOOL_MARK != names.PYTHONOP_BOOL_MARK
    from ortwrap.bridge import aten, runner, symbolic

    assert not hasattr(aten, "BOOL_MARK") and not hasattr(runner, "BOOL_MARK") and not hasattr(symbolic, "BOOL_MARK")


def test_graph_imports_neither_torch_internals_nor_onnxruntime():
    for name in os.listdir(GRAPH):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(GRAPH, name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [("." * node.level) + (node.module or "")]
            for m in modules:
                assert not m.startswith(("onnxruntime", "torch._", "..")), f"graph/{name} imports {m}"
                assert m.split(".")[0] in ("", "__future__", "collections", "dataclasses", "typing", "os", "onnx",
                                           "onnx_ir", "numpy", "torch") or m.startswith("."), f"graph/{name}: {m}"  # fmt: skip
