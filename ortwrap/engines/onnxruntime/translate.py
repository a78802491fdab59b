"""One AOTAutograd FX graph (forward with saved values, backward, or inference) -> ONNX.

The graph is ATen IR, functional, with static shapes (the engine builds per shape signature). It is
captured again by ``torch.export`` (cheap: its ops are ATen already) and translated by ortwrap's
dynamo translation path (``export.dynamo_translate.dynamo_to_onnx``, with ortwrap's translation table and torchlib
for the rest), then cleaned up by the same onnxscript round as the dynamo exporter's output
(``export.dynamo._cleanup``).

Graph inputs keep the FX placeholders' order; outputs that are ``None`` (the backward's gradient of
an input that needs none) are dropped and put back by the runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import onnx_ir as ir
import torch

from ..._logging import logger
from ...errors import ExportError


@dataclasses.dataclass
class TranslatedGraph:
    """An FX graph as ONNX, with what the runner needs to bind it.

    Attributes:
        model: the serialized ONNX model.
        input_names: ONNX input name per FX placeholder, in order.
        output_names: ONNX output name per tensor output of the FX graph (None-outputs dropped).
        outputs: per FX output: its index among ``output_names``, or None (the output is None).
        output_meta: (shape, dtype) of each tensor output.
        from_cache: loaded from the build cache, not translated by this process.
    """

    model: bytes
    input_names: list[str]
    output_names: list[str]
    outputs: list[int | None]
    output_meta: list[tuple[tuple[int, ...], torch.dtype]]
    #: loaded from the build cache (:func:`translate_cached`), not translated in this process
    from_cache: bool = False


def _meta(node: torch.fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ExportError(f"the AOTAutograd graph's {node.name} is {type(val).__name__}, not a tensor")
    return val


def _grouped_mm_backward(mat_a, mat_b, offs, grad_out):
    """onnxscript translation of ``transformers.grouped_mm_fallback_backward`` (the backward of the
    experts' grouped matmul, which AOTAutograd records whole): per expert ``g`` and its rows,
    ``grad_a = grad_out @ b[g].T`` and ``grad_b[g] = a.T @ grad_out``, as ``export/grouped_mm.py``
    writes the forward (the number of experts static, rows sorted by expert, ``offs`` their ends)."""
    from onnxscript import opset18 as op

    groups = mat_b.shape[0] if mat_b.shape is not None else None
    if not isinstance(groups, int):
        raise RuntimeError("ortwrap: grouped_mm backward: the number of experts must be static")
    ends = op.Cast(offs, to=7)
    axes = op.Constant(value_ints=[0])
    start = op.Constant(value_ints=[0])
    grad_a, grad_b = [], []
    for i in range(groups):
        end = op.Slice(ends, op.Constant(value_ints=[i]), op.Constant(value_ints=[i + 1]), axes)
        rows_go = op.Slice(grad_out, start, end, axes)
        rows_a = op.Slice(mat_a, start, end, axes)
        b_i = op.Gather(mat_b, op.Constant(value_int=i), axis=0)
        grad_a.append(op.MatMul(rows_go, op.Transpose(b_i, perm=[1, 0])))
        grad_b.append(op.Unsqueeze(op.MatMul(op.Transpose(rows_a, perm=[1, 0]), rows_go), axes))
        start = end
    return op.Concat(*grad_a, axis=0), op.Concat(*grad_b, axis=0)


def _engine_translations() -> dict:
    """ortwrap's translation table (the dynamo exporter's), and the backward ops AOTAutograd's
    graphs hold that an exported forward graph never does."""
    from ...export.translations import training_translations

    table = training_translations()
    try:
        table[torch.ops.transformers.grouped_mm_fallback_backward.default] = _grouped_mm_backward
    except (AttributeError, RuntimeError):
        pass  # (transformers' MoE op not registered in this process)
    return table


def engine_registry() -> Any:
    """torchlib's registry with the engine's translations first (``is_registered(op)``: translatable)."""
    from ..._compat import torch as compat

    return compat.dynamo_registry(OPSET, _engine_translations())


OPSET = 20


def _number_first(node: torch.fx.Node) -> bool:
    """``aten.add.Tensor(0.3333, x, alpha=0.6667)`` (PhiMoE's ``torch.add(0.3333, mask, alpha=0.6667)``), or
    ``aten.mul.Tensor(2.0, x)``: a Python number as ``self`` is legal in eager (a wrapped number), but the
    ONNX exporter's type promotion cannot find an overload for it again."""
    return (
        node.op == "call_function"
        and node.target in (torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor)
        and len(node.args) == 2
        and isinstance(node.args[0], (int, float))
        and not isinstance(node.args[0], bool)
        and isinstance(node.args[1], torch.fx.Node)
    )


def _number_last(graph: torch.fx.Graph, node: torch.fx.Node, env: dict) -> torch.fx.Node:
    """:func:`_number_first`'s node written with the tensor first: ``x * alpha + s``, ``x * s``
    (the same type promotion: the number stays a wrapped number)."""
    number, x = node.args[0], env[node.args[1]]
    if node.target is torch.ops.aten.mul.Tensor:
        return graph.call_function(torch.ops.aten.mul.Tensor, (x, number))
    alpha = node.kwargs.get("alpha", 1)
    if alpha != 1:
        x = graph.call_function(torch.ops.aten.mul.Tensor, (x, alpha))
    return graph.call_function(torch.ops.aten.add.Tensor, (x, number))


def _identity_transposes(model: ir.Model) -> None:
    """Each ``Transpose`` whose ``perm`` keeps the order (torchlib's ``aten.index`` writes one around
    the gathered rows, ``h[rows]``) becomes an ``Identity``: onnxruntime 1.19.2's GemmTransposeFusion
    folds any Transpose before a Gemm into ``transA`` without reading its perm, and computed
    ``h[rows] @ W.T`` with ``h`` transposed (the training build's InferenceSession)."""
    for node in list(model.graph):
        perm = node.attributes.get("perm") if node.op_type == "Transpose" and node.domain == "" else None
        if perm is not None and list(perm.as_ints()) == list(range(len(perm.as_ints()))):
            identity = ir.node("Identity", [node.inputs[0]])
            model.graph.insert_after(node, identity)
            out, new = node.outputs[0], identity.outputs[0]
            new.dtype, new.shape = out.dtype, out.shape
            out.replace_all_uses_with(new, replace_graph_outputs=True)
            new.name = out.name
            model.graph.remove(node, safe=True)


def _int64_nd_indices(model: ir.Model) -> None:
    """``ScatterND`` and ``GatherND`` take int64 indices only (ONNX's schema); torchlib writes the int32
    indices of a decomposition as they come (``aten.unfold_backward`` with a negative dim), which
    onnxruntime refuses when it creates the session: a Cast to int64 goes in front."""
    for node in list(model.graph):
        if node.domain != "" or node.op_type not in ("ScatterND", "GatherND"):
            continue
        indices = node.inputs[1]
        if indices is None or indices.dtype != ir.DataType.INT32:
            continue
        cast = ir.node("Cast", [indices], attributes={"to": ir.DataType.INT64})
        model.graph.insert_before(node, cast)
        cast.outputs[0].dtype, cast.outputs[0].shape = ir.DataType.INT64, indices.shape
        node.replace_input_with(1, cast.outputs[0])


def _example(meta: torch.Tensor, hint: Callable[[Any], int]) -> torch.Tensor:
    """A zero tensor like the placeholder's value, with its strides: AOTAutograd traced the graph on
    tensors laid out so (a saved value that is a transposed view, say), and a ``view`` in the graph that
    is legal on that layout is not on a contiguous one (nn.MultiheadAttention's backward: ``view`` of a
    ``permute`` of a saved batch-first output). ONNX has no strides: only the trace needs them."""
    shape = [hint(d) for d in meta.shape]
    try:
        stride = [hint(s) for s in meta.stride()]
    except Exception:  # (a layout without strides: sparse, or a size hint missing)
        return torch.zeros(shape, dtype=meta.dtype)
    return torch.empty_strided(shape, stride, dtype=meta.dtype).zero_()


def translate(
    gm: torch.fx.GraphModule, what: str, opset: int = 20, fusions: bool = False, dynamic: bool = False
) -> TranslatedGraph:
    """``gm`` (an AOTAutograd graph) as ONNX. ``what`` names the graph in errors. ``fusions``: ortwrap's
    GELU / LayerNorm / RMSNorm fusions (``passes/fusions.py``; its rules leave a pattern whose
    intermediate values are graph outputs, saved for the backward, alone). ``dynamic``: ``gm``'s
    inputs have symbolic sizes (tensor inputs only: ``dynamic.py`` prepares it), captured with
    ``Dim.AUTO`` on each, so the ONNX graph has symbolic dims; ``output_meta`` then holds the trace's
    example sizes."""
    from ...export.dynamo import _cleanup, _quiet_exporter
    from ...export.dynamo_translate import dynamo_to_onnx
    from ...passes.stop_gradient import ResolveStopGradientPass

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    results = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    positions: list[int | None] = []
    kept: list[torch.fx.Node] = []
    for r in results:
        if r is None:
            positions.append(None)
            continue
        if not isinstance(r, torch.fx.Node) or not isinstance(r.meta.get("val"), torch.Tensor):
            raise ExportError(f"the {what} graph returns {r!r}, which is not a tensor (a symbolic size?)")
        if r in kept:
            # NOTE: a value returned twice (a user output the backward also saves: softmax's) is one
            # tensor, as in eager: an in-place edit of the output then fails autograd's version check
            # in the backward (eager's error) instead of the backward reading an unedited copy.
            positions.append(kept.index(r))
            continue
        positions.append(len(kept))
        kept.append(r)
    metas = [_meta(n) for n in placeholders]
    dynamic_shapes = None
    if dynamic:
        from ..._compat import torch as compat

        hint = compat.sym_hint
        dynamic_shapes = tuple(
            {d: torch.export.Dim.AUTO for d, s in enumerate(m.shape) if isinstance(s, torch.SymInt)} or None
            for m in metas
        )
    else:
        for m in metas:
            if any(not isinstance(d, int) for d in m.shape):
                raise ExportError(f"the {what} graph has symbolic shapes; this engine builds per shape signature")
        hint = int
    output_meta = [(tuple(hint(d) for d in _meta(n).shape), _meta(n).dtype) for n in kept]

    # A copy of the graph that returns only the tensor outputs, as a tuple (torch.export's contract).
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            graph.output(tuple(env[n] for n in kept))
        elif _number_first(node):
            env[node] = _number_last(graph, node, env)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    module = torch.fx.GraphModule(gm, graph)
    example = tuple(_example(m, hint) for m in metas)
    try:
        with _quiet_exporter():
            program = torch.export.export(module, example, dynamic_shapes=dynamic_shapes, strict=False)
            ir_model, _ = dynamo_to_onnx(program, table=_engine_translations(), opset=opset, decompose=False)
        _cleanup(ir_model)
        # ortwrap's translations mark detach (and an embedding's padding row) ortwrap::StopGradient for
        # ORT's gradient builder; AOTAutograd's graphs are differentiated already: the markers go.
        ResolveStopGradientPass(with_backward=False)(ir_model)
        _identity_transposes(ir_model)
        _int64_nd_indices(ir_model)
        # (a graph of no ops but the Identity below, a backward that hands its gradient through,
        # imports no opset: ORT refuses a model without one)
        ir_model.opset_imports.setdefault("", opset)
        if fusions:
            import onnx_ir.passes.common as common

            from ...passes.fusions import StandardOpFusionPass

            if StandardOpFusionPass(training=False)(ir_model).modified:
                common.RemoveUnusedNodesPass()(ir_model)  # (the constants of the fused patterns)
    except Exception as e:
        raise ExportError(f"translating the AOTAutograd {what} graph to ONNX failed: {type(e).__name__}: {e}") from e
    g = ir_model.graph
    if len(g.inputs) != len(placeholders):
        raise ExportError(f"the {what} graph's ONNX has {len(g.inputs)} inputs, its FX graph {len(placeholders)}")
    if len(g.outputs) != len(kept):
        raise ExportError(f"the {what} graph's ONNX has {len(g.outputs)} outputs, its FX graph {len(kept)}")
    if dynamic_shapes is not None:
        # (Dim.AUTO specializes silently: a dim the capture fixed would give wrong shapes at other sizes)
        for v, dims in zip(g.inputs, dynamic_shapes):
            fixed = [d for d in dims or () if v.shape is None or isinstance(v.shape[d], int)]
            if fixed:
                raise ExportError(f"torch.export fixed dims {fixed} of the {what} graph's input {v.name}")
    input_names = [f"in{i}" for i in range(len(g.inputs))]
    for v, name in zip(g.inputs, input_names):
        v.name = name
    # An output that is also an input (or another output) gets its own value: ORT binds each output once.
    output_names = []
    seen: set[int] = set()
    inputs = {id(v) for v in g.inputs}
    for i, v in enumerate(list(g.outputs)):
        if id(v) in inputs or id(v) in seen:
            node = ir.node("Identity", [v])
            g.append(node)
            g.outputs[i] = v = node.outputs[0]
            v.dtype, v.shape = node.inputs[0].dtype, node.inputs[0].shape
        seen.add(id(v))
        v.name = f"out{i}"
        output_names.append(v.name)
    return TranslatedGraph(
        ir.serde.serialize_model(ir_model).SerializeToString(), input_names, output_names, positions, output_meta
    )


def translate_cached(
    gm: torch.fx.GraphModule, what: str, fusions: bool, use_cache: bool, dynamic: bool = False
) -> TranslatedGraph:
    """:func:`translate`, through the build cache (``Options.build_cache``, ``build/cache.py``: signed
    entries keyed by the FX graph with its constants, the options that shape the ONNX and the
    versions). A second process still traces with AOTAutograd, and skips the translation (its
    ``torch.export``, torchlib and the cleanup: most of a graph's build time)."""
    if not use_cache:
        return translate(gm, what, fusions=fusions, dynamic=dynamic)
    from ...build import cache
    from ...options import build_cache_dir

    try:
        key = cache.fx_graph_key("engine=onnxruntime", gm, OPSET, fusions, *(("dynamic",) if dynamic else ()))
    except cache.Uncacheable as e:
        logger.info("build cache: the %s graph is not cached: %s", what, e)
        return translate(gm, what, fusions=fusions, dynamic=dynamic)
    entries = cache.load(build_cache_dir(), key)
    if entries and isinstance(entries[0].graph, TranslatedGraph):
        return dataclasses.replace(entries[0].graph, from_cache=True)
    graph = translate(gm, what, fusions=fusions, dynamic=dynamic)
    # (the training engine's entry type, with the translated graph in ``graph`` and nothing else)
    entry = cache.CacheEntry(
        model_bytes=b"", graph=graph, exported=b"", pre_grad=b"", user_input_names=[], output_names=[], out_spec=(),
        state_names={}, buffer_outputs={}, static_reasons=[], static_spatial=False, shape_guards=None,
        exporter="aot_autograd", exports=0,
    )  # fmt: skip
    cache.store(build_cache_dir(), key, [entry])
    return graph
