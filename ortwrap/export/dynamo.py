"""Export with the dynamo exporter (``torch.export`` + ``torch.onnx.export(ExportedProgram)``).

The module is captured through the same adapter as the TorchScript path (flat tensor inputs in,
flat tensor outputs followed by every buffer out), then:

1. ``torch.export.export(..., strict=False)`` with ``Dim.AUTO`` on every dimension: a dimension
   stays symbolic unless the model's code fixes it (a feature size that meets a weight, or a size
   of 0/1 in the example). The dims the capture fixed or tied together are recorded as guards
   (:class:`ShapeGuards`): a call that breaks one gets a new export instead of a wrong result.
2. ``torch.onnx.export(program, optimize=False)``: the exporter's optimizer folds ``Transpose(W)``
   into anonymous constants and merges equal initializers, which destroys parameter identity.
3. Parameters and buffers, initializers in the exporter's output, are moved to graph inputs, so
   each step feeds the tensors the optimizer updates in place (as in the TorchScript path).
4. The onnxscript optimizer then runs with the parameters safely out of reach: it inlines the
   exporter's onnxscript functions, turns ``SplitToSequence``/``SequenceAt`` into ``Split`` and
   removes ``CastLike``/``Constant`` clutter.

autograd.Functions are bridged by :mod:`ortwrap.bridge.dynamo`: each call becomes one custom op
during capture and one ``com.microsoft::PythonOp`` in the ONNX graph, exactly like the TorchScript
path's, so the Function's own backward runs. The passes that follow (optional outputs, control
flow, sequence ops on the gradient path) are the shared pipeline's.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import onnx
import onnx_ir as ir
import torch
from torch import nn

from .._compat import torch as compat
from ..bridge import dynamo as bridge_dynamo
from ..errors import ExportError, UnsupportedOutputError, output_error_in
from ..graph.model import ExportedModel
from .adapter import Adapter, finish_export, no_ambient_autocast, preserved_state, state_tensors
from .aten_fallback import fallback_translations
from .context import capture_context
from .dynamo_translate import dynamo_to_onnx
from .retry import drop_error_checks, failed_call, retry_plan
from .translations import (
    TRAINING_ATEN_OPS,
    number_operands_as_tensors,
    training_decompositions,
    training_translations,
)

_log = logging.getLogger("ortwrap")

#: Opset of the dynamo exporter's output; ORT 1.19.2 loads up to 21.
DYNAMO_OPSET = 20


@dataclass(frozen=True)
class ShapeGuards:
    """What the capture assumed about input shapes beyond their ranks.

    Attributes:
        static: ``(input index, dim, size)`` for each dimension the capture fixed.
        equal: groups of ``(input index, dim)`` the capture assumed equal (one symbol).
        at_least_two: ``(input index, dim)`` of each dimension the capture kept symbolic:
            ``torch.export`` specializes sizes 0 and 1 and assumes the others are at least 2
            (``squeeze``, broadcasting and ``x.shape[0] == 1`` branches were decided so), so a
            size of 0 or 1 there needs its own capture.
    """

    static: tuple[tuple[int, int, int], ...] = ()
    equal: tuple[tuple[tuple[int, int], ...], ...] = ()
    at_least_two: tuple[tuple[int, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.static or self.equal or self.at_least_two)

    def check(self, leaves: list[torch.Tensor]) -> bool:
        """True if ``leaves`` satisfy every assumption (on every call: kept to plain loops)."""
        for i, d in self.at_least_two:
            if leaves[i].shape[d] < 2:
                return False
        for i, d, size in self.static:
            if leaves[i].shape[d] != size:
                return False
        for group in self.equal:
            i0, d0 = group[0]
            first = leaves[i0].shape[d0]
            for i, d in group[1:]:
                if leaves[i].shape[d] != first:
                    return False
        return True

    def describe(self, paths: list[str]) -> str:
        parts = [f"{paths[i]}.shape[{d}] == {s}" for i, d, s in self.static]
        parts += [" == ".join(f"{paths[i]}.shape[{d}]" for i, d in g) for g in self.equal]
        parts += [f"{paths[i]}.shape[{d}] >= 2" for i, d in self.at_least_two]
        return "; ".join(parts)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter prints progress and logs warnings about optional packages: keep them out of the
    user's output (failures still raise)."""
    names = ("torch.onnx", "torch.export", "torch._export", "torch._dynamo", "torch.fx")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@dataclass
