"""Dynamic dims for the onnxruntime engine: one build serves the input sizes that change between calls.

AOTAutograd traces on fake inputs whose changing dims are symbolic (``compat.symbolic_inputs``: a
FakeTensorMode with a ShapeEnv, one symbol per dim, no duck sizing), so its forward, backward and
inference graphs have symbolic sizes, and the forward may return SymInts it saves for the backward
(a batch size, ``4*s0`` for a view of the heads). The trace's guards (relations, specializations, every
dynamic size at least 2) are kept as a check of later inputs (``compat.shape_guards``).

Each graph is prepared for ONNX here (:func:`prepare`): its SymInt inputs are rebuilt inside the graph
from its tensor inputs' sizes (``aten.sym_size`` and arithmetic), its SymInt outputs left out, so the
ONNX graph takes and returns tensors only, with symbolic dims (``translate(dynamic=True)``: torch.export
with ``Dim.AUTO``). The runner (:class:`DynamicRunner`) binds the symbols from the actual inputs' sizes
(and SymInt inputs), computes each output's shape, allocates it and binds it to ORT by pointer, as the
static runner does, and returns the SymInt outputs as ints computed in Python. The shapes per set of
symbol values are remembered (a model sees few).

With ``aggressive_cpu_fallback`` (``ORT_AGGRESSIVE_CPU_FALLBACK``), each of these graphs goes through the
training engine's :class:`~ortwrap.passes.host_shapes.HostShapeSplitPass` (:func:`split_shapes`): the
shape computations its symbolic sizes bring (``Shape`` of an input with symbolic dims, and the
``Gather``/``Squeeze``/``Mul``/``Concat``/... that build ``Reshape``/``Expand``/``Range``/``Slice``
inputs from it) move into a host shape program, which the runner computes before each run
(:class:`~ortwrap.runtime.host_shapes.HostShapeRunner`, cached by the input shapes) and binds as CPU
tensors to the main graph's new inputs. The inputs with symbolic dims are the pass's "user inputs"
(their ``tensor.shape`` is read on the host); inputs with static shapes (parameters) are constants.

NOTE: what is not dynamic. A graph that must be split (untranslatable ops, opaque Functions), a SymInt
that the graph's tensor inputs' sizes do not give, an expression other than ``+ * //`` of sizes, or a
dim torch.export fixes: the build raises :class:`NotDynamic`, and the engine keeps its per-shape builds
for that call signature (said once in the log).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch

from ..._compat import torch as compat
from ..._logging import logger
from ...errors import ExportError
from ...graph.host_shapes import HostShapeSplit
from ...runtime.host_shapes import HostShapeRunner
from .session import GraphRunner, numpy_dtype
from .split import untranslatable
from .translate import TranslatedGraph, translate_cached

__all__ = ["DynamicRunner", "DynamicShapes", "NotDynamic", "family_of", "prepare", "split_shapes"]


class NotDynamic(ExportError):
    """A graph the engine cannot run with symbolic sizes (the call signature keeps per-shape builds)."""


class _Plan:
    """What the runner computes in Python for one graph with symbolic sizes.

    Attributes:
        tensor_at: the FX placeholders that are tensors (ONNX inputs, in order).
        bind: (symbol, placeholder index, dim or None) for each symbol the inputs give.
        outputs: per FX output: ``("none",)``, ``("tensor", index among the ONNX outputs, shape exprs)``
            or ``("int", expr)``.
    """

    def __init__(self) -> None:
        self.tensor_at: list[int] = []
        self.bind: list[tuple[Any, int, int | None]] = []
        self.outputs: list[tuple] = []
        self._shapes: dict[tuple, list] = {}

    def values(self, args: list) -> list:
        """Per FX output: its shape (tensor), its value (int) or None, at the sizes of ``args``."""
        key = tuple(args[i] if d is None else args[i].shape[d] for _, i, d in self.bind)
        found = self._shapes.get(key)
        if found is None:
            env = {s: sympy.Integer(v) for (s, _, _), v in zip(self.bind, key)}

            def value(e: Any) -> int:
                return int(e.xreplace(env)) if isinstance(e, sympy.Basic) else int(e)

            found = []
            for out in self.outputs:
                if out[0] == "tensor":
                    found.append(tuple(value(e) for e in out[2]))
                elif out[0] == "int":
                    found.append(value(out[1]))
                else:
                    found.append(None)
            self._shapes[key] = found
        return found


def _fx_of(graph: torch.fx.Graph, expr: Any, symbols: dict) -> Any:
    """``expr`` (a sympy expression of sizes) as FX nodes over ``symbols`` (symbol -> node)."""
    if isinstance(expr, (int, sympy.Integer)):
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        if expr not in symbols:
            raise NotDynamic(f"the size {expr} comes from no tensor input of the graph")
        return symbols[expr]
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        op = operator.add if isinstance(expr, sympy.Add) else operator.mul
        args = [_fx_of(graph, a, symbols) for a in expr.args]
        out = args[0]
        for a in args[1:]:
            out = graph.call_function(op, (out, a))
        return out
    if isinstance(expr, compat.floor_div_type()):
        a, b = (_fx_of(graph, x, symbols) for x in expr.args)
        return graph.call_function(operator.floordiv, (a, b))
    raise NotDynamic(f"the size {expr} is not a sum, product or floor division of sizes")


aten = torch.ops.aten


def _call(graph: torch.fx.Graph, op: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
    return graph.call_function(op, args, kwargs)


def _numel(graph: torch.fx.Graph, x: torch.fx.Node, dims: Any = None) -> Any:
    """The product of ``x``'s sizes (in ``dims``, else all) as FX nodes."""
    rank = x.meta["val"].dim() if "val" in x.meta else None
    if rank is None:
        raise NotDynamic("numel of a value without its shape")
    out: Any = 1
    for d in range(rank) if dims is None else dims:
        size = _call(graph, aten.sym_size.int, x, d % rank)
        out = size if out == 1 else _call(graph, operator.mul, out, size)
    return out


