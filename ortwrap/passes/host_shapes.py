"""Split the shape computations off the forward graph into a host-side shape program.

The aggressive CPU fallback (issue 5; ORT PR #19769, never merged). On a GPU, a kernel that reads
a shape-like input (``Reshape``'s shape, ``Slice``'s starts, ``Range``'s limit, ...) needs its
value on the host; when the nodes computing it run on the device, every step pays a
device-to-host copy and a stream synchronization. ORT 1.19.2 places on the CPU only the chains
that start at ``Shape``/``Size``, walking forward; chains that start at graph inputs (dims fed as
int64 tensors, as dynamo-captured graphs do) run on the device.

This pass takes the nodes :func:`~ortwrap.passes.shape_related.explain_shape_related_nodes`
finds and moves the ones the host can compute *before the graph runs* out of the graph:

* **Host sources.** ``Shape``/``Size`` of a user input become *python feeds*: computed from
  ``tensor.shape`` (honouring ``Shape``'s ``start``/``end``) without reading the tensor, which may
  stay on the device. Integer and bool user inputs may be read by value (dims fed as tensors).
  Constants and initializers are copied. ``Shape``/``Size`` of a parameter or buffer with a static
  shape counts as a constant.
* **Host nodes.** A shape-related node in the main graph (not inside a subgraph: an ``If``
  moves whole or not at all) moves when every value it reads, explicitly or from inside its
  subgraphs, is a host source or the output of another moved node, it is a standard ONNX op that
  is not random, and none of its outputs is a graph output. Nodes that depend on no runtime
  value at all (``Constant`` axes, ...) are *not* moved: ORT folds them into initializers and
  its static shape inference needs them there; they are copied into the shape program where a
  moved node reads them.
* **Kept.** Everything else stays, with the reason recorded: chiefly nodes downstream of a
  ``Shape`` of an intermediate value (``x.shape`` of an activation), whose value the host cannot
  know before the device computes the activation. ORT's own placement already puts those
  Shape-rooted chains on the CPU.

The moved nodes form the *shape program*, an ONNX model whose inputs are the python feeds and
the integer user inputs it reads, and whose outputs are the values that cross back into the main
graph. In the main graph each crossing value becomes a new int64 (or bool, ...) graph input with
the same name, type and shape, that no gradient flows to. At run time the shape program runs on
CPUExecutionProvider before each forward, and its outputs are fed as CPU tensors: ORT's CUDA
kernels declare shape inputs as CPU inputs, so no copy is needed for them.

Mixed nodes
===========

A moved node whose output also feeds device computation (``mixed`` in the analysis: say the
sequence length used both as ``Reshape``'s shape and, cast to float, as a scale) is moved like
any other, and the crossing value feeds both consumers: the device consumer gets a host-to-device
copy of a few int64 values, which ORT issues asynchronously, while keeping the node on the
device would cost a device-to-host copy that synchronizes the stream. This is the analysis'
position. The case it leaves open, a mixed node whose *inputs* are large device tensors, cannot
arise here: the host sources above never include device data (float user inputs, parameters,
activations), so such a node is kept on the device.

Numerics are unchanged: the moved nodes run the same ONNX kernels on the CPU, and on a CPU-only
machine everything ran on the CPU before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from ..errors import PassError
from ..graph.host_shapes import HostFeed, HostPlacement, HostShapeSplit, shape_slice
from .shape_related import SCOPE_SEPARATOR, ShapeRelatedNode, _Analysis, _domain, node_subgraphs

__all__ = ["HostFeed", "HostPlacement", "HostShapeSplit", "HostShapeSplitPass", "split_host_shapes"]

#: Ops never moved: their results would change if the host computed them (random draws).
_NOT_MOVABLE = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"}
)

_INTEGER_TYPES = frozenset(
    {
        ir.DataType.INT8,
        ir.DataType.INT16,
        ir.DataType.INT32,
        ir.DataType.INT64,
        ir.DataType.UINT8,
        ir.DataType.UINT16,
        ir.DataType.UINT32,
        ir.DataType.UINT64,
        ir.DataType.BOOL,
    }
)


@dataclass
class SplitResult(ir.passes.PassResult):
    """The pass's result: the rewritten model and the host shape program it split off."""

    split: HostShapeSplit = field(default_factory=lambda: HostShapeSplit())


