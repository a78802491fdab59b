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
- otherwise (an inference graph, a value computed from constants only, or an integer or bool value,
  which ORT never differentiates): the marker goes. (One ATen ``detach`` reading an integer beside
  one reading a float made ORT's one gradient definition per op conflict: DeBERTa-v2's
  ``.detach()`` of its relative positions.)
"""

from __future__ import annotations

import onnx_ir as ir

from ..graph.names import ATEN_DOMAIN, ORTWRAP_DOMAIN, STATE_PREFIX, STOP_GRADIENT_SUFFIX
from ..graph.nodes import aten_node

#: graph names of parameters and buffers: fed by ortwrap, so a frozen duplicate can be fed the same
#: tensor. A user input goes the ATen route like a computed value.


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
            if src is not None and src.is_graph_input() and src.name.startswith(STATE_PREFIX):
                dup = frozen.get(src.name)
                if dup is None:
                    dup = ir.Value(name=f"{src.name}{STOP_GRADIENT_SUFFIX}", type=src.type, shape=src.shape)
                    graph.inputs.append(dup)
                    frozen[src.name] = dup
                _replace(graph, node, dup)
            elif self.with_backward and not _integer(src) and _reads_graph_inputs(src):
                detach = aten_node(
                    "detach",
                    [src],
                    dtypes=[src.dtype],
                    shapes=[src.shape],
                    name=f"{node.name or src.name}/ortwrap_detach",
                )
                graph.insert_before(node, detach)
                _replace(graph, node, detach.outputs[0])
                model.opset_imports.setdefault(ATEN_DOMAIN, 1)
                graph.opset_imports.setdefault(ATEN_DOMAIN, 1)
            else:
                _replace(graph, node, src)
            graph.remove(node, safe=True)
            modified = True
        if modified and not any(n.domain == ORTWRAP_DOMAIN for n in graph.all_nodes()):
            model.opset_imports.pop(ORTWRAP_DOMAIN, None)
            graph.opset_imports.pop(ORTWRAP_DOMAIN, None)
        return ir.passes.PassResult(model, modified=modified)


def _integer(value: ir.Value | None) -> bool:
    """Whether ``value`` is known to hold integers or bools."""
    dtype = value.dtype if value is not None else None
    return dtype is not None and (dtype.is_integer() or dtype == ir.DataType.BOOL)


def _replace(graph: ir.Graph, node: ir.Node, new: ir.Value) -> None:
    """Point the uses of the marker's output at ``new``. A graph output (``return x.detach()``) keeps
    its name, through an ``Identity`` of ``new`` (which may be a graph input itself)."""
    old = node.outputs[0]
    _unify_dims(graph, old.shape, new.shape)
    if not old.is_graph_output():
        old.replace_all_uses_with(new)
        return
    ident = ir.node("Identity", [new], name=f"{node.name or old.name}/ortwrap_output")
    out = ident.outputs[0]
    out.dtype, out.shape = old.dtype, old.shape
    graph.insert_before(node, ident)
    name, old.name = old.name, None
    # NOTE: the graph's own nodes read ``new``, only the graph output reads the Identity: an output
    # that nodes also read gets an "external" gradient input from ORT's builder, which its YieldOp
    # does not yield for an output with no gradient (session creation failed).
    for user, index in list(old.uses()):
        user.replace_input_with(index, new)
    old.replace_all_uses_with(out, replace_graph_outputs=True)
    out.name = name


def _unify_dims(graph: ir.Graph, old: ir.Shape | None, new: ir.Shape | None) -> None:
    """The marker's output is its input: a symbolic dim the exporter named after the marker's output
    (TorchScript names each op's unknown dims afresh) is the input's dim everywhere in the graph.
    Left distinct, ORT's gradient builder could not match the broadcast dims of a later op."""
    if old is None or new is None or len(old) != len(new):
        return
    rename = {
        a.value: b
        for a, b in zip(old, new)
        if isinstance(a, ir.SymbolicDim)
        and a.value is not None
        and (not isinstance(b, ir.SymbolicDim) or b.value != a.value)
    }
    if not rename:
        return
    for node in graph:
        for value in node.outputs:
            shape = value.shape
            if shape is not None and any(isinstance(d, ir.SymbolicDim) and d.value in rename for d in shape):
                value.shape = ir.Shape(
                    [rename[d.value] if isinstance(d, ir.SymbolicDim) and d.value in rename else d for d in shape]
                )


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