def _sym_numel(graph: torch.fx.Graph, x: torch.fx.Node) -> Any:
    """``aten.sym_numel`` (batch norm's ``input.numel()`` under symbolic sizes): no ONNX translation."""
    return _numel(graph, x)


def _var_mean(graph: torch.fx.Graph, x: torch.fx.Node, dims: Any = None, *, correction: Any = None,
              keepdim: bool = False) -> tuple:  # fmt: skip
    """``aten.var_mean.correction`` (batch norm's statistics; no ONNX translation) as means of ``x`` and of
    its squared deviations."""
    if dims is None:
        raise NotDynamic("var_mean over every dim")
    mean = _call(graph, aten.mean.dim, x, list(dims), True)
    diff = _call(graph, aten.sub.Tensor, x, mean)
    var = _call(graph, aten.mean.dim, _call(graph, aten.mul.Tensor, diff, diff), list(dims), keepdim)
    c = 1 if correction is None else correction
    if c:
        n = _numel(graph, x, dims)
        var = _call(graph, aten.mul.Tensor, var, _call(graph, operator.truediv, n, _call(graph, operator.sub, n, c)))
    if not keepdim:
        mean = _call(graph, aten.squeeze.dims, mean, list(dims))
    return (var, mean)


def _max_pool2d_backward(graph: torch.fx.Graph, grad_out, x, kernel, stride, padding, dilation, ceil_mode, indices):
    """``aten.max_pool2d_with_indices_backward`` (no ONNX translation): each output's gradient added at
    its index in its input plane (``scatter_add`` over the flattened planes)."""
    if x.meta["val"].dim() != 4:
        raise NotDynamic("max_pool2d's backward of an unbatched input")
    sizes = [_call(graph, aten.sym_size.int, x, d) for d in range(2)]
    flat = [*sizes, -1]
    zeros = _call(graph, aten.reshape.default, _call(graph, aten.zeros_like.default, x), flat)
    out = _call(graph, aten.scatter_add.default, zeros, 2, _call(graph, aten.reshape.default, indices, flat),
                _call(graph, aten.reshape.default, grad_out, flat))  # fmt: skip
    return _call(graph, aten.reshape.default, out, [*sizes, *(_call(graph, aten.sym_size.int, x, d) for d in (2, 3))])


#: ops with no ONNX translation that graphs with symbolic sizes hold, rewritten in :func:`prepare`
_REWRITES = {
    aten.sym_numel.default: _sym_numel,
    aten.var_mean.correction: _var_mean,
    aten.max_pool2d_with_indices_backward.default: _max_pool2d_backward,
}