class DynamoCapture:
    """What ``torch.export`` captured, with what its translation to ONNX needs."""

    program: torch.export.ExportedProgram
    adapter: Adapter
    bridge: bridge_dynamo.CaptureScope
    input_names: list[str]
    input_paths: list[str]
    static_spatial: bool
    aten_ops: tuple[str, ...]
    opset: int
    module_name: str
    static_reasons: tuple[str, ...] = ()


def capture_dynamo(
    module: nn.Module,
    flat_inputs: list[torch.Tensor],
    in_spec: tuple,
    input_paths: list[str],
    *,
    training: bool,
    opset: int | None = None,
    static_spatial: bool = False,
    with_backward: bool = True,
    inline_functions: tuple[str, ...] = (),
    aten_ops: tuple[str, ...] = (),
    autocast: tuple | None = None,
) -> DynamoCapture:
    """Capture ``module`` called with the inputs ``in_spec`` and ``flat_inputs`` describe, with
    ``torch.export`` (the translation to ONNX is :func:`translate_dynamo`).

    Same arguments as :func:`ortwrap.export.torchscript.capture_torchscript`. Ops without an ONNX
    translation, and those ``aten_ops`` lists, become ATen nodes when translated
    (``export/aten_fallback.py``), as with the TorchScript exporter.

    Raises:
        ExportError: chained to torch.export's error.
    """
    from torch.export import Dim

    adapter = Adapter(module, in_spec, autocast)
    input_names = [f"input:{p}" for p in input_paths]
    static_reasons: list[str] = []

    def export(static: bool):
        dims = (lambda t: range(min(t.dim(), 1))) if static else (lambda t: range(t.dim()))
        dynamic_shapes = (tuple({d: Dim.AUTO for d in dims(t)} or None for t in flat_inputs),)
        with (
            _quiet_exporter(),
            compat.lazy_stack_trace_lines(),
            preserved_state(module),
            no_ambient_autocast(),
            capture_context(),
            bridge_dynamo.capture_scope(with_backward=with_backward, inline=frozenset(inline_functions)) as scope,
        ):
            return torch.export.export(
                adapter, tuple(t.detach() for t in flat_inputs), dynamic_shapes=dynamic_shapes, strict=False
            ), scope

    was_training = module.training
    try:
        module.train(training)
        try:
            program, bridge = export(static_spatial)
        except Exception as first:
            # A constraint torch.export cannot prove on a dynamic non-batch dim (a UNet's
            # ``Eq(x - 4*((x/2)//2), 0) cannot be solved`` for its image size): capture again with
            # those dims static, as TorchScript does; the program is then kept per non-batch shape.
            if static_spatial or all(t.dim() <= 1 for t in flat_inputs) or output_error_in(first):
                raise
            try:
                program, bridge = export(True)
            except Exception:
                raise first from None
            static_spatial = True
            reason = re.sub(r"\s+", " ", str(first)).strip()[:200]
            static_reasons.append(f"torch.export failed with dynamic non-batch dims ({type(first).__name__}: {reason})")
            _log.info("dynamo: %s; captured with static non-batch dims", static_reasons[-1])
    except Exception as e:
        if (outputs := output_error_in(e)) is not None:
            raise outputs from None
        raise _export_error("torch.export.export", type(module).__name__, e) from e
    finally:
        module.train(was_training)
    _refuse_complex_outputs(program, type(module).__name__)
    _refuse_read_batch_statistics(program, type(module).__name__)
    number_operands_as_tensors(program)
    return DynamoCapture(
        program,
        adapter,
        bridge,
        input_names,
        list(input_paths),
        static_spatial,
        tuple(aten_ops),
        opset if opset and opset >= 18 else DYNAMO_OPSET,
        type(module).__name__,
        tuple(static_reasons),
    )