class HostShapeSplitPass(ir.passes.InPlacePass):
    """Move host-computable shape-related nodes out of the main graph (see the module docstring).

    Its result (:class:`SplitResult`) carries the shape program, the feeds and the report.

    Args:
        user_inputs: names of the graph inputs fed by the user (the others are parameters and
            buffers); ``None`` means every graph input.
    """

    def __init__(self, user_inputs: set[str] | None = None) -> None:
        super().__init__()
        self.user_inputs = user_inputs

    def call(self, model: ir.Model) -> SplitResult:
        self._check(model)
        split = _Plan(model, self.user_inputs).split()
        return SplitResult(model, modified=bool(split.feeds), split=split)

    def _check(self, model: ir.Model) -> None:
        names = {v.name for v in model.graph.inputs}
        if self.user_inputs is not None:
            missing = sorted(set(self.user_inputs) - names)
            if missing:
                raise PassError(
                    f"HostShapeSplitPass: user input(s) {missing} are not inputs of the graph; its inputs are {sorted(names)}"
                )
        seen: set[str] = set()
        for node in model.graph:
            if node.name and node.name in seen:
                raise PassError(
                    f"HostShapeSplitPass: two nodes are named {node.name!r}; the report names nodes, so names must be unique"
                )
            if node.name:
                seen.add(node.name)


def split_host_shapes(
    model: onnx.ModelProto, user_inputs: set[str] | None = None, *, infer_shapes: bool = True
) -> tuple[onnx.ModelProto, HostShapeSplit]:
    """Split ``model`` into a main graph and a host shape program.

    Args:
        model: the forward graph; it is not modified.
        user_inputs: graph inputs fed by the user; ``None`` means all of them.
        infer_shapes: run ONNX shape inference first (the crossing values need types).

    Returns:
        The main model (with one new input per crossing value) and the :class:`HostShapeSplit`.

    Raises:
        PassError: for an unknown user input name or duplicate node names.
    """
    if infer_shapes:
        model = onnx.shape_inference.infer_shapes(model)
    ir_model = ir.serde.deserialize_model(model)
    p = HostShapeSplitPass(user_inputs)
    result = p(ir_model)
    return ir.serde.serialize_model(result.model), result.split


# ---------------------------------------------------------------------------------------------- planning


def _subgraph_nodes(node: ir.Node) -> list[ir.Node]:
    return [n for _, g in node_subgraphs(node) for n in g.all_nodes()]


def _shape_slice(node: ir.Node) -> tuple[int, int | None]:
    start = node.attributes.get_int("start", 0)
    end_attr = node.attributes.get("end")
    return start, (end_attr.as_int() if isinstance(end_attr, ir.Attr) else None)


def _static_dims(value: ir.Value) -> list[int] | None:
    if value.shape is None or not value.shape.is_static():
        return None
    return [int(d) for d in value.shape]


