"""Drive ``OrtModuleGraphBuilder`` to turn the forward graph into a training graph.

With ``build_gradient_graph=True`` the builder returns one graph holding the forward, a ``YieldOp``
that hands the user outputs back to the caller and waits for their gradients, and the backward.
Its inputs are the forward's inputs; its outputs are the gradients of the user inputs that require
grad followed by those of the trainable parameters. With ``build_gradient_graph=False`` it returns
the optimized forward graph alone.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass

import numpy as np
import onnx
import torch

from .._logging import logger
from .._ort import C
from ..errors import GradientBuildError, sentence
from . import aten


@dataclass(frozen=True)
class GraphInfo:
    """The builder's facts about the graph, copied into plain Python.

    Attributes:
        user_output_names: graph outputs the forward yields, in order.
        non_differentiable_outputs: indices of outputs that get no gradient (integers, bools,
            outputs that do not depend on anything trainable).
        full_shape_grad_outputs: indices of outputs whose gradient must have the output's shape;
            other missing gradients may be fed as a scalar zero.
        saved_output_indices: outputs the backward reads; marked with ``save_for_backward``.
        frontier_count: number of extra forward values the backward reads.
        grad_feed_index: for each backward output, the index in the feeds of the input it is the
            gradient of.
    """

    user_output_names: tuple[str, ...]
    non_differentiable_outputs: frozenset[int]
    full_shape_grad_outputs: frozenset[int]
    saved_output_indices: tuple[int, ...]
    frontier_count: int
    grad_feed_index: tuple[int, ...] = ()


@dataclass(frozen=True)
class TrainingGraph:
    """A built graph ready for a session.

    Attributes:
        model_bytes: the serialized graph the session loads.
        feed_names: graph inputs, in the order they are fed.
        grad_names: graph outputs of the backward, in the order ORT returns them.
        info: the builder's :class:`GraphInfo`.
        has_backward: whether ``model_bytes`` contains the backward (a ``YieldOp`` graph).
        float_feeds: feeds the graph takes as float32 while the module's tensor is bfloat16 or
            float16 (``fuse_initializers``): the runtime feeds a float32 copy.
        constant_outputs: outputs of the forward that depend on no graph input, as
            ``(index, name, value)`` in the order of the forward's outputs: they are not outputs of
            ``model_bytes`` (see :func:`split_constant_outputs`); the program puts ``value`` back at
            ``index`` of the outputs on every run. ``info`` counts only the graph's own outputs.
        ort_threads: ORT intra-op threads for its sessions, where the build chose them (1 for a CPU
            training graph of small kernels: ``gemm_choice.decide_pool``); 0: ``intra_op_threads``,
            else torch's count at session creation.
    """

    model_bytes: bytes
    feed_names: tuple[str, ...]
    grad_names: tuple[str, ...]
    info: GraphInfo
    has_backward: bool
    float_feeds: frozenset[str] = frozenset()
    constant_outputs: tuple[tuple[int, str, torch.Tensor], ...] = ()
    ort_threads: int = 0

    def model(self) -> onnx.ModelProto:
        """The built graph as an ``onnx.ModelProto`` (parsed on each call)."""
        return onnx.load_model_from_string(self.model_bytes)


def _ort_severity(level: int):
    """ORT's Severity for a Python logging level: ORT's C++ log (its INFO lines, and its warnings
    while it loads and transforms our graphs, "Removing initializer ... not used by any node") shows
    only at DEBUG; its errors are raised as GradientBuildError with their message."""
    if level <= logging.DEBUG:
        return C.Severity.VERBOSE
    return C.Severity.FATAL


def build_graph(
    model: onnx.ModelProto,
    *,
    state_names: list[str],
    trainable_names: list[str],
    input_names_require_grad: list[str],
    build_gradient: bool,
    log_level: int = logging.WARNING,
    propagate_casts: bool = True,
) -> TrainingGraph:
    """Build the training (or optimized inference) graph of ``model``.

    Args:
        model: forward graph; parameters and buffers are graph inputs.
        state_names: graph inputs that are parameters or buffers.
        trainable_names: the subset of ``state_names`` to differentiate.
        input_names_require_grad: user inputs to differentiate.
        build_gradient: build the backward (training) or only optimize the forward.
        log_level: Python logging level for the builder's messages.
        propagate_casts: let ORT move Casts through the graph (its PropagateCastOps transformer). Off
            on the CPU: it moves the float32 Casts of half-precision parameters past the ops that
            read them (a Slice of the position table), leaving ops with half-precision inputs that
            ORT's CPU kernels lack (SliceGrad).

    Raises:
        GradientBuildError: chained to the builder's error.
    """
    trainable, inputs = list(trainable_names), list(input_names_require_grad)
    model, constants = split_constant_outputs(model)
    while True:
        try:
            graph = _build_graph(model, state_names, trainable, inputs, build_gradient, log_level, propagate_casts)
            return dataclasses.replace(graph, constant_outputs=constants) if constants else graph
        except GradientBuildError as e:
            # A parameter (or input) that reaches the outputs only through ops without a gradient
            # (an argmax, a comparison): eager leaves its .grad None; ORT's builder refuses it. It
            # is built again as not trained, and gets None (runtime/function.py).
            found = _UNREACHABLE.search(str(e.__cause__))
            name = found.group(1) if found else None
            if name in trainable:
                trainable.remove(name)
            elif name in inputs:
                inputs.remove(name)
            else:
                raise
            logger.debug("%s reaches no output through a differentiable op: no gradient (as in eager)", name)


#: Nodes a constant output may be computed by: the standard domain, none with a subgraph, none random.
_NOT_CONSTANT_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"}
)


def split_constant_outputs(
    model: onnx.ModelProto,
) -> tuple[onnx.ModelProto, tuple[tuple[int, str, torch.Tensor], ...]]:
    """The forward without its outputs that depend on no graph input, and those outputs' values.

    NOTE: ORT folds such an output into an initializer (a Constant node becomes one when ORT loads
    the graph; constant folding does the rest), and its gradient builder then refuses the graph:
    "output:N: couldn't find the producer node, and it's not a graph input" (a sliding-window KV
    cache returns its window as a 0-d int64 tensor built in forward()). Such an output needs no
    gradient and is the same on every run: it is computed once here and returned by the program
    (``TrainingGraph.constant_outputs``). An output is constant when every value it is computed
    from is a Constant node's or an initializer, through standard ops without subgraphs or
    randomness; one whose value cannot be computed here stays an output. At least one output is
    left to the graph.
    """
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    initializers = {t.name: t for t in graph.initializer}
    inputs = {i.name for i in graph.input}
    constant: dict[str, bool] = {}

    def is_constant(name: str) -> bool:
        stack = [name]
        while stack:  # iterative: graphs are deep
            value = stack[-1]
            if value in constant:
                stack.pop()
                continue
            node = producer.get(value)
            if node is None:
                constant[value] = value in initializers and value not in inputs
                stack.pop()
                continue
            if (
                node.domain not in ("", "ai.onnx")
                or node.op_type in _NOT_CONSTANT_OPS
                or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
            ):
                for out in node.output:
                    constant[out] = False
                stack.pop()
                continue
            pending = [i for i in node.input if i and i not in constant]
            if pending:
                stack.extend(pending)
                continue
            result = all(constant[i] for i in node.input if i)
            for out in node.output:
                constant[out] = result
            stack.pop()
        return constant[name]

    found = [(i, o) for i, o in enumerate(graph.output) if o.name not in inputs and is_constant(o.name)]
    if not found or len(found) == len(graph.output):
        return model, ()
    try:
        values = _evaluate(model, [o.name for _, o in found], producer, initializers)
    except Exception as e:  # the builder then says what it thinks of the output
        logger.debug("could not compute the constant outputs %s: %s", [o.name for _, o in found], e)
        return model, ()
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    names = {o.name for _, o in found}
    del stripped.graph.output[:]
    stripped.graph.output.extend(o for o in graph.output if o.name not in names)
    constants = tuple((i, o.name, torch.from_numpy(np.array(v))) for (i, o), v in zip(found, values))
    logger.debug("constant outputs returned without the graph: %s", [c[1] for c in constants])
    return stripped, constants


def _evaluate(model: onnx.ModelProto, names: list[str], producer: dict, initializers: dict) -> list:
    """The values of ``names`` (computed from Constant nodes and initializers only), by an ORT
    inference session over the nodes they are computed by."""
    from .._ort import ort

    seen: set[int] = set()
    used: set[str] = set(names)  # (an output may be an initializer itself)
    stack = list(names)
    while stack:
        node = producer.get(stack.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for i in node.input:
            if i:
                used.add(i)
                stack.append(i)
    order = [n for n in model.graph.node if id(n) in seen]  # the graph's order is topological
    elem = {o.name: o.type.tensor_type.elem_type for o in (*model.graph.value_info, *model.graph.output)}
    sub = onnx.helper.make_graph(
        order,
        "ortwrap_constant_outputs",
        [],
        [onnx.helper.make_tensor_value_info(n, elem.get(n, 0), None) for n in names],
        initializer=[initializers[n] for n in used if n in initializers],
    )
    sub_model = onnx.helper.make_model(sub, opset_imports=model.opset_import, ir_version=model.ir_version)
    sess = ort.InferenceSession(sub_model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(names, {})


def _rank(value: onnx.ValueInfoProto | None) -> int | None:
    if value is None or not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
        return None
    return len(value.type.tensor_type.shape.dim)


#: the builder's name for the gradient of a value: ``<value>_grad``
_GRADIENT_NAME = re.compile(r"(.+)_grad")


def _scalar_gradients(model: onnx.ModelProto) -> bool:
    """Give the gradient of each 0-d value the 0-d shape; True if any changed.

    NOTE: ORT 1.19.2's gradient builders write their constants with shape [1] (``Sqrt``'s gradient is
    ``Div([0.5], Y)``), so the gradient of a 0-d value comes out as [1]. The builders below it take
    the forward's shapes on trust: ``ReduceMean``'s gradient unsqueezes it by the reduced axes into a
    rank-4 tensor for a 3-D input, and the gradient of ``std(x)`` (``Sqrt`` of a full reduction)
    came out wrong, silently. Each such gradient (``<value>_grad``, as the builder names them) is
    reshaped to 0-d where it is made, so what reads it sees the forward's shape.
    """
    graph = model.graph
    info = {v.name: v for v in (*graph.input, *graph.value_info, *graph.output)}
    known = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    known |= {o for n in graph.node for o in n.output}
    nodes: list[onnx.NodeProto] = []
    reshaped: set[str] = set()
    for node in graph.node:
        nodes.append(node)
        for i, out in enumerate(node.output):
            of = _GRADIENT_NAME.fullmatch(out)
            if of is None or _rank(info.get(of.group(1))) != 0 or _rank(info.get(out)) == 0:
                continue
            raw, shape = f"{out}/unreshaped", f"{out}/scalar_shape"
            if raw in known:
                continue
            node.output[i] = raw
            nodes.append(
                onnx.helper.make_node(
                    "Constant",
                    [],
                    [shape],
                    name=f"{out}/ScalarShape",
                    value=onnx.helper.make_tensor(shape, onnx.TensorProto.INT64, [0], []),
                )
            )
            nodes.append(onnx.helper.make_node("Reshape", [raw, shape], [out], name=f"{out}/Scalar"))
            reshaped.add(out)
    if not reshaped:
        return False
    del graph.node[:]
    graph.node.extend(nodes)
    for v in (*graph.value_info, *graph.output):
        if v.name in reshaped and v.type.HasField("tensor_type"):
            v.type.tensor_type.shape.ClearField("dim")
    return True


#: ORT's builder's message for a trained input no output depends on through differentiable ops
_UNREACHABLE = re.compile(r"Cannot compute the partial derivative for '([^']+)' as it's unreachable")


def _build_graph(
    model: onnx.ModelProto,
    state_names: list[str],
    trainable_names: list[str],
    input_names_require_grad: list[str],
    build_gradient: bool,
    log_level: int,
    propagate_casts: bool,
) -> TrainingGraph:
    cfg = C.OrtModuleGraphBuilderConfiguration()
    cfg.initializer_names = list(state_names)
    cfg.initializer_names_to_train = list(trainable_names)
    cfg.input_names_require_grad = list(input_names_require_grad)
    cfg.build_gradient_graph = build_gradient
    cfg.enable_caching = False
    cfg.use_memory_efficient_gradient = False
    cfg.loglevel = _ort_severity(log_level)
    builder = C.OrtModuleGraphBuilder()
    transformers = C.TrainingGraphTransformerConfiguration()
    if not propagate_casts:
        transformers.propagate_cast_ops_config.level = -1
    try:
        builder.initialize(model.SerializeToString(), cfg)
        builder.build(transformers)
    except Exception as e:
        ops = sorted({f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in model.graph.node})
        raise GradientBuildError(
            f"OrtModuleGraphBuilder rejected the model: {sentence(str(e))} Ops in the graph: {', '.join(ops)}. "
            "If an op above lacks an ORT gradient, report it; ORTWrap(..., fallback=True) runs the module in PyTorch."
        ) from e
    gi = builder.get_graph_info()
    built = builder.get_gradient_model() if build_gradient else builder.get_forward_model()
    proto = onnx.load_model_from_string(built)
    if aten.mark_used_outputs(proto) | aten.drop_missing_gradients(proto) | _scalar_gradients(proto):
        built = proto.SerializeToString()
    feed_names = tuple(i.name for i in proto.graph.input)
    grad_names = tuple(o.name for o in proto.graph.output) if build_gradient else ()
    grad_of = {g: n for n, g in dict(gi.user_input_grad_names).items()}
    grad_of.update(zip(gi.initializer_grad_names_to_train, gi.initializer_names_to_train))
    try:
        grad_feed_index = tuple(feed_names.index(grad_of[g]) for g in grad_names)
    except (KeyError, ValueError) as e:
        raise GradientBuildError(f"cannot map the backward output {e} to a graph input") from e
    info = GraphInfo(
        user_output_names=tuple(gi.user_output_names),
        non_differentiable_outputs=frozenset(gi.output_grad_indices_non_differentiable),
        full_shape_grad_outputs=frozenset(gi.output_grad_indices_require_full_shape),
        saved_output_indices=tuple(
            i for i in gi.module_output_indices_requires_save_for_backward if i < len(gi.user_output_names)
        ),
        frontier_count=len(gi.frontier_node_arg_map),
        grad_feed_index=grad_feed_index,
    )
    return TrainingGraph(
        model_bytes=built,
        feed_names=feed_names,
        grad_names=grad_names,
        info=info,
        has_backward=build_gradient,
    )
