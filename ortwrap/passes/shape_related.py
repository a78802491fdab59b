"""Find the nodes that compute values which kernels read on the host (shapes, axes, counts).

An analysis, not a rewrite: it changes nothing and returns node names. A placement pass can put
these nodes on CPU so that ``Reshape``/``Expand``/``Slice``/... get their shape inputs without a
device-to-host copy and a stream synchronization per call (ORT PR #19769, "aggressive CPU fallback";
TVM PR #7210 measured the same copies as a MaskRCNN bottleneck).

How it works
============

1. :data:`HOST_INPUTS` is a data table, keyed by ``(domain, op_type)`` and opset range, saying per
   input index what a kernel needs of it (TVM PR #7210's per-input data dependence instead of
   one flag per op, and instead of ORT PR #19769's five hard-coded ops):

   * ``shape``: the kernel reads the *values* on the host, and they are shape-like (shapes,
     starts/ends, axes, counts, sizes). These inputs start the backward walk.
   * ``host_data``: ORT's CUDA kernel reads them on the host too, but they are data, not
     shapes (``Pad`` ``constant_value``, ``Resize`` ``roi``, ``OneHot`` ``values``,
     ``NonMaxSuppression`` thresholds). They do **not** start a walk; see "Decisions".
   * ``metadata``: only the input's shape/type is read, never its values (``Shape``, ``Size``,
     ``EyeLike``, ``CastLike``'s ``target_type``). The walk never enters them, and a node all of
     whose inputs are metadata-only (``Shape``, ``Size``) is a *stop node*.

2. From every ``shape`` input of every node (subgraphs included), and from the subgraph outputs
   in :data:`HOST_SUBGRAPH_OUTPUTS` (the ``Loop`` body's condition), walk backwards through
   producers, collecting the nodes met. The walk stops at graph inputs, initializers, nodes without
   inputs (``Constant``: collected) and stop nodes (``Shape``/``Size``: collected, their input is
   not entered, so e.g. the ``MatMul`` whose output's shape is taken is not collected). The
   consumer whose input started the walk (the ``Reshape``) is not collected, unless another walk
   reaches it.

3. Control flow. Subgraphs are walked too:

   * a subgraph node that references an outer-scope value (an implicit input) is an ordinary
     producer edge in onnx_ir (the same ``ir.Value`` object), so the walk continues into the outer
     graph;
   * explicit subgraph inputs map to the owner's inputs: ``Loop`` body input ``k >= 1`` to node
     input ``k`` and to body output ``k - 1`` (the carried value); body input 0, the iteration
     counter, is made by the runtime and stops the walk; ``Scan`` (opset >= 9) state input ``k``
     to node input ``k`` and body output ``k``, scan input ``k`` to node input ``k``;
   * a value produced by ``If``/``Loop``/``Scan`` collects that node and continues at the
     matching subgraph output(s) (both ``If`` branches; for ``Loop`` also the initial value).

Names
=====

Top-level nodes are reported by their ``name``. A node inside a subgraph is reported by its
scope path: owner name, graph attribute name and inner name joined with :data:`SCOPE_SEPARATOR`,
e.g. ``"if_0|then_branch|reshape_1"``, nested as deep as needed. A node without a name is
reported as ``"<OpType>#<position in its graph>"`` (inside a scope path as well). Nodes in
model-local functions are not analyzed.

Decisions
=========

* **Mixed nodes.** A collected node whose output also feeds device computation (a consumer input
  that is neither shape-like, host-read nor metadata-only, of a node that is not itself collected;
  or a main-graph output) is still returned: the host needs its value either way, and a
  host-to-device copy of a small integer tensor is asynchronous, while the device-to-host copy
  it replaces synchronizes the stream. It is flagged ``mixed`` in
  :func:`explain_shape_related_nodes`, with the device uses listed, so that a placement pass can
  decide otherwise (e.g. keep a mixed node on the device when its inputs are large tensors, and
  pay one copy).
* **``Pad`` ``constant_value``** (and the other ``host_data`` inputs) is data, not shape: a fill
  value does not determine the output's shape. ORT's CUDA ``Pad`` kernel does read it on the host,
  but walking from it would move whatever computes the fill value (possibly a reduction over a
  large tensor) to the CPU for a one-element copy. It is recorded in the table for completeness,
  and not walked.
* ``If`` ``cond`` and ``Loop`` ``M``/``cond`` are treated as shape-like: they decide control flow
  on the host (ORT's CUDA kernels declare them CPU inputs), and exporters compute them from shapes.

Sources
=======

Input indices and names: the ONNX operator schemas (``onnx.defs.get_schema(op, opset).inputs``);
``tests/test_shape_related.py`` checks every table entry against them at the first and last
opset of its range. Cross-checked against ``InputMemoryType(OrtMemTypeCPUInput, i)`` in ORT's
CUDA kernel registrations (``microsoft/onnxruntime``, ``onnxruntime/core/providers/cuda/``),
read for: ``tensor/reshape.cc`` (Reshape 1), ``tensor/expand.cc`` (Expand 1),
``generator/constant_of_shape.cc`` (ConstantOfShape 0), ``tensor/slice.cc`` (Slice 1-4, opset
>= 10), ``generator/range.cc`` (Range 0, 1, 2; older revisions copied them with ``cudaMemcpy``),
``tensor/tile.cc`` (Tile 1), ``tensor/squeeze.cc`` and ``tensor/unsqueeze.cc`` (axes 1, opset 13),
``reduction/reduction_ops.cc`` (``REGISTER_KERNEL_TYPED_AXES_INPUT``: axes 1), ``tensor/split.cc``
(Split 1, opset 13), ``tensor/pad.cc`` (Pad 1 and 2, opset 11), ``tensor/resize.cc`` (Resize 1 at
opset 10; 1, 2, 3 from opset 11), ``tensor/upsample.cc`` (Upsample 1, opsets 7-9),
``math/topk.cc`` (TopK 1), ``tensor/onehot.cc`` (OneHot 1 and 2),
``object_detection/non_max_suppression.cc`` (2, 3, 4), ``tensor/trilu.cc`` (Trilu 1),
``math/cumsum.cc`` (CumSum 1), ``controlflow/if.cc`` (If 0), ``controlflow/loop.cc`` (Loop 0, 1).
Not verified there: Pad ``axes`` (index 3, opset 18; the revision read predates it). The
``metadata`` entries come from the ONNX schemas' descriptions only.

No ``com.microsoft`` entries: the graphs analyzed here come from the exporter, before ORT's
gradient builder adds training ops such as ``SliceGrad``; the table is keyed by domain, so they can
be added with their contrib schemas as the source.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import onnx
import onnx_ir as ir

#: Joins owner node, graph attribute and inner node names for nodes inside subgraphs.
SCOPE_SEPARATOR = "|"


@dataclass(frozen=True)
class HostInputs:
    """What a kernel needs of each input, for one op over an opset range.

    Attributes:
        since: first opset version (of the op's domain) the entry applies to.
        until: last opset version it applies to, inclusive; ``None`` for "still current".
        shape: input index -> schema name, for inputs whose values are read on the host and are
            shape-like. The backward walk starts from these.
        host_data: input index -> schema name, for inputs read on the host that are data values.
            Not walked.
        metadata: input index -> schema name, for inputs of which only the shape/type is read.
            Never walked into.
    """

    since: int
    until: int | None = None
    shape: Mapping[int, str] = field(default_factory=dict)
    host_data: Mapping[int, str] = field(default_factory=dict)
    metadata: Mapping[int, str] = field(default_factory=dict)

    def covers(self, opset: int) -> bool:
        return self.since <= opset and (self.until is None or opset <= self.until)


_AXES = {1: "axes"}

#: (domain, op_type) -> entries by opset range. An op absent here, or at an opset no entry covers,
#: has only device inputs. See the module docstring for the sources.
HOST_INPUTS: dict[tuple[str, str], tuple[HostInputs, ...]] = {
    ("", "Reshape"): (HostInputs(5, shape={1: "shape"}),),
    ("", "Expand"): (HostInputs(8, shape={1: "shape"}),),
    ("", "ConstantOfShape"): (HostInputs(9, shape={0: "input"}),),
    # Slice-1..9 take starts/ends/axes as attributes.
    ("", "Slice"): (HostInputs(10, shape={1: "starts", 2: "ends", 3: "axes", 4: "steps"}),),
    ("", "Range"): (HostInputs(11, shape={0: "start", 1: "limit", 2: "delta"}),),
    ("", "Tile"): (HostInputs(6, shape={1: "repeats"}),),
    # Squeeze/Unsqueeze-1..12 take axes as an attribute.
    ("", "Squeeze"): (HostInputs(13, shape=_AXES),),
    ("", "Unsqueeze"): (HostInputs(13, shape=_AXES),),
    ("", "ReduceSum"): (HostInputs(13, shape=_AXES),),
    **{
        ("", op): (HostInputs(18, shape=_AXES),)
        for op in (
            "ReduceL1",
            "ReduceL2",
            "ReduceLogSum",
            "ReduceLogSumExp",
            "ReduceMax",
            "ReduceMean",
            "ReduceMin",
            "ReduceProd",
            "ReduceSumSquare",
        )
    },
    ("", "Split"): (HostInputs(13, shape={1: "split"}),),
    ("", "Pad"): (
        HostInputs(11, 17, shape={1: "pads"}, host_data={2: "constant_value"}),
        HostInputs(18, shape={1: "pads", 3: "axes"}, host_data={2: "constant_value"}),
    ),
    ("", "Resize"): (
        HostInputs(10, 10, shape={1: "scales"}),
        HostInputs(11, shape={2: "scales", 3: "sizes"}, host_data={1: "roi"}),
    ),
    # Upsample-7 takes scales as an attribute; deprecated from opset 10 (the schema remains).
    ("", "Upsample"): (HostInputs(9, shape={1: "scales"}),),
    ("", "TopK"): (HostInputs(10, shape={1: "K"}),),
    ("", "OneHot"): (HostInputs(9, shape={1: "depth"}, host_data={2: "values"}),),
    ("", "NonMaxSuppression"): (
        HostInputs(
            10,
            shape={2: "max_output_boxes_per_class"},
            host_data={3: "iou_threshold", 4: "score_threshold"},
        ),
    ),
    ("", "Trilu"): (HostInputs(14, shape={1: "k"}),),
    ("", "CumSum"): (HostInputs(11, shape={1: "axis"}),),
    ("", "If"): (HostInputs(1, shape={0: "cond"}),),
    ("", "Loop"): (HostInputs(1, shape={0: "M", 1: "cond"}),),
    # Metadata only: the values of these inputs are never read.
    ("", "Shape"): (HostInputs(1, metadata={0: "data"}),),
    ("", "Size"): (HostInputs(1, metadata={0: "data"}),),
    ("", "EyeLike"): (HostInputs(9, metadata={0: "input"}),),
    ("", "CastLike"): (HostInputs(15, metadata={1: "target_type"}),),
}

#: (domain, op_type) -> graph attribute -> subgraph output index -> name, for subgraph outputs the
#: control-flow kernel itself reads on the host: the ``Loop`` body's continuation condition
#: (ORT's CUDA ``Loop`` runs the CPU implementation, which reads it after every iteration).
HOST_SUBGRAPH_OUTPUTS: dict[tuple[str, str], dict[str, dict[int, str]]] = {
    ("", "Loop"): {"body": {0: "cond"}},
}

_NO_HOST_INPUTS = HostInputs(0)


def _domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def host_inputs(domain: str, op_type: str, opset: int | None) -> HostInputs:
    """The :data:`HOST_INPUTS` entry for an op at an opset, or an empty entry if none applies."""
    if opset is None:
        return _NO_HOST_INPUTS
    for entry in HOST_INPUTS.get((_domain(domain), op_type), ()):
        if entry.covers(opset):
            return entry
    return _NO_HOST_INPUTS


@dataclass(frozen=True)
class ShapeRelatedNode:
    """Why one node is shape-related.

    Attributes:
        name: the reported name (see "Names" in the module docstring).
        op_type: the node's op type.
        reasons: the host inputs whose backward walk reached this node, as
            ``"<consumer> input <index> (<schema name>)"``, sorted.
        device_uses: uses of this node's outputs that need the value on the device, as
            ``"<consumer> input <index>"`` or ``"graph output <value name>"``, sorted.
    """

    name: str
    op_type: str
    reasons: tuple[str, ...]
    device_uses: tuple[str, ...] = ()

    @property
    def mixed(self) -> bool:
        """True if the node's outputs also feed device computation."""
        return bool(self.device_uses)


def shape_related_nodes(model: onnx.ModelProto) -> set[str]:
    """Names of the nodes that compute values kernels read on the host.

    Args:
        model: the model to analyze; it is not modified.

    Returns:
        Node names, subgraph nodes as scope paths (see the module docstring), mixed nodes
        included.
    """
    return set(explain_shape_related_nodes(model))


def explain_shape_related_nodes(model: onnx.ModelProto) -> dict[str, ShapeRelatedNode]:
    """Like :func:`shape_related_nodes`, with the reasons for each node and its device uses.

    Args:
        model: the model to analyze; it is not modified.

    Returns:
        Reported node name -> :class:`ShapeRelatedNode`.
    """
    return _Analysis(ir.serde.deserialize_model(model)).run()


def node_subgraphs(node: ir.Node) -> list[tuple[str, ir.Graph]]:
    """``(attribute name, graph)`` for every subgraph attribute of ``node`` (If/Loop/Scan bodies)."""
    found: list[tuple[str, ir.Graph]] = []
    for attr in node.attributes.values():
        if not isinstance(attr, ir.Attr):
            continue
        if attr.type == ir.AttributeType.GRAPH:
            found.append((attr.name, attr.value))
        elif attr.type == ir.AttributeType.GRAPHS:
            found.extend((attr.name, g) for g in attr.value)
    return found


class _Analysis:
    def __init__(self, model: ir.Model) -> None:
        self.model = model
        self.names: dict[int, str] = {}  # id(node) -> reported name
        self.owners: dict[int, tuple[ir.Node, str]] = {}  # id(subgraph) -> (owner node, attribute)
        self.nodes: list[ir.Node] = []
        self._index(model.graph, "")

    def _index(self, graph: ir.Graph, prefix: str) -> None:
        for position, node in enumerate(graph):
            name = prefix + (node.name or f"<{node.op_type}>#{position}")
            self.names[id(node)] = name
            self.nodes.append(node)
            for attr_name, subgraph in node_subgraphs(node):
                self.owners[id(subgraph)] = (node, attr_name)
                self._index(subgraph, f"{name}{SCOPE_SEPARATOR}{attr_name}{SCOPE_SEPARATOR}")

    def spec(self, node: ir.Node) -> HostInputs:
        domain = _domain(node.domain)
        opset = self.model.opset_imports.get(domain)
        if opset is None and domain == "":
            opset = self.model.opset_imports.get("ai.onnx")
        return host_inputs(domain, node.op_type, opset)

    def run(self) -> dict[str, ShapeRelatedNode]:
        reasons: dict[int, set[str]] = {}
        found: dict[int, ir.Node] = {}
        for value, reason in self._roots():
            for node in self._walk(value):
                found[id(node)] = node
                reasons.setdefault(id(node), set()).add(reason)
        return {
            self.names[key]: ShapeRelatedNode(
                name=self.names[key],
                op_type=node.op_type,
                reasons=tuple(sorted(reasons[key])),
                device_uses=tuple(sorted(self._device_uses(node, found))),
            )
            for key, node in found.items()
        }

    def _roots(self) -> Iterator[tuple[ir.Value, str]]:
        """(value read on the host, reason) for every walk to start."""
        for consumer in self.nodes:
            name = self.names[id(consumer)]
            spec = self.spec(consumer)
            for index, input_name in spec.shape.items():
                if index < len(consumer.inputs) and consumer.inputs[index] is not None:
                    yield consumer.inputs[index], f"{name} input {index} ({input_name})"
            host_outputs = HOST_SUBGRAPH_OUTPUTS.get((_domain(consumer.domain), consumer.op_type), {})
            for attr_name, outputs in host_outputs.items():
                attr = consumer.attributes.get(attr_name)
                if not isinstance(attr, ir.Attr) or attr.type != ir.AttributeType.GRAPH:
                    continue
                for index, output_name in outputs.items():
                    if index < len(attr.value.outputs):
                        reason = f"{name} {attr_name} output {index} ({output_name})"
                        yield attr.value.outputs[index], reason

    def _walk(self, start: ir.Value) -> Iterator[ir.Node]:
        """Yield each node met walking backwards from ``start``, once."""
        seen_values: set[int] = set()
        seen_nodes: set[int] = set()
        stack = [start]
        while stack:
            value = stack.pop()
            if value is None or id(value) in seen_values:
                continue
            seen_values.add(id(value))
            node = value.producer()
            if node is None:
                stack.extend(self._subgraph_input_sources(value))
                continue
            if id(node) not in seen_nodes:
                seen_nodes.add(id(node))
                yield node
            stack.extend(self._sources(node, value))

    def _sources(self, node: ir.Node, value: ir.Value) -> list[ir.Value | None]:
        """The values ``value`` (an output of ``node``) is computed from, for the walk."""
        if _domain(node.domain) == "" and node.op_type in ("If", "Loop", "Scan"):
            return self._control_flow_sources(node, value)
        metadata = self.spec(node).metadata
        return [v for i, v in enumerate(node.inputs) if i not in metadata]

    def _control_flow_sources(self, node: ir.Node, value: ir.Value) -> list[ir.Value | None]:
        index = value.index()
        if index is None:
            return []
        sources: list[ir.Value | None] = []
        if node.op_type == "If":
            for branch in ("then_branch", "else_branch"):
                attr = node.attributes.get(branch)
                if isinstance(attr, ir.Attr) and index < len(attr.value.outputs):
                    sources.append(attr.value.outputs[index])
            return sources
        body = node.attributes.get("body")
        if not isinstance(body, ir.Attr):
            return sources
        graph = body.value
        if node.op_type == "Loop":
            # Outputs: carried values (body output index + 1, initial value node input index + 2),
            # then scan outputs (body output index + 1).
            if index + 1 < len(graph.outputs):
                sources.append(graph.outputs[index + 1])
            if index + 2 < len(node.inputs):
                sources.append(node.inputs[index + 2])
        elif index < len(graph.outputs):  # Scan: outputs correspond to body outputs
            sources.append(graph.outputs[index])
        return sources

    def _subgraph_input_sources(self, value: ir.Value) -> list[ir.Value | None]:
        """For an explicit subgraph input, the owner's values it is bound to; else nothing."""
        graph = value.graph
        if graph is None or id(graph) not in self.owners or not value.is_graph_input():
            return []
        owner, _ = self.owners[id(graph)]
        k = list(graph.inputs).index(value)
        node_inputs = list(owner.inputs)
        sources: list[ir.Value | None] = []
        if owner.op_type == "Loop" and k >= 1:
            if k < len(node_inputs):
                sources.append(node_inputs[k])
            if k - 1 < len(graph.outputs):
                sources.append(graph.outputs[k - 1])
        elif owner.op_type == "Scan":
            num_scan_inputs = owner.attributes.get_int("num_scan_inputs", 0)
            num_state = len(node_inputs) - num_scan_inputs
            if k < len(node_inputs):
                sources.append(node_inputs[k])
            if k < num_state and k < len(graph.outputs):
                sources.append(graph.outputs[k])
        return sources

    def _device_uses(self, node: ir.Node, found: Mapping[int, ir.Node]) -> Iterator[str]:
        for value in node.outputs:
            if value.is_graph_output():
                graph = value.graph
                if graph is None or id(graph) not in self.owners:
                    yield f"graph output {value.name}"
                else:
                    owner, attr_name = self.owners[id(graph)]
                    host_outputs = HOST_SUBGRAPH_OUTPUTS.get((_domain(owner.domain), owner.op_type), {})
                    read_on_host = list(graph.outputs).index(value) in host_outputs.get(attr_name, {})
                    if id(owner) not in found and not read_on_host:
                        yield f"{self.names[id(owner)]} output via {value.name}"
            for usage in value.uses():
                consumer, index = usage.node, usage.idx
                if id(consumer) in found:
                    continue
                spec = self.spec(consumer)
                if index in spec.shape or index in spec.host_data or index in spec.metadata:
                    continue
                yield f"{self.names.get(id(consumer), consumer.op_type)} input {index}"