def prepare(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, _Plan]:
    """``gm`` with tensor inputs and outputs only (its SymInt inputs computed from the tensor inputs'
    sizes, its SymInt outputs left out), and the plan its runner computes in Python."""
    plan = _Plan()
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    symbols: dict[Any, torch.fx.Node] = {}
    bound: set = set()
    sizes: list[tuple[Any, torch.fx.Node, int]] = []
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            plan.tensor_at.append(i)
            env[node] = new = graph.placeholder(node.name)
            new.meta = dict(node.meta)
            for d, size in enumerate(val.shape):
                expr = compat.sym_expr(size)
                if isinstance(expr, sympy.Symbol):
                    sizes.append((expr, new, d))
                    if expr not in bound:
                        bound.add(expr)
                        plan.bind.append((expr, i, d))
        elif isinstance(val, torch.SymInt):
            expr = compat.sym_expr(val)
            if isinstance(expr, sympy.Symbol) and expr not in bound:
                bound.add(expr)
                plan.bind.append((expr, i, None))
        elif not isinstance(val, int):
            raise NotDynamic(f"the graph's input {node.name} is a {type(val).__name__}")
    for expr, new, d in sizes:  # (after the placeholders: each symbol's size, from its first tensor input)
        if expr not in symbols:
            symbols[expr] = graph.call_function(torch.ops.aten.sym_size.int, (new, d))
    for node in placeholders:
        if node not in env:  # (a SymInt or int: computed from the tensor inputs' sizes)
            env[node] = _fx_of(graph, compat.sym_expr(node.meta["val"]), symbols)
    kept: list = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            results = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
            for r in results:
                val = r.meta.get("val") if isinstance(r, torch.fx.Node) else r
                if r is None:
                    plan.outputs.append(("none",))
                elif isinstance(val, torch.Tensor):
                    # (a value returned twice is one ONNX output and one tensor: translate.py's NOTE)
                    if env[r] not in kept:
                        kept.append(env[r])
                    plan.outputs.append(("tensor", kept.index(env[r]), [compat.sym_expr(s) for s in val.shape]))
                elif isinstance(val, (torch.SymInt, int)):
                    plan.outputs.append(("int", compat.sym_expr(val)))
                else:
                    raise NotDynamic(f"the graph returns {type(val).__name__}")
            graph.output(tuple(kept))
        elif node.op == "call_function" and node.target in _REWRITES:
            args = torch.fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
            env[node] = _REWRITES[node.target](graph, *args, **kwargs)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    for out in plan.outputs:
        exprs = out[2] if out[0] == "tensor" else [out[1]] if out[0] == "int" else []
        for e in exprs:
            missing = [s for s in getattr(e, "free_symbols", ()) if s not in bound]
            if missing:
                raise NotDynamic(f"the output size {e} needs {missing}, which no input gives")
    return torch.fx.GraphModule(gm, graph), plan


class DynamicRunner(GraphRunner):
    """A graph with symbolic sizes in one InferenceSession: outputs allocated at the sizes the inputs
    give (a boxed callable for AOTAutograd)."""

    def __init__(self, gm: torch.fx.GraphModule, what: str, device: torch.device, options, fusions: bool) -> None:
        prepared, self.plan = prepare(gm)
        in_torch = untranslatable(prepared)
        if in_torch:
            raise NotDynamic(f"the {what} graph runs {', '.join(sorted(set(in_torch.values())))} in PyTorch")
        graph: TranslatedGraph = translate_cached(prepared, what, fusions, options.build_cache, dynamic=True)
        #: with ``aggressive_cpu_fallback``: the split off the host shape program (its ``moved`` nodes,
        #: ``program`` and ``feeds``), else None
        self.host_split = None
        #: computes the main graph's host-fed inputs from the bound tensors (None: nothing moved)
        self.host_shapes_runner: HostShapeRunner | None = None
        if options.aggressive_cpu_fallback:
            # (after the build cache: the cached translation is the same with the option on or off)
            graph, self.host_split = split_shapes(graph, what)
            if self.host_split is not None and self.host_split.feeds:
                self.host_shapes_runner = HostShapeRunner(
                    self.host_split, {name: i for i, name in enumerate(graph.input_names)}
                )
        super().__init__(graph, device, options, what)

    def __call__(self, args: list) -> list:
        graph, plan = self.graph, self.plan
        device_type, device_id = self._ort_device
        values = plan.values(args)
        binding = self.session.io_binding()
        held = []
        for name, i in zip(graph.input_names, plan.tensor_at):
            t = args[i].detach()
            if not t.is_contiguous():
                t = t.contiguous()
            held.append(t)
            binding.bind_input(name, device_type, device_id, numpy_dtype(t.dtype), list(t.shape), t.data_ptr())
        if self.host_shapes_runner is not None:
            # the host shape program's values, CPU tensors (ORT's CUDA kernels read shape inputs from host memory)
            for feed, t in zip(self.host_split.feeds, self.host_shapes_runner(held)):
                held.append(t)
                binding.bind_input(feed.name, "cpu", 0, numpy_dtype(t.dtype), list(t.shape), t.data_ptr())
        args.clear()  # (boxed convention: the caller's references go, ours stay until the run ends)
        result: list = []
        outs = []
        bound: dict[int, torch.Tensor] = {}
        for out, value in zip(plan.outputs, values):
            if out[0] == "tensor" and out[1] in bound:
                result.append(bound[out[1]])  # (the same value again: the same tensor)
            elif out[0] == "tensor":
                o = bound[out[1]] = torch.empty(value, dtype=graph.output_meta[out[1]][1], device=self.device)
                outs.append(o)
                binding.bind_output(graph.output_names[out[1]], device_type, device_id, numpy_dtype(o.dtype),
                                    list(o.shape), o.data_ptr())  # fmt: skip
                result.append(o)
            else:
                result.append(value)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as e:
            from ...errors import RuntimeRunError

            raise RuntimeRunError(f"onnxruntime failed to run the {self.what} graph: {e}") from e
        del held, outs
        return result


