"""Per-submodule parameter gathering inside the ORT graph (DeepSpeed ZeRO-3, ``zero3_gather="submodule"``).

Eager ZeRO-3 gathers a submodule's parameters in a forward pre-hook, releases them after its
forward, gathers them again before its backward and reduce-scatters their gradients as autograd
accumulates them. ORT runs one graph instead of the submodules' forwards, so this module puts the
same steps into the graph:

- **export**: a forward pre-hook on every submodule that owns partitioned parameters calls
  ``ortwrap_zero3::fetch_<n>(anchor, layer, *params)`` and the submodule's forward reads its
  results instead of the parameters (its post-hook puts the parameters back). ``anchor`` is the
  submodule's first tensor input, so ORT runs the gather when it reaches the submodule;
  ``layer`` is the submodule's index in :class:`LayerTable`. The op becomes an ATen node: through
  :func:`register_symbolics` under the TorchScript exporter; under the dynamo exporter it stays a
  custom op through ``torch.export`` (its ``Meta`` kernel) and the ATen fallback writes it
  (``export/aten_fallback.py``: an op without an ONNX translation).
- **forward**: the fetch node gathers the layer's parameters, hands the whole tensors to ORT and
  partitions the parameters at once: the memory lives exactly as long as ORT's values, which ORT
  frees after their last forward use (the rewrite below removes their backward uses).
- **gradient build**: the fetch node's gradient is ``ortwrap_zero3::grads_<n>`` (registered with
  ORT): it receives the whole gradients and hands each to the parameter's own gradient accumulator
  (``torch.autograd.graph.get_gradient_edge(p).node``), which runs the post-accumulate-grad hooks
  (DeepSpeed's reduce-scatter) as eager autograd would, then partitions the layer again.
- **after the gradient build** (:func:`rewrite_training_graph`): every backward use of a gathered
  tensor (or of a value computed from gathered tensors only, a transposed weight) reads a
  ``ortwrap_zero3::refetch_<n>(anchor, layer)`` node instead, anchored on a gradient the consumer
  reads, so the backward gathers each layer just before its gradient nodes. The parameter inputs
  lose their shapes (they are fed partitioned, empty) and their gradient outputs are removed: the
  gradients reached DeepSpeed inside the backward.

NOTE: the ops find the parameters through the *current* :class:`LayerTable` (set by the
integration around each forward and before each backward): graphs hold only layer indices, so a
cached graph is valid for any wrapper whose submodules run in the same order.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch
from torch import nn

from .._compat import torch as compat
from ..errors import UnsupportedInputError
from ..ops import ZERO3_MAX_ARITY, ZERO3_NAMESPACE

#: (declared in ``ops/declare.py``: the ATen bridge reads there that it registers no vjp for ``fetch_<n>``)
NAMESPACE = ZERO3_NAMESPACE
OP_PREFIX = NAMESPACE + "::"
#: Largest number of partitioned parameters one submodule may own.
MAX_ARITY = ZERO3_MAX_ARITY
_ATEN_DOMAIN = "org.pytorch.aten"


@dataclass
class LayerTable:
    """One wrapper's gather units and how to gather, partition and hand gradients over.

    Attributes:
        gather: ``gather(params)`` makes the parameters whole (a collective).
        partition: ``partition(params)`` frees them again.
        available: ``available(p)`` whether ``p`` is whole now.
        hand_over: ``hand_over(p, grad)`` accumulates a whole gradient into ``p`` the way autograd
            does (its post-accumulate-grad hooks included).
        layers: per layer index, its parameters (in the order of the fetch node's outputs).
        names: per layer index, the parameters' attribute names on their submodule.
        index: ``id(submodule) -> layer index``.
        exporting: an export is tracing the module (parameters already whole: the ops return copies).
        backward_gathered: per layer, the parameters its backward gather made whole (partitioned
            again once their gradients were handed over).
        tracker: when set (:class:`GatherTracker`), records every gather and how many elements of
            whole parameters are alive, for tests and benchmarks.
    """

    gather: Callable[[list[nn.Parameter]], None]
    partition: Callable[[list[nn.Parameter]], None]
    available: Callable[[nn.Parameter], bool]
    hand_over: Callable[[nn.Parameter, torch.Tensor], None]
    layers: list[list[nn.Parameter]] = field(default_factory=list)
    names: list[list[str]] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)
    exporting: bool = False
    backward_gathered: dict[int, list[nn.Parameter]] = field(default_factory=dict)
    tracker: GatherTracker | None = None

    def register(self, root: nn.Module, is_partitioned: Callable[[torch.Tensor], bool]) -> None:
        """Number the submodules of ``root`` that own partitioned parameters, in module order (a
        graph holds only these numbers, so a cached graph fits any wrapper of the same structure).

        Raises:
            UnsupportedInputError: a parameter is owned by two submodules (tied weights), or a
                submodule owns more than :data:`MAX_ARITY`.
        """
        self.layers.clear()
        self.names.clear()
        self.index.clear()
        owner: dict[int, str] = {}
        for path, m in root.named_modules():
            table = compat.parameter_table(m)
            names = [k for k, p in table.items() if p is not None and is_partitioned(p)]
            if not names:
                continue
            what = path or type(root).__name__
            if len(names) > MAX_ARITY:
                raise UnsupportedInputError(
                    f"ORTWrap with zero3_gather='submodule': {what} owns {len(names)} partitioned parameters "
                    f"(at most {MAX_ARITY}). Use zero3_gather='module'"
                )
            params = [table.get(k) for k in names]  # (OrderedDict.get: no DeepSpeed gather-on-access)
            for k, p in zip(names, params):
                if id(p) in owner:
                    raise UnsupportedInputError(
                        f"ORTWrap with zero3_gather='submodule': parameter {what}.{k} is also {owner[id(p)]} (a tied "
                        "weight); ortwrap gathers parameters per owning submodule. Use zero3_gather='module'"
                    )
                owner[id(p)] = f"{what}.{k}"
            self.index[id(m)] = len(self.layers)
            self.layers.append(params)
            self.names.append(names)

    def sample(self) -> None:
        if self.tracker is not None:
            self.tracker.sample(self)


class GatherTracker:
    """Records the gathers of a :class:`LayerTable` and how many elements of whole parameters are alive.

    "Alive" counts every tensor a gather node handed to ORT until ORT drops it, plus every
    parameter DeepSpeed holds whole that no such tensor shares memory with; sampled at each gather
    node and after each partition.

    Attributes:
        events: ``(kind, layer)`` per gather node run, ``kind`` ``"forward"`` or ``"backward"``.
        peak: the most elements alive at once since :meth:`reset`.
        live_layers_peak: the most layers with whole parameters alive at once.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.handed: dict[int, tuple[int, int, int]] = {}  # id -> (data_ptr, numel, layer)
        self.peak = 0
        self.live_layers_peak = 0

    def add(self, kind: str, layer: int, tensors: list[torch.Tensor], table: LayerTable) -> None:
        self.events.append((kind, layer))
        for t in tensors:
            # NOTE: torch keeps a tensor's Python object alive while C++ (ORT's DLPack value) holds
            # it, so the finalizer runs when ORT drops the value.
            key = id(t)
            self.handed[key] = (t.data_ptr(), t.numel(), layer)
            weakref.finalize(t, self.handed.pop, key, None)
        self.sample(table)

    def sample(self, table: LayerTable) -> None:
        total, layers, ptrs = 0, set(), set()
        for ptr, numel, layer in list(self.handed.values()):
            if ptr not in ptrs:
                ptrs.add(ptr)
                total += numel
                layers.add(layer)
        for i, params in enumerate(table.layers):
            for p in params:
                if table.available(p) and p.data.data_ptr() not in ptrs:
                    total += p.numel()
                    layers.add(i)
        self.peak = max(self.peak, total)
        self.live_layers_peak = max(self.live_layers_peak, len(layers))


_local = threading.local()


def set_current(table: LayerTable | None) -> None:
    """The table the ops of the graph that runs next read (per thread)."""
    _local.table = table


def current() -> LayerTable:
    table = getattr(_local, "table", None)
    if table is None:
        raise RuntimeError(
            "ortwrap: a ZeRO-3 gather node ran outside a step of its ORTWrap module (no parameter table is set)"
        )
    return table


# ------------------------------------------------------------------------------------- the ops


def _results(out: list[torch.Tensor]) -> Any:
    """An op's results as its schema returns them: one Tensor, or a tuple."""
    return out[0] if len(out) == 1 else tuple(out)


def _fetch(*args: torch.Tensor) -> Any:
    *stubs, _anchor, layer = args
    table = current()
    if table.exporting:  # the trace: parameters are whole; results must not alias the op's inputs
        return _results([s.detach().clone() for s in stubs])
    i = int(layer)
    params = table.layers[i]
    missing = [p for p in params if not table.available(p)]
    if missing:
        table.gather(missing)
    # Parameters that stayed whole (persistent) are copied: ORT must not get an alias of its input.
    gathered = {id(p) for p in missing}
    out = [p.data if id(p) in gathered else p.data.clone() for p in params]
    if missing:
        table.partition(missing)  # the memory now lives as long as ORT's values
    if table.tracker is not None:
        table.tracker.add("forward", i, out, table)
    return _results(out)


def _refetch(anchor: torch.Tensor, layer: torch.Tensor, which: torch.Tensor, after: torch.Tensor | None = None) -> Any:
    table = current()
    i = int(layer)
    params = [table.layers[i][k] for k in which.tolist()]
    missing = [p for p in params if not table.available(p)]
    if missing:
        table.gather(missing)
        table.backward_gathered.setdefault(i, []).extend(missing)
    out = [p.data for p in params]
    if table.tracker is not None:
        table.tracker.add("backward", i, out, table)
    return _results(out)


def _grads(n: int, *args: torch.Tensor | None) -> Any:
    # (``after`` only orders the node, see _order_backward; the dispatcher drops it when absent)
    grads, layer = args[:n], args[n]
    table = current()
    i = int(layer)
    params = table.layers[i]
    # AccumulateGrad needs the parameter whole (as eager ZeRO-3 has it in the module's backward).
    missing = [p for p, g in zip(params, grads) if g is not None and not table.available(p)]
    if missing:
        table.gather(missing)
        table.backward_gathered.setdefault(i, []).extend(missing)
    for p, g in zip(params, grads):
        if g is not None and p.requires_grad:
            table.hand_over(p, g)
    table.sample()
    again = table.backward_gathered.pop(i, [])
    if again:
        table.partition([p for p in again if table.available(p)])
    table.sample()
    return _results([torch.empty(0, dtype=g.dtype if g is not None else torch.float32) for g in grads])


def _meta_fetch(*args: torch.Tensor) -> Any:
    stubs = args[:-2]
    return _results([torch.empty_like(s, device="meta") for s in stubs])


@functools.cache
def define_ops() -> None:
    """Define ``fetch_<n>``, ``refetch_<n>`` and ``grads_<n>`` for n up to :data:`MAX_ARITY` (once)."""
    lib = torch.library.Library(NAMESPACE, "DEF")
    define_ops.library = lib  # keep the registrations alive
    for n in range(1, MAX_ARITY + 1):
        outs = ", ".join(["Tensor"] * n)
        params = ", ".join(f"Tensor p{k}" for k in range(n))
        grads = ", ".join(f"Tensor? g{k}" for k in range(n))
        # NOTE: the parameters come first: with them after the anchor, ORT 1.19.2's gradient builder
        # built no gradient for them from the registered definition (observed; W_grad "not found").
        lib.define(f"fetch_{n}({params}, Tensor anchor, Tensor layer) -> ({outs})")
        lib.define(f"refetch_{n}(Tensor anchor, Tensor layer, Tensor which, Tensor? after=None) -> ({outs})")
        lib.define(f"grads_{n}({grads}, Tensor layer, Tensor? after=None) -> ({outs})")
        lib.impl(f"fetch_{n}", _fetch, "CompositeExplicitAutograd")
        lib.impl(f"fetch_{n}", _meta_fetch, "Meta")
        lib.impl(f"refetch_{n}", _refetch, "CompositeExplicitAutograd")
        lib.impl(f"grads_{n}", functools.partial(_grads, n), "CompositeExplicitAutograd")


_registered_gradients: set[int] = set()


def register_gradient(n: int) -> None:
    """Tell ORT that the gradient of ``fetch_<n>`` is one ``grads_<n>`` node (once per arity)."""
    if n in _registered_gradients:
        return
    from ..grad.aten import register_gradient as register

    register(
        f"{OP_PREFIX}fetch_{n}",
        "",
        [f"GO({k})" for k in range(n)] + [f"I({n + 1})"],
        [f"GI({k})" for k in range(n)],
        f"{OP_PREFIX}grads_{n}",
        {n, n + 1},
    )
    _registered_gradients.add(n)


def _fetch_symbolic(n: int) -> Callable:
    def symbolic(g, *args):
        node = g.original_node
        outputs = list(node.outputs())
        result = g.op(
            f"{_ATEN_DOMAIN}::ATen",
            *args,
            operator_s=f"{OP_PREFIX}fetch_{n}",
            overload_name_s="",
            outputs=n,
        )
        results = list(result) if isinstance(result, (list, tuple)) else [result]
        for r, o in zip(results, outputs):
            r.setType(o.type())
        return result

    return symbolic


@functools.cache
def register_symbolics(opset: int) -> None:
    """TorchScript symbolics: ``fetch_<n>`` becomes an ATen node (registered once per opset)."""
    for n in range(1, MAX_ARITY + 1):
        torch.onnx.register_custom_op_symbolic(f"{OP_PREFIX}fetch_{n}", _fetch_symbolic(n), opset)


# ------------------------------------------------------------------------------------- export hooks


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def install_export_hooks(root: nn.Module, table: LayerTable) -> Callable[[], None]:
    """Hooks that make each submodule owning partitioned parameters read them from a fetch node while
    ``root`` is traced; returns the function that removes them (and puts back any parameter)."""
    define_ops()
    handles = []
    swapped: dict[int, tuple[dict, dict]] = {}
    called: set[int] = set()

    def pre(m: nn.Module, args: tuple, kwargs: dict) -> None:
        layer = table.index.get(id(m))
        if layer is None:
            return None
        if id(m) in called:
            raise UnsupportedInputError(
                f"ORTWrap with zero3_gather='submodule': {type(m).__name__} runs more than once in one forward; "
                "ortwrap gathers each submodule's parameters once per forward. Use zero3_gather='module'"
            )
        called.add(id(m))
        params_table = compat.parameter_table(m)
        names = table.names[layer]
        # NOTE: the tensors the module holds now, not ``table.layers``: torch.export swaps the
        # parameters for its own (fake) ones while it traces, and reads any other tensor as a constant.
        params = [params_table[k] for k in names]
        register_gradient(len(names))
        anchor = _first_tensor(args, kwargs)
        if anchor is None:
            anchor = torch.zeros(())
        fetch = getattr(torch.ops.ortwrap_zero3, f"fetch_{len(names)}")
        outs = fetch(*params, anchor, torch.tensor(layer, dtype=torch.int64))
        outs = outs if isinstance(outs, (list, tuple)) else (outs,)
        for t, p in zip(outs, params):
            # The trace records which inputs need gradients (a PythonOp's input_requires_grads).
            t.requires_grad_(p.requires_grad)
        swapped[id(m)] = (params_table, dict(zip(names, params)))
        for k, t in zip(names, outs):
            params_table[k] = t
        return None

    def post(m: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        entry = swapped.pop(id(m), None)
        if entry is not None:
            entry[0].update(entry[1])
        return None

    for m in root.modules():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))

    def remove() -> None:
        for h in handles:
            h.remove()
        for params_table, original in swapped.values():
            params_table.update(original)
        swapped.clear()

    return remove


