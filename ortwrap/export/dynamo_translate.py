"""The dynamo exporter's translation strategy: how ortwrap drives ``torch.onnx``'s translation of a
captured ``ExportedProgram`` (moved here from ``_compat/torch.py``, which keeps the private names it
calls).

:func:`dynamo_to_onnx` first translates the captured graph as it is (no decompositions: torchlib or
ortwrap's table has a translation for every op, which skips the exporter's retrace), and falls back
to the exporter's own path, which decomposes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._compat import torch as compat

__all__ = ["ExtraTranslations", "dynamo_to_onnx"]

_log = logging.getLogger("ortwrap")

#: ``extra(program, is_registered, allow_missing) -> {op: translation} | None``: translations that
#: depend on the graph (ATen nodes for ops without one); None: "decompose first".
ExtraTranslations = Callable[[Any, Callable[[Any], bool], bool], "dict[Any, Callable[..., Any]] | None"]


def dynamo_to_onnx(
    program: torch.export.ExportedProgram,
    *,
    table: dict[Any, Callable[..., Any]],
    opset: int,
    decompose: bool,
    extra: ExtraTranslations | None = None,
    decompositions: dict[Any, tuple[Callable[[Any], bool], Callable[..., Any]]] | None = None,
) -> tuple[Any, bool]:
    """``torch.onnx.export(program, dynamo=True, optimize=False, custom_translation_table=table)``'s
    ``ir.Model``, and whether the graph was decomposed first.

    ``decompose=False`` first tries to translate the captured graph as it is: when torchlib (or
    ``table``) has a translation for every op, that skips the exporter's ``run_decompositions``, which
    retraces the whole graph with symbolic shapes (most of the exporter's time). Ops it cannot
    translate as they are send it down the exporter's own path, which decomposes them; ops that still
    have no translation then get ``extra``'s (ATen nodes). ``decompositions``
    (``{op: (needs(node), decomposition)}``) run first, where a node needs one.
    """
    registry = compat.dynamo_registry(opset, table)
    wanted = {
        op: fn
        for op, (needs, fn) in (decompositions or {}).items()
        if any(n.op == "call_function" and n.target is op and needs(n) for n in program.graph_module.graph.nodes)
    }
    if wanted:
        _views_as_reshapes(program.graph_module)
        program = program.run_decompositions(wanted)
    if not decompose:
        try:
            program = _functionalized(program)
        except Exception as e:  # the exporter's own path below decomposes (and functionalizes) it
            _log.debug("dynamo: functionalizing failed (%s): %s", type(e).__name__, e)
        try:
            with compat.onnx_exporting():
                gm = program.graph_module
                for node in list(gm.graph.nodes):  # checks of the capture's own metadata: no value
                    if node.op == "call_function" and node.target is compat.assert_metadata_op() and not node.users:
                        gm.graph.erase_node(node)
                _float_clamp_bounds(gm)
                chosen = extra(program, registry.is_registered, False) if extra is not None else {}
                if chosen is not None:
                    # The type promotion pass re-runs every op on fake tensors, as the retrace does.
                    _views_as_reshapes(gm)
                    user_scalars = set(_scalar_tensors(gm))
                    compat.insert_type_promotion(gm)
                    _number_clamp_bounds(gm, user_scalars)
                    gm = compat.remove_assertion_nodes(gm)
                    if gm is not program.graph_module:
                        compat.set_graph_module(program, gm)
                    translated = compat.translate_exported(program, compat.with_extra_translations(registry, chosen))
                    return translated.model, False
        except Exception as e:
            _log.debug("dynamo: translating without decompositions failed (%s): %s", type(e).__name__, e)
    with compat.onnx_exporting():
        prepared = compat.prepare_exported(program, registry)
        _number_clamp_bounds(prepared.graph_module, set())
        chosen = extra(prepared, registry.is_registered, True) if extra is not None else {}
        translated = compat.translate_exported(prepared, compat.with_extra_translations(registry, chosen or {}))
    return translated.model, True


def _functionalized(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` without in-place ATen ops (``add_``: torchlib translates none), through
    ``run_decompositions({})``, which functionalizes and decomposes nothing; ``program`` itself
    when it has none.

    The retrace re-runs each ``aten.view`` on fake tensors whose strides come from the ops' meta
    kernels, not from the capture (T5: fused attention's output gets the math kernel's strides, and
    the ``view`` after its transpose fails): ``view`` is re-run as ``reshape``, the same values.
    Both look into the bodies of higher-order ops too (an autocast region's).
    """
    gm = program.graph_module
    mutating = [
        n
        for n in _all_nodes(gm)
        if n.op == "call_function"
        and compat.is_op_overload(n.target)
        and n.target.namespace == "aten"
        and compat.op_schema(n.target).is_mutable
        and not _detach_of_unshared(n)
    ]
    if not mutating:
        return program
    _views_as_reshapes(gm)
    return program.run_decompositions({})


def _detach_of_unshared(node: torch.fx.Node) -> bool:
    """A ``detach_`` of a value nothing else reads (HF models' ``torch.tensor([]).detach_()`` in
    ``DynamicCache``): it changes autograd metadata only, and the translation is the identity
    (``export/translations.py``), so it needs no functionalization (a retrace of the whole graph:
    ~3 of the 4.5 CPU seconds of HF GPT-2's dynamo export)."""
    arg = node.args[0] if node.args else None
    return node.target is torch.ops.aten.detach_.default and isinstance(arg, torch.fx.Node) and len(arg.users) == 1


def _all_nodes(gm: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    """The nodes of ``gm`` and of the graph modules it calls (the bodies of higher-order ops:
    under autocast, torch.export puts the autocast region in a ``wrap_with_autocast`` submodule)."""
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            yield from module.graph.nodes


#: the clamp family whose number bounds ``_float_clamp_bounds`` and ``_number_clamp_bounds`` keep numbers
_CLAMPS = ("clamp", "clip", "clamp_min", "clamp_max")


def _floating_clamps(gm: torch.fx.GraphModule, overload: str) -> list[tuple[torch.fx.Node, torch.dtype]]:
    """The ``overload`` calls of :data:`_CLAMPS` on a floating value in ``gm`` and its submodules, with
    that value's dtype."""
    targets = {getattr(getattr(torch.ops.aten, op), overload) for op in _CLAMPS}
    found = []
    for node in _all_nodes(gm):
        if node.op != "call_function" or node.target not in targets or not node.args:
            continue
        val = getattr(node.args[0], "meta", {}).get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            found.append((node, val.dtype))
    return found


def _float_clamp_bounds(gm: torch.fx.GraphModule) -> None:
    """Int bounds of a floating ``clamp``/``clip``/``clamp_min``/``clamp_max`` as floats (the same
    numbers: eager casts them to the input's dtype). Type promotion would make the call
    ``clamp.Tensor`` of 0-d bounds, translated as ``Max``/``Min``, whose ORT gradient splits it half
    and half at a bound, where eager's number-bound clamp gives all (torch 2.13) or nothing (2.14):
    a float bound keeps the number overload, which ``ops.ATEN_OPS`` sends to PyTorch where needed."""

    def as_float(v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    for node, _ in _floating_clamps(gm, "default"):
        node.args = (node.args[0], *map(as_float, node.args[1:]))
        node.kwargs = {k: as_float(v) for k, v in node.kwargs.items()}


def _scalar_tensors(gm: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    """The ``aten.scalar_tensor`` nodes of ``gm`` and its submodules."""
    return (n for n in _all_nodes(gm) if n.op == "call_function" and n.target is torch.ops.aten.scalar_tensor.default)


def _number_clamp_bounds(gm: torch.fx.GraphModule, keep: set[torch.fx.Node]) -> None:
    """Number bounds of a floating ``clamp``/``clip``/``clamp_min``/``clamp_max`` back as numbers
    after the exporter's type promotion (on ``gm`` and its submodules).

    The pass takes a Python float for a float32 value (an int for int64): on a float64 or bfloat16
    value (autocast's too) it makes each number bound a 0-d ``scalar_tensor`` of the value's dtype
    and the call the ``Tensor`` overload, which torchlib writes as ``Max``/``Min``, whose ORT
    gradient splits it half and half at a bound, where eager's number-bound clamp gives all (torch
    2.13) or nothing (2.14); ``ops.ATEN_OPS`` chose for the number overload. The number overload
    computes the same (eager casts a number bound to the value's dtype; torchlib's ``CastLike``).
    ``keep``: ``scalar_tensor`` nodes the capture had (the program's own tensor bounds)."""

    def number(arg: Any, dtype: torch.dtype) -> Any:
        if arg is None:
            return None
        if (
            isinstance(arg, torch.fx.Node)
            and arg not in keep
            and arg.op == "call_function"
            and arg.target is torch.ops.aten.scalar_tensor.default
            and len(arg.args) == 1
            and isinstance(arg.args[0], (int, float))
            and not isinstance(arg.args[0], bool)
            and arg.kwargs.get("dtype") == dtype
            and len(arg.users) == 1
        ):
            return float(arg.args[0])
        raise ValueError  # a tensor bound: the call stays

    changed: set[torch.fx.Graph] = set()
    for node, dtype in _floating_clamps(gm, "Tensor"):
        try:
            args = [number(a, dtype) for a in node.args[1:]]
            kwargs = {k: number(v, dtype) for k, v in node.kwargs.items()}
        except ValueError:
            continue
        bounds = [*node.args[1:], *node.kwargs.values()]
        node.target = node.target.overloadpacket.default
        node.args = (node.args[0], *args)
        node.kwargs = kwargs
        for b in bounds:
            if isinstance(b, torch.fx.Node) and not b.users:
                node.graph.erase_node(b)
        changed.add(node.graph)
    for graph in changed:
        graph.owning_module.recompile()


def _views_as_reshapes(gm: torch.fx.GraphModule) -> None:
    """Every ``aten.view`` of ``gm`` and its submodules as ``aten.reshape`` (same values; see
    :func:`_functionalized`)."""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.aten.view.default:
                node.target = torch.ops.aten.reshape.default
                changed = True
        if changed:
            module.recompile()