def split_shapes(graph: TranslatedGraph, what: str) -> tuple[TranslatedGraph, HostShapeSplit | None]:
    """``graph`` with its host-computable shape computations split off (the aggressive CPU fallback: the
    training engine's ``split_host_shapes``), and the split; the inputs with symbolic dims are read on the
    host. A split that fails leaves the graph whole (said in the log) and gives None."""
    import onnx

    from ...passes.host_shapes import split_host_shapes

    try:
        model = onnx.load_from_string(graph.model)
        symbolic = {
            v.name for v in model.graph.input if any(not d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)
        }
        main, split = split_host_shapes(model, symbolic)
    except Exception as e:
        logger.warning(
            "onnxruntime engine: aggressive_cpu_fallback: the %s graph's shape computations stay in it: "
            "the split failed (%s: %s)", what, type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "",
        )  # fmt: skip
        return graph, None
    logger.info("onnxruntime engine: the %s graph's %s", what, split.summary().splitlines()[0])
    if not split.feeds:
        return graph, split
    return dataclasses.replace(graph, model=main.SerializeToString()), split


def family_of(key: tuple) -> tuple:
    """A call signature (the engine's key) with each tensor's shape replaced by its rank: the calls one
    dynamic build may serve."""
    return (*key[:3], tuple((len(shape), *rest) for shape, *rest in key[3]), *key[4:])


class DynamicShapes:
    """The engine's dynamic builds, per family of call signatures (:func:`family_of`).

    A family's first call builds with static sizes; a later call whose sizes differ builds once with
    symbolic sizes in the dims that changed, and in the first dim of every input (the batch: a
    training loop's last smaller batch), and that build serves every later call whose other dims
    match and whose sizes pass the trace's guards. A family whose graphs cannot be dynamic keeps its
    per-shape builds (:meth:`refuse`).
    """

    def __init__(self) -> None:
        self._seen: dict[tuple, list[tuple]] = {}
        self._builds: dict[tuple, list[tuple[Any, list, Any]]] = {}
        self._refused: set[tuple] = set()
        self._fixed: dict[tuple, list[set[int]]] = {}

    def clear(self) -> None:
        self._seen.clear(), self._builds.clear(), self._refused.clear(), self._fixed.clear()

    def find(self, family: tuple, leaves: list[torch.Tensor]) -> Any:
        """The dynamic build that serves ``leaves``, or None."""
        for compiled, static, guards in self._builds.get(family, ()):
            if all(t.shape[d] == size for t, dims in zip(leaves, static) for d, size in dims) and guards(leaves):
                return compiled
        return None

    def dims(self, family: tuple, leaves: list[torch.Tensor]) -> list[set[int]] | None:
        """The dims to make symbolic for ``leaves``, or None (the family's first shape, or refused)."""
        seen = self._seen.get(family)
        if not seen or family in self._refused or any(t.numel() == 0 for t in leaves):
            return None
        shapes = [*seen, tuple(tuple(t.shape) for t in leaves)]
        fixed = self._fixed.get(family) or [set() for _ in leaves]
        out = []
        for i, t in enumerate(leaves):
            changed = {d for d in range(t.dim()) if len({s[i][d] for s in shapes}) > 1}
            out.append((changed | ({0} if t.dim() else set())) - fixed[i])
        return out if any(out) else None

    def seen(self, family: tuple, leaves: list[torch.Tensor]) -> None:
        self._seen.setdefault(family, []).append(tuple(tuple(t.shape) for t in leaves))

    def add(self, family: tuple, compiled: Any, dims: list[set[int]], leaves: list[torch.Tensor], guards) -> None:
        static = [tuple((d, t.shape[d]) for d in range(t.dim()) if d not in ds) for t, ds in zip(leaves, dims)]
        self._builds.setdefault(family, []).append((compiled, static, guards))

    def fix(self, family: tuple, graph: torch.fx.GraphModule | None, dims: list[set[int]]) -> None:
        """Note the dims the trace specialized (an LSTM's loop over the length): later builds of the family
        keep them static (a build per size, as the guards require anyway)."""
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"] if graph is not None else []
        if len(placeholders) < len(dims):
            return
        fixed = self._fixed.setdefault(family, [set() for _ in dims])
        for n, ds, f in zip(placeholders[len(placeholders) - len(dims) :], dims, fixed):
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                f.update(d for d in ds if d < val.dim() and isinstance(val.shape[d], int))

    def refuse(self, family: tuple) -> bool:
        """Keep per-shape builds for ``family``; True the first time (to say so once)."""
        first = family not in self._refused
        self._refused.add(family)
        return first
