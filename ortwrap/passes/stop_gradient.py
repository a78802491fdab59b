"""Resolve ``ortwrap::StopGradient(x)`` markers: no gradient flows through them.

ONNX has no stop-gradient op, and both exporters write ``detach()`` as ``Identity`` (or nothing),
which ORT's gradient builder differentiates through: silently wrong gradients. ortwrap's symbolics
and translations mark such values (``detach``/``detach_``, the padding row of an embedding) with
``ortwrap::StopGradient``, and this pass resolves each marker:

- ``x`` a graph input (a parameter): a second graph input, ``x`` + :data:`STOP_GRADIENT_SUFFIX`,
  that the runtime feeds with the *same* tensor but that is not among the inputs ORT
  differentiates: forward values are bit-identical, nothing runs per step;
- ``x`` computed, in a graph that gets a backward: ``ATen(operator="detach")``, PyTorch's own
  detach, whose only input ORT's gradient builder is told is a stop-gradient edge
  (``bridge.aten.NO_GRADIENT_OPS``); its output is a copy (the ATen bridge copies aliases);
- otherwise (an inference graph, or a value computed from constants only): the marker goes.
"""

from __future__ import annotations

import onnx_ir as ir

from ..bridge.aten import ATEN_DOMAIN
from ..export.symbolics import ORTWRAP_DOMAIN

STOP_GRADIENT_SUFFIX = "::stop_gradient"


class ResolveStopGradientPass(ir.passes.InPlacePass):
    """Resolve every ``ortwrap::StopGradient`` (see the module docstring)."""

    def __init__(self, with_backward: bool = True) -> None:
        super().__init__()
        self.with_backward = with_backward

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        frozen: dict[str, ir.Value] = {}
        modified = False
        for node in list(graph):
            if node.domain != ORTWRAP_DOMAIN or node.op_type != "StopGradient":
                continue
            src = node.inputs[0]
            if src is not None and src.is_graph_input():
                dup = frozen.get(src.name)
                if dup is None:
                    dup = ir.Value(name=f"{src.name}{STOP_GRADIENT_SUFFIX}", type=src.type, shape=src.shape)
                    graph.inputs.append(dup)
                    frozen[src.name] = dup
                node.outputs[0].replace_all_uses_with(dup)
            elif self.with_backward and _reads_graph_inputs(src):
                detach = ir.node(
                    "ATen",
                    [src],
                    {"operator": "detach", "overload_name": ""},
                    domain=ATEN_DOMAIN,
                    name=f"{node.name or src.name}/ortwrap_detach",
                )
                detach.outputs[0].dtype, detach.outputs[0].shape = src.dtype, src.shape
                graph.insert_before(node, detach)
                node.outputs[0].replace_all_uses_with(detach.outputs[0])
                model.opset_imports.setdefault(ATEN_DOMAIN, 1)
                graph.opset_imports.setdefault(ATEN_DOMAIN, 1)
            else:
                node.outputs[0].replace_all_uses_with(src)
            graph.remove(node, safe=True)
            modified = True
        if modified and not any(n.domain == ORTWRAP_DOMAIN for n in graph.all_nodes()):
            model.opset_imports.pop(ORTWRAP_DOMAIN, None)
            graph.opset_imports.pop(ORTWRAP_DOMAIN, None)
        return ir.passes.PassResult(model, modified=modified)


def _reads_graph_inputs(value: ir.Value | None) -> bool:
    """Whether ``value`` depends on a graph input (else it is computed from constants only)."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if v.is_graph_input():
            return True
        producer = v.producer()
        if producer is not None:
            stack.extend(producer.inputs)
    return False
