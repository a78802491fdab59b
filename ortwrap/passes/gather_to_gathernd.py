"""Embedding lookups as ``GatherND``, whose CPU gradient is several times faster than Gather's.

ORT 1.19.2's CPU ``GatherGrad`` (the gradient of ``Gather``, so of every ``nn.Embedding``) adds
each element of the incoming gradient under one shared ``std::mutex``, from every intra-op thread:
for a 8x128 batch into a 512x256 table it took ~9 ms of a ~180 ms GPT step, the threads mostly
waiting on the lock. ``GatherNDGrad`` scatters the same sums in one plain loop (~2 ms; forward
cost unchanged; measured with ``benchmarks/profile_lm.py``). On a row lookup the two ops are the same function::

    Gather(data, indices, axis=0)  ==  GatherND(data, Unsqueeze(indices, -1))

for any data rank and any indices rank (a scalar index gives ``data.shape[1:]`` either way), with
negative indices counted from the end in both. The sums run in index order (not in the order
threads take the lock), so the gradient is deterministic.

Rewritten: ``Gather`` on axis 0 whose data is a floating-point graph input (a parameter: the only
data ORT differentiates here) and whose indices are int64 (GatherND takes no other type), unless
the indices come from ``Range``, which ORT turns into a ``Slice`` (with a cheap gradient) itself.
CPU only: the CUDA GatherGrad is a sort-based kernel without this problem.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._build import NodeBuilder

_FLOATS = {ir.DataType.FLOAT, ir.DataType.DOUBLE}


def parameter_lookup(node: ir.Node, dtypes=_FLOATS) -> tuple[ir.Value, ir.Value] | None:
    """``(table, indices)`` if ``node`` is a row lookup into a parameter: ``Gather`` on axis 0 of a
    graph input of one of ``dtypes``, by int64 indices not produced by ``Range``; else None."""
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
        return None
    axis = node.attributes.get("axis")
    if axis is not None and axis.as_int() != 0:
        return None
    table, indices = node.inputs[0], node.inputs[1]
    if table is None or indices is None or not table.is_graph_input() or table.dtype not in dtypes:
        return None
    if indices.dtype != ir.DataType.INT64:
        return None
    producer = indices.producer()
    if producer is not None and producer.op_type == "Range":
        return None
    return table, indices


class GatherToGatherNDPass(ir.passes.InPlacePass):
    """Replace ``Gather(param, int64 indices, axis=0)`` with ``GatherND(param, Unsqueeze(indices, -1))``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            lookup = parameter_lookup(node)
            if lookup is None:
                continue
            data, indices = lookup
            b = NodeBuilder(node.name or f"gather_{id(node):x}")
            rows = b.op("Unsqueeze", indices, b.const(np.array([-1], dtype=np.int64)))
            b.replace(graph, node, [b.op("GatherND", data, rows)])
            modified = True
        return ir.passes.PassResult(model, modified=modified)