def _refuse_complex_outputs(program: torch.export.ExportedProgram, module_name: str) -> None:
    """Refuse a complex output: torchlib writes complex values as real ``[..., 2]`` tensors, which
    came back as the output (``torch.complex``, ``polar``, ``view_as_complex``: silently the wrong
    shape and dtype). Complex values inside the graph are left to torchlib.

    Raises:
        UnsupportedOutputError: naming the output and the op that makes it.
    """
    out = next(n for n in program.graph.nodes if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    for i, node in enumerate(values):  # (the adapter's outputs: flat)
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.is_complex():
            op = node.target if node.op == "call_function" else node.op
            raise UnsupportedOutputError(
                f"output {i} of {module_name} is a {val.dtype} tensor (made by {op}): the dynamo exporter writes "
                "complex values as real [..., 2] tensors and ONNX Runtime has no complex outputs. Return "
                "torch.view_as_real(...) of it, or run the module without ORTWrap"
            )


#: ops whose outputs 1 and 2 (the batch mean and inverse standard deviation) PyTorch's autograd gives
#: no gradient, and which torch.export decomposes into plain ops before ortwrap's translation sees them
_BATCH_STATISTICS_OPS = ("aten._batch_norm_with_update.", "aten._batch_norm_with_update_functional.")


def _refuse_read_batch_statistics(program: torch.export.ExportedProgram, module_name: str) -> None:
    """Refuse a graph that reads ``_batch_norm_with_update``'s saved statistics (outputs 1 and 2).

    NOTE: eager's saved mean and inverse std of this op do not require grad; torch's decomposition
    computes them with differentiable ops, so ORT differentiated through them: the input gradient
    came out off by ~0.06-0.13 (OpInfo ``_batch_norm_with_update``). A BatchNorm module never reads
    them (they are pruned), so only a direct call of the op that uses them is refused.

    Raises:
        ExportError: naming the op and what to do.
    """
    for node in program.graph.nodes:
        if node.op != "call_function" or not str(node.target).startswith(_BATCH_STATISTICS_OPS):
            continue
        for user in node.users:
            index = user.args[1] if user.op == "call_function" and len(user.args) > 1 else None
            if index in (1, 2) and user.users:
                raise ExportError(
                    f"{module_name} reads output {index} of {node.target} (the batch statistics), which carries "
                    "no gradient in PyTorch; the dynamo exporter's decomposition would differentiate through it. "
                    "Use exporter='torchscript', .detach() the statistics, or run the module without ORTWrap"
                )


def _export_error(step: str, module_name: str, e: BaseException) -> ExportError:
    missing = _missing_translation(e)
    if missing is not None:
        return ExportError(
            f"the dynamo exporter has no ONNX translation for {missing}, used by {module_name}. "
            "Use exporter='torchscript' (which can run such ops as ATen nodes), or run the module without ORTWrap"
        )
    failed = failed_call(e)
    if failed is not None:  # the translation of one call raised: name the op and the first error
        root = e
        while root.__cause__ is not None:
            root = root.__cause__
        first = " ".join(str(root).split())[:400]
        return ExportError(
            f"{step} failed for {module_name}: translating {failed[0]}.{failed[1]} failed, also as an ATen node: "
            f"{type(root).__name__}: {first}"
        )
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    if len(text) > 700:
        text = text[:700] + " ... (full message in the chained exception)"
    return ExportError(
        f"{step} failed for {module_name}: {type(e).__name__}: {text}. "
        "Check that the module's forward can be captured by torch.export, or use exporter='torchscript'."
    )


def translate_dynamo(capture: DynamoCapture) -> ExportedModel:
    """The captured program as ONNX (ortwrap's translations, Function placeholders made PythonOps,
    ATen nodes), parameters and buffers moved to graph inputs, cleaned up and named.

    Raises:
        ExportError: the translation failed, naming the op where it can.
    """
    program, adapter, bridge = capture.program, capture.adapter, capture.bridge
    input_names, input_paths = capture.input_names, capture.input_paths
    # A call whose translation fails runs as an ATen node instead (export/retry.py).
    retry_ops: list[str] = []
    keep_ops = False

    def extra(prog: torch.export.ExportedProgram, is_registered: Any, allow_missing: bool) -> Any:
        drop_error_checks(prog)  # (the decomposed program too: the decompositions trace them again)
        return fallback_translations(
            prog,
            is_registered,
            aten_ops=(*capture.aten_ops, *TRAINING_ATEN_OPS, *retry_ops),
            scope=bridge,
            allow_missing=allow_missing or keep_ops,
        )

    while True:
        try:
            # The exporter's decompositions retrace the graph, running each Function's forward again on
            # fake tensors (its placeholder's fake implementation): with the collective stubs, as in the capture.
            with (
                bridge_dynamo.translating(bridge),
                _quiet_exporter(),
                compat.lazy_stack_trace_lines(),
                capture_context(),
            ):
                ir_model, _decomposed = dynamo_to_onnx(
                    program,
                    table={**training_translations(), **bridge.translation_table()},
                    opset=capture.opset,
                    decompose=False,
                    decompositions=training_decompositions(),
                    extra=extra,
                )
            break
        except Exception as e:
            plan = retry_plan(e, retry_ops, keep_ops)
            if plan is None:
                raise _export_error("torch.onnx.export (dynamo)", capture.module_name, e) from e
            _log.debug("dynamo: translating again with ATen nodes (%s: %s)", type(e).__name__, e)
            retry_ops, keep_ops = plan
    flat_inputs = input_names
    graph = ir_model.graph
    if len(graph.inputs) != len(flat_inputs):
        raise ExportError(
            f"the dynamo export has {len(graph.inputs)} user inputs, expected {len(flat_inputs)} "
            f"({', '.join(input_paths)})"
        )
    guards = _shape_guards(program)
    for value, name in zip(graph.inputs, input_names):
        value.name = name
    named_state = state_tensors(adapter)
    state_values: list[tuple[ir.Value, str]] = []
    for name, value in list(graph.initializers.items()):
        if name not in named_state:
            continue  # a constant the capture lifted: it stays an initializer
        del graph.initializers[name]
        value.const_value = None
        graph.inputs.append(value)
        state_values.append((value, name))
    try:
        bridge.finish(ir_model)
        _cleanup(ir_model)
        # A graph without nodes (the module returns an input: ``contiguous``, ``conj``, ``t`` of a
        # vector) imports no opset, and the Identity that gives the output its own value had none.
        ir_model.opset_imports.setdefault("", capture.opset)
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"optimizing the dynamo export failed: {type(e).__name__}: {e}") from e
    # The optimizer renames a graph input that is also a graph output ("x" -> "x_orig"): give the
    # inputs their names back (outputs are renamed below anyway), mapping state by value.
    taken = {v.name: v for v in _all_values(graph)}
    for value, name in [*zip(graph.inputs, input_names), *state_values]:
        if value.name != name:
            other = taken.get(name)
            if other is not None and other is not value:
                other.name = f"{name}/value"
            value.name = name
    # Parameters only a bridged Function reads (through its module, as reentrant checkpointing
    # does) are no graph input: ORT's gradient builder refuses trainable inputs without consumers.
    outputs = {id(v) for v in graph.outputs}
    unused = {id(v) for v, _ in state_values if not v.uses() and id(v) not in outputs}
    if unused:
        kept = [v for v in graph.inputs if id(v) not in unused]
        graph.inputs.clear()
        graph.inputs.extend(kept)
        state_values = [(v, n) for v, n in state_values if id(v) not in unused]
    state_inputs = {value.name: named_state[name] for value, name in state_values}
    return finish_export(
        adapter,
        ir_model,
        input_names,
        state_inputs,
        static_reasons=list(capture.static_reasons),
        static_spatial=capture.static_spatial,
        bridge=bridge,
        shape_guards=guards,
    )