# ------------------------------------------------------------------------------------- graph rewrite


def _attr(node: onnx.NodeProto, name: str) -> str | None:
    for a in node.attribute:
        if a.name == name:
            return a.s.decode()
    return None


def _op(node: onnx.NodeProto) -> str | None:
    if node.op_type != "ATen" or node.domain != _ATEN_DOMAIN:
        return None
    return _attr(node, "operator")


def _order_backward(g: onnx.GraphProto, fetches: list[onnx.NodeProto]) -> None:
    """Hand each layer's gradients over (and release it) before the backward gathers the next one.

    ORT would run the gradient hand-over nodes wherever its order puts them (at the end of the
    backward: every layer gathered at once). Each ``grads`` and ``refetch`` node of a layer gets an
    extra input, an output of the ``grads`` node of the layer that runs after it in the forward:
    acyclic, because a layer's weight gradient depends only on the layers that run after it.
    """
    layer_input = {f.input[len(f.output) + 1]: position for position, f in enumerate(fetches)}
    grads_at: dict[int, onnx.NodeProto] = {}
    refetch_at: dict[int, onnx.NodeProto] = {}
    for n in g.node:
        op = _op(n) or ""
        if op.startswith(OP_PREFIX + "grads_"):
            grads_at[layer_input[n.input[len(n.output)]]] = n
        elif op.startswith(OP_PREFIX + "refetch_"):
            refetch_at[layer_input[n.input[1]]] = n
    following: onnx.NodeProto | None = None
    for position in range(len(fetches) - 1, -1, -1):
        if following is not None:
            for node in (grads_at.get(position), refetch_at.get(position)):
                if node is not None:
                    node.input.append(following.output[0])
        following = grads_at.get(position, following)