class _Plan:
    """Decides each shape-related node's placement, then rewrites the graph and builds the program."""

    def __init__(self, model: ir.Model, user_inputs: set[str] | None) -> None:
        self.model = model
        self.graph = model.graph
        self.user_inputs = {v.name for v in self.graph.inputs} if user_inputs is None else set(user_inputs)
        analysis = _Analysis(model)
        self.report: dict[str, ShapeRelatedNode] = analysis.run()
        self.name_of = {id(n): analysis.names[id(n)] for n in self.graph}
        self.top = list(self.graph)
        self.position = {id(n): i for i, n in enumerate(self.top)}
        self.owner = _owners(self.graph)
        # Values read from inside a top-level node's subgraphs that live in the main graph.
        self.captured: dict[int, list[ir.Value]] = {}
        for n in self.top:
            inner = {id(m) for m in _subgraph_nodes(n)}
            if inner:
                self.captured[id(n)] = [
                    v
                    for m in _subgraph_nodes(n)
                    for v in m.inputs
                    if v is not None
                    and v.graph is self.graph
                    and (v.producer() is None or id(v.producer()) not in inner)
                ]

    # -- classification -------------------------------------------------------------------------
    def _classify(self, barred: set[int]) -> tuple[dict[int, str], dict[int, str]]:
        """The placement of each top-level shape-related node, and why the kept ones stay."""
        kind: dict[int, str] = {}
        runtime: dict[int, bool] = {}
        why: dict[int, str] = {}
        outputs = {id(v) for v in self.graph.outputs}
        for node in self.top:
            name = self.name_of[id(node)]
            if name not in self.report:
                continue
            key = id(node)
            if key in barred:
                why[key] = "an output crossing back into the main graph has no inferred type"
                continue
            if _domain(node.domain) != "":
                why[key] = f"op {node.domain}::{node.op_type} runs only in the main graph"
                continue
            if node.op_type in _NOT_MOVABLE:
                why[key] = f"{node.op_type} draws random numbers; the host would draw different ones"
                continue
            if any(id(v) in outputs for v in node.outputs):
                why[key] = "its output is a graph output"
                continue
            if node.op_type in ("Shape", "Size") and node.inputs and node.inputs[0] is not None:
                src = node.inputs[0]
                if src.is_graph_input() and src.name in self.user_inputs:
                    kind[key], runtime[key] = "python", True
                    continue
                if src.is_graph_input() and _static_dims(src) is not None:
                    kind[key], runtime[key] = "constant", False
                    continue
                if src.is_graph_input():
                    why[key] = f"{node.op_type} of parameter/buffer {src.name!r}, whose shape is not static"
                else:
                    why[key] = (
                        f"{node.op_type} of the intermediate value {src.name!r}: its shape is known only when the "
                        "device computes it (ORT places Shape-rooted chains on the CPU itself)"
                    )
                continue
            reads = [v for v in node.inputs if v is not None] + self.captured.get(key, [])
            blocker = None
            depends = False
            for v in reads:
                ok, rt, reason = self._source(v, kind, runtime)
                if not ok:
                    blocker = reason
                    break
                depends = depends or rt
            if blocker is not None:
                why[key] = blocker
                continue
            kind[key] = "host" if depends else "constant"
            runtime[key] = depends
        return kind, why

    def _source(self, v: ir.Value, kind: Mapping[int, str], runtime: Mapping[int, bool]) -> tuple[bool, bool, str]:
        """(available on the host, depends on runtime values, reason if not available)."""
        producer = v.producer()
        if producer is not None:
            if id(producer) in kind:
                return True, runtime[id(producer)], ""
            pname = self.name_of.get(id(producer), producer.op_type)
            if pname in self.report:
                return False, False, f"reads {v.name!r} from {pname!r}, which stays in the main graph"
            return False, False, f"reads {v.name!r}, computed on the device by {pname!r}"
        if v.is_initializer() or v.const_value is not None:
            return True, False, ""
        if v.is_graph_input():
            if v.name not in self.user_inputs:
                return False, False, f"reads parameter/buffer {v.name!r} by value"
            if v.dtype not in _INTEGER_TYPES:
                return (
                    False,
                    False,
                    f"reads the {v.dtype.name if v.dtype else 'untyped'} input {v.name!r} by value (device data)",
                )
            return True, True, ""
        return False, False, f"reads {v.name!r}, which has no producer in the main graph"

    # -- the split --------------------------------------------------------------------------------
    def split(self) -> HostShapeSplit:
        barred: set[int] = set()
        while True:
            kind, why = self._classify(barred)
            moved = {k for k, p in kind.items() if p in ("host", "python")}
            crossing = self._crossing(moved)
            untyped = {id(v.producer()) for v in crossing if v.type is None}
            if not untyped:
                break
            barred |= untyped
        placements = self._placements(kind, why)
        if not moved:
            return HostShapeSplit(placements=placements)
        host_nodes = [n for n in self.top if kind.get(id(n)) == "host"]
        copied = self._needed_constants(host_nodes, kind)
        program, program_inputs, out_index = self._program(kind, host_nodes, copied, crossing)
        feeds = self._rewrite_main(kind, crossing, out_index, program_inputs)
        return HostShapeSplit(program, tuple(program_inputs), tuple(feeds), placements)

    def _crossing(self, moved: set[int]) -> list[ir.Value]:
        """Outputs of moved nodes read by nodes (or subgraph nodes) that stay in the main graph."""
        out: list[ir.Value] = []
        for n in self.top:
            if id(n) not in moved:
                continue
            for v in n.outputs:
                if any(id(self.owner.get(id(u.node), u.node)) not in moved for u in v.uses()):
                    out.append(v)
        return out

    def _placements(self, kind: Mapping[int, str], why: Mapping[int, str]) -> dict[str, HostPlacement]:
        by_name = {self.name_of[id(n)]: n for n in self.top}
        order = {name: i for i, name in enumerate(by_name)}
        out: dict[str, HostPlacement] = {}
        # In graph order; nodes inside subgraphs after their owner.
        names = sorted(self.report, key=lambda k: (order.get(k.split(SCOPE_SEPARATOR, 1)[0], len(order)), k))
        for name in names:
            info = self.report[name]
            node = by_name.get(name)
            if node is None:  # inside a subgraph: travels with its top-level owner
                owner_name = name.split(SCOPE_SEPARATOR, 1)[0]
                owner = by_name.get(owner_name)
                owner_kind = kind.get(id(owner)) if owner is not None else None
                placement = owner_kind if owner_kind in ("host", "constant") else "subgraph"
                reason = "" if placement != "subgraph" else f"inside {owner_name!r}, which stays in the main graph"
            else:
                placement = kind.get(id(node), "kept")
                reason = why.get(id(node), "")
            out[name] = HostPlacement(name, info.op_type, placement, info.reasons, info.device_uses, reason)
        return out

    def _needed_constants(self, host_nodes: list[ir.Node], kind: Mapping[int, str]) -> set[int]:
        """Constant-only nodes the moved nodes read (transitively)."""
        needed: set[int] = set()
        stack = [
            v for n in host_nodes for v in (*[x for x in n.inputs if x is not None], *self.captured.get(id(n), []))
        ]
        while stack:
            v = stack.pop()
            p = v.producer()
            if p is None or kind.get(id(p)) != "constant" or id(p) in needed:
                continue
            needed.add(id(p))
            stack.extend(x for x in p.inputs if x is not None)
            stack.extend(self.captured.get(id(p), []))
        return needed

    def _program(
        self, kind: Mapping[int, str], host_nodes: list[ir.Node], copied: set[int], crossing: list[ir.Value]
    ) -> tuple[onnx.ModelProto | None, list[HostFeed], dict[str, int]]:
        """Build the shape program from a clone of the model; return it, its inputs and the index
        of each crossing value among its outputs."""
        program_outputs = [v for v in crossing if kind.get(id(v.producer())) == "host"]
        if not host_nodes:
            return None, [], {}
        clone = self.model.clone()
        cg = clone.graph
        cnodes = list(cg)
        keep_ids = {id(n) for n in host_nodes} | copied
        keep = [cnodes[self.position[k]] for k in (id(n) for n in self.top) if k in keep_ids]
        keep_set = {id(n) for n in keep}
        clone_owner = _owners(cg)

        def kept(node: ir.Node) -> bool:
            owner = clone_owner.get(id(node))
            return id(node) in keep_set or (owner is not None and id(owner) in keep_set)

        inputs: list[ir.Value] = []
        feeds: list[HostFeed] = []
        # Python feeds (Shape/Size of user inputs) read by moved nodes become program inputs;
        # Shape/Size of static parameters become Constants.
        for i, n in enumerate(self.top):
            k = kind.get(id(n))
            if n.op_type not in ("Shape", "Size") or k not in ("python", "constant"):
                continue
            c = cnodes[i]
            out = c.outputs[0]
            users = [u for u in out.uses() if kept(u.node)]
            if not users:
                continue
            if k == "python":
                new = ir.Value(name=out.name, type=out.type, shape=out.shape)
                start, end = _shape_slice(n)
                feeds.append(_python_feed(n, out.name, start, end))
                inputs.append(new)
            else:
                dims = _static_dims(n.inputs[0])
                assert dims is not None
                arr = _apply_shape(n, dims)
                const = ir.node("Constant", [], attributes={"value": ir.tensor(arr)}, name=f"{c.name}/static")
                cg.insert_before(c, const)
                keep_set.add(id(const))
                keep_set.discard(id(c))
                new = const.outputs[0]
            for u in users:
                u.node.replace_input_with(u.idx, new)
        # Integer user inputs read by value stay program inputs.
        for v in cg.inputs:
            if any(kept(u.node) for u in v.uses()):
                inputs.append(v)
                feeds.append(HostFeed(v.name, "value", v.name))
        cg.outputs.clear()
        cg.outputs.extend(cnodes[self.position[id(v.producer())]].outputs[v.index()] for v in program_outputs)
        _drop(cg, [n for n in cg if id(n) not in keep_set])
        cg.inputs.clear()
        cg.inputs.extend(inputs)
        for name in [k for k, v in cg.initializers.items() if not v.uses()]:
            del cg.initializers[name]
        cg.name = "ortwrap_host_shapes"
        proto = ir.serde.serialize_model(clone)
        del proto.graph.value_info[:]
        return proto, feeds, {v.name: i for i, v in enumerate(program_outputs)}

    def _rewrite_main(
        self,
        kind: Mapping[int, str],
        crossing: list[ir.Value],
        out_index: Mapping[str, int],
        program_inputs: list[HostFeed],
    ) -> list[HostFeed]:
        """Turn each crossing value into a main-graph input; remove the moved nodes and the
        constants nothing reads any more."""
        python = {f.name: f for f in program_inputs}
        feeds: list[HostFeed] = []
        for v in crossing:
            producer = v.producer()
            name = v.name
            new = ir.Value(name=name, type=v.type, shape=v.shape)
            v.name = f"{name}::moved"
            for u in v.uses():
                owner = self.owner.get(id(u.node), u.node)
                if kind.get(id(owner)) not in ("host", "python"):
                    u.node.replace_input_with(u.idx, new)
            self.graph.inputs.append(new)
            if kind.get(id(producer)) == "python":
                start, end = _shape_slice(producer)
                feeds.append(python.get(name) or _python_feed(producer, name, start, end))
            else:
                feeds.append(HostFeed(name, "program", index=out_index[name]))
        moved = [n for n in self.top if kind.get(id(n)) in ("host", "python")]
        _drop(self.graph, moved)
        # Constants that only moved nodes read.
        for n in reversed(list(self.graph)):
            if kind.get(id(n)) == "constant" and not any(v.uses() or v.is_graph_output() for v in n.outputs):
                _drop(self.graph, [n])
        return feeds


def _drop(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove ``nodes`` from ``graph``, first detaching their inputs and those of the nodes in
    their subgraphs (which ``Graph.remove(safe=True)`` would count as remaining users)."""
    for n in nodes:
        for m in (n, *_subgraph_nodes(n)):
            for i in range(len(m.inputs)):
                m.replace_input_with(i, None)
    graph.remove(nodes, safe=False)


def _owners(graph: ir.Graph) -> dict[int, ir.Node]:
    """id(node inside a subgraph) -> the top-level node of ``graph`` that holds it."""
    return {id(inner): n for n in graph for inner in _subgraph_nodes(n)}


def _python_feed(node: ir.Node, name: str, start: int, end: int | None) -> HostFeed:
    src = node.inputs[0].name
    if node.op_type == "Size":
        return HostFeed(name, "size", src)
    return HostFeed(name, "shape", src, start, end)


def _apply_shape(node: ir.Node, dims: list[int]) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(int(np.prod(dims, dtype=np.int64)), dtype=np.int64)
    start, end = _shape_slice(node)
    return np.array(shape_slice(dims, start, end), dtype=np.int64)