def _cleanup(model: ir.Model) -> None:
    """What ortwrap needs of the onnxscript optimizer, in one round: inline torchlib's functions,
    fold constants (``SplitToSequence``/``SequenceAt`` into ``Split``, ``CastLike`` into ``Cast``:
    ORT 1.19.2 differentiates neither), drop what nothing reads, merge repeated subexpressions.

    Not its pattern rewrites (about 0.3 s of its 0.4 s on the benchmark LM, two thirds of the time
    the dynamo path spent after the capture): ORT's own graph optimizer runs over the built graph.
    Folding a ``CastLike`` needs its second input's dtype, which values inside inlined torchlib
    functions lack (SDPA's scale: ORT has no gradient for ``CastLike``, tests/test_ops.py). The
    folder's own per-node ONNX shape inference finds it; :func:`_fill_dtypes` finds the same from
    one inference of the whole graph, and the folder runs without its own: 0.10 instead of 0.23 CPU s
    at the GPT-2-small size (the folded, pre-gradient and built graphs were the same on the 137
    tests of test_ops, test_models, test_transformers and test_dynamo).
    """
    import onnx_ir.passes.common as common
    import onnxscript.optimizer

    common.InlinePass()(model)
    per_node_inference = not _fill_dtypes(model)
    for _ in range(2):  # a second round folds what the first one's folds exposed
        if not onnxscript.optimizer.fold_constants_ir(model, onnx_shape_inference=per_node_inference).modified:
            break
    common.RemoveUnusedNodesPass()(model)
    common.RemoveUnusedFunctionsPass()(model)
    common.CommonSubexpressionEliminationPass()(model)
    common.NameFixPass()(model)