def rewrite_training_graph(graph: Any) -> Any:
    """The built training graph with per-layer gathers in the backward (see the module docstring).

    ``graph`` is a ``grad.builder.TrainingGraph``; returned unchanged when it has no fetch node.
    """
    import dataclasses

    model = graph.model()
    g = model.graph
    fetches = [n for n in g.node if (_op(n) or "").startswith(OP_PREFIX + "fetch_")]
    if not fetches:
        return graph
    stubs = {name for n in fetches for name in n.input[: len(n.output)]}
    # A partitioned parameter read by anything but its gather node would be fed empty.
    for n in g.node:
        op = _op(n) or ""
        if op.startswith(OP_PREFIX):
            continue
        for name in n.input:
            if name in stubs:
                raise UnsupportedInputError(
                    f"ORTWrap with zero3_gather='submodule': parameter input {name!r} is read outside the forward of "
                    f"the submodule that owns it (by {n.op_type} node {n.name!r}); ortwrap gathers parameters per "
                    "owning submodule. Use zero3_gather='module'"
                )
    producer = {o: n for n in g.node for o in n.output if o}
    consts = {i.name for i in g.initializer}
    layer_of_value: dict[str, tuple[onnx.NodeProto, int]] = {}
    for f in fetches:
        for k, o in enumerate(f.output):
            layer_of_value[o] = (f, k)

    yields = [n for n in g.node if n.op_type == "YieldOp"]
    if graph.has_backward and yields:
        # Backward: everything downstream of the YieldOp's outputs.
        downstream = set(yields[0].output)
        consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in g.node:
            for name in n.input:
                consumers.setdefault(name, []).append(n)
        stack = list(downstream)
        backward_nodes: set[int] = set()
        while stack:
            v = stack.pop()
            for c in consumers.get(v, []):
                if id(c) not in backward_nodes:
                    backward_nodes.add(id(c))
                    for o in c.output:
                        if o and o not in downstream:
                            downstream.add(o)
                            stack.append(o)
        # Values computed from gathered tensors and constants only (a transposed weight).
        weight_only: dict[str, int] = {}
        for o, (f, _) in layer_of_value.items():
            weight_only[o] = id(f)
        changed = True
        while changed:
            changed = False
            for n in g.node:
                if id(n) in backward_nodes or n.op_type == "YieldOp" or (_op(n) or "").startswith(OP_PREFIX):
                    continue
                ins = [i for i in n.input if i]
                layers = {weight_only[i] for i in ins if i in weight_only}
                if len(layers) != 1:
                    continue
                if all(
                    i in weight_only or i in consts or (i in producer and producer[i].op_type == "Constant")
                    for i in ins
                ):
                    for o in n.output:
                        if o and o not in weight_only:
                            weight_only[o] = next(iter(layers))
                            changed = True
        refetch_out: dict[int, list[str]] = {}
        clones: dict[str, str] = {}
        new_nodes: list[tuple[onnx.NodeProto, list[onnx.NodeProto]]] = []  # (insert before, nodes)
        counter = [0]

        # Which gathered tensors the backward reads (directly or through weight-only values): only
        # those are gathered again (a bias, say, is not needed for any gradient).
        needed: dict[int, set[int]] = {}

        def mark(v: str) -> None:
            if v in layer_of_value:
                f, k = layer_of_value[v]
                needed.setdefault(id(f), set()).add(k)
                return
            for i in producer[v].input:
                if i in weight_only:
                    mark(i)

        for n in g.node:
            if id(n) in backward_nodes:
                for i in n.input:
                    if i in weight_only:
                        mark(i)

        def clone(v: str, anchor: str, pending: list[onnx.NodeProto]) -> str:
            if v in clones:
                return clones[v]
            if v in layer_of_value:
                f, _ = layer_of_value[v]
                outs = refetch_out.get(id(f))
                if outs is None:
                    n_out = len(f.output)
                    which = sorted(needed[id(f)])
                    outs = [f"{f.output[k]}__zero3_bwd" for k in which]
                    which_name = f"{f.output[0]}__zero3_which"
                    g.initializer.append(
                        onnx.helper.make_tensor(which_name, onnx.TensorProto.INT64, [len(which)], which)
                    )
                    node = onnx.helper.make_node(
                        "ATen",
                        [anchor, f.input[n_out + 1], which_name],
                        outs,
                        name=f"{f.name or 'fetch'}__zero3_refetch",
                        domain=_ATEN_DOMAIN,
                        operator=f"{OP_PREFIX}refetch_{len(which)}",
                        overload_name="",
                    )
                    pending.append(node)
                    refetch_out[id(f)] = outs
                    for o, k in zip(outs, which):
                        clones[f.output[k]] = o
                return clones[v]
            p = producer[v]
            counter[0] += 1
            copy = onnx.NodeProto()
            copy.CopyFrom(p)
            copy.name = f"{p.name or p.op_type}__zero3_bwd{counter[0]}"
            del copy.input[:]
            copy.input.extend(clone(i, anchor, pending) if i in weight_only else i for i in p.input)
            del copy.output[:]
            copy.output.extend(f"{o}__zero3_bwd" if o else "" for o in p.output)
            for o, src in zip(copy.output, p.output):
                if src:
                    clones[src] = o
            pending.append(copy)
            return clones[v]

        for n in list(g.node):
            if id(n) not in backward_nodes:
                continue
            reads = [i for i in n.input if i in weight_only]
            if not reads:
                continue
            anchor = next(i for i in n.input if i in downstream)
            pending: list[onnx.NodeProto] = []
            mapped = {i: clone(i, anchor, pending) for i in reads}
            for k, i in enumerate(n.input):
                if i in mapped:
                    n.input[k] = mapped[i]
            if pending:
                new_nodes.append((n, pending))
        # The copies have their originals' types (ORT cannot infer through an ATen node).
        types = {v.name: v for v in (*g.value_info, *g.input, *g.output)}
        for src, copy_name in clones.items():
            if src in types:
                vi = onnx.ValueInfoProto()
                vi.CopyFrom(types[src])
                vi.name = copy_name
                g.value_info.append(vi)
        for before, nodes in new_nodes:
            at = list(g.node).index(before)
            for k, node in enumerate(nodes):
                g.node.insert(at + k, node)
        # Forward values computed from weights that nothing reads any more.
        while True:
            used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
            dead = [
                n
                for n in g.node
                if n.output
                and all(o in weight_only and o not in layer_of_value and o not in used for o in n.output if o)
                and not (_op(n) or "").startswith(OP_PREFIX)
            ]
            if not dead:
                break
            for n in dead:
                g.node.remove(n)
    # Gradient nodes: every output named (the ATen kernel fails on an unnamed one). Their (empty) stub
    # gradients stay graph outputs, so that the nodes run, but are not fetched: the gradients reached
    # the parameters inside the backward.
    stub_grads: set[str] = set()
    grad_types = []
    for n in g.node:
        if (_op(n) or "").startswith(OP_PREFIX + "grads_"):
            for k, o in enumerate(n.output):
                if not o:
                    n.output[k] = f"{n.name or 'grads'}__unused{k}"
                stub_grads.add(n.output[k])
                # (the stubs' gradients are empty tensors of the stub's type; GO(k) has that type)
                grad_types.append((n.output[k], n.input[k]))
    known = {v.name: v.type.tensor_type.elem_type for v in (*g.value_info, *g.input, *g.output)}
    _order_backward(g, fetches)
    # The partitioned parameters are fed empty (the gather nodes read the parameters themselves).
    for i in g.input:
        if i.name in stubs:
            i.type.tensor_type.ClearField("shape")
    keep_vi = [v for v in g.value_info if v.name not in stubs]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    outputs = {o.name: o for o in g.output}
    for name, go in grad_types:
        if name in outputs:
            outputs[name].type.tensor_type.ClearField("shape")
        else:
            g.value_info.append(onnx.helper.make_tensor_value_info(name, known.get(go) or onnx.TensorProto.FLOAT, None))
    grad_pairs = [
        (name, index) for name, index in zip(graph.grad_names, graph.info.grad_feed_index) if name not in stub_grads
    ]
    info = dataclasses.replace(graph.info, grad_feed_index=tuple(i for _, i in grad_pairs))
    return dataclasses.replace(
        graph,
        model_bytes=model.SerializeToString(),
        grad_names=tuple(n for n, _ in grad_pairs),
        info=info,
    )