def _fill_dtypes(model: ir.Model) -> bool:
    """Give each untyped node output of the main graph the dtype ONNX shape inference finds for it.

    Returns False when inference fails: the folder then infers node by node, as it can.
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(ir.serde.serialize_model(model))
    except Exception as e:
        _log.debug("dynamo: shape inference before folding failed (%s: %s)", type(e).__name__, e)
        return False
    dtypes = {
        vi.name: vi.type.tensor_type.elem_type for vi in inferred.graph.value_info if vi.type.HasField("tensor_type")
    }
    for node in model.graph:
        for value in node.outputs:
            if value.dtype is None and dtypes.get(value.name):
                value.dtype = ir.DataType(dtypes[value.name])
    return True


def _missing_translation(error: BaseException) -> str | None:
    """The ATen op the exporter found no translation for, from its error chain (or None)."""
    seen = 0
    while error is not None and seen < 10:
        match = re.search(r"No ONNX function found for <OpOverload\(op='([^']+)', overload='([^']+)'\)>", str(error))
        if match:
            return f"{match.group(1)}.{match.group(2)}"
        error = error.__cause__ or error.__context__
        seen += 1
    return None


def _all_values(graph: ir.Graph) -> list[ir.Value]:
    values = list(graph.inputs)
    for node in graph:
        values.extend(node.outputs)
    return values


def _shape_guards(program: torch.export.ExportedProgram) -> ShapeGuards:
    """The dims of the user inputs that the capture fixed to a size, or tied to another dim.

    Read from the capture's fake inputs (the ONNX graph's dims are symbols either way).
    """
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    user = set(program.graph_signature.user_inputs)
    static: list[tuple[int, int, int]] = []
    symbols: dict[str, list[tuple[int, int]]] = {}
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in user]
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, dim in enumerate(val.shape):
            if isinstance(dim, int):
                static.append((i, d, dim))
            elif is_concrete_int(dim):
                # Fixed late in the capture (an LSTM's length meeting a GRU's): the placeholder still
                # holds a SymInt, now equal to a constant. Unguarded, another length ran the graph
                # and returned a wrong shape.
                static.append((i, d, int(dim)))
            else:
                symbols.setdefault(str(dim), []).append((i, d))
    equal = tuple(tuple(g) for g in symbols.values() if len(g) > 1)
    at_least_two = tuple(dim for group in symbols.values() for dim in group[:1])  # (the group's others are equal)
    return ShapeGuards(tuple(static), equal, at_least_two)
