"""The ``"onnxruntime"`` engine: gradients from PyTorch's AOTAutograd, forward and backward on the
maintained ONNX Runtime (``onnxruntime>=1.20``; any build's InferenceSession works).

Per call signature (train/eval, whether a backward is needed, input structure and constants, and per
tensor its shape, dtype, device and ``requires_grad``; the parameters' ``requires_grad`` and
identity):

1. AOTAutograd (``compat.aot_module``) traces the module, its parameters and buffers lifted to
   inputs, into a joint forward/backward graph and partitions it with the min-cut partitioner
   (recompute of cheap ops in the backward, as ``torch.compile`` does) into a forward graph that
   also returns the saved values, and a backward graph. Without a backward, one inference graph.
2. Each FX graph is translated to ONNX (``translate.py``: torch.export of the ATen graph, ortwrap's
   translation table, torchlib for the rest, the dynamo exporter's cleanup round).
3. Each runs in its own InferenceSession through IOBinding (``session.py``); AOTAutograd's
   autograd.Function calls the forward session in ``forward`` and the backward session in
   ``backward``, keeping the saved values (tensors ORT wrote in place) in between.

Under ``torch.autocast`` the trace writes autocast's casts into the graphs (the autocast dtype is in
the signature; the backward traced with autocast off, as eager's); on the CPU provider each bf16/fp16
op computes in float32 between Casts (``half.py``).

Dynamic dims (``dynamic.py``): a family of signatures' first shape builds with static sizes; once a size
changes, one build with symbolic sizes (the changed dims and every input's first) serves the family's
later shapes, where the trace's guards hold (``build_count`` counts both). A graph that cannot be dynamic
keeps one build per shape (said once in the log). With ``aggressive_cpu_fallback``, the symbolic build's
shape computations move to the training engine's host shape program (``dynamic.split_shapes``). Buffer updates
(BatchNorm's running statistics) are AOTAutograd's input mutations, written back by its runtime.

NOTE: an autograd.Function is traced into the joint graph (its forward's ops, and its backward's
for the gradient). One whose forward cannot be traced (``.item()``, numpy, a C extension,
data-dependent Python) is traced again as one opaque op in each graph (``functions.py``); those ops,
and any op with no ONNX translation, run in PyTorch between ORT segments (``split.py``). Translated
graphs go through the build cache (``translate.translate_cached``).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ... import _tree, integrations
from ..._compat import torch as compat
from ..._logging import logger, warn_at_user_line
from ...bridge.state import qualified_name
from ...errors import ExportError, ORTWrapError, UnsupportedFunctionError, UnsupportedInputError, sentence
from .dynamic import DynamicRunner, DynamicShapes, NotDynamic, family_of
from .fragments import EngineSplitCapture, data_dependent_error, shapeless_key
from .functions import FunctionTracer
from .session import GraphRunner, binds_bfloat16, ort_version
from .split import SplitRunner, untranslatable
from .translate import translate_cached

__all__ = ["OnnxRuntimeEngine"]


class _Flat(nn.Module):
    """Calls ``module`` with ``(args, kwargs)`` rebuilt from flat tensors; returns flat tensor outputs."""

    def __init__(self, module: nn.Module, in_spec: tuple) -> None:
        super().__init__()
        self.module = module
        self.in_spec = in_spec
        self.out_spec: tuple | None = None

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = _tree.unflatten(self.in_spec, flat)
        out = self.module(*args, **kwargs)
        leaves: list[torch.Tensor] = []

        def other(path: str, value: Any) -> tuple:
            return ("O", value)

        self.__dict__["out_spec"] = _tree.flatten(out, "output", leaves, other, objects=True)
        return tuple(leaves)


class _Compiled:
    """One signature's build: AOTAutograd's callable and the sessions it calls."""

    def __init__(self) -> None:
        self.fn: Any = None
        self.out_spec: tuple | None = None
        self.runners: dict[str, GraphRunner | SplitRunner] = {}
        self.graphs: dict[str, torch.fx.GraphModule] = {}
        #: per forward-graph output, the bit mask of the forward-graph inputs it depends on (_reach)
        self.reach: list[int] | None = None


def _reach(gm: torch.fx.GraphModule) -> list[int]:
    """Per output of AOTAutograd's forward graph, the bit mask of its inputs (placeholders) it depends on."""
    deps: dict[torch.fx.Node, int] = {}
    masks: list[int] = []
    placeholders = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            deps[node] = 1 << placeholders
            placeholders += 1
        elif node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
            masks = [deps.get(o, 0) if isinstance(o, torch.fx.Node) else 0 for o in outs]
        else:
            mask = 0
            for n in node.all_input_nodes:
                mask |= deps.get(n, 0)
            deps[node] = mask
    return [placeholders, *masks]


def _none_grads(reach: list[int], outputs: Any) -> None:
    """Eager's ``None`` gradients on AOTAutograd's backward node of this call's ``outputs``.

    AOTAutograd's backward takes a zero tangent for each output whose gradient autograd did not pass,
    so an input (a parameter) that reaches only such outputs gets a zero gradient, where eager's
    autograd never reaches it (``.grad`` stays ``None``, and AdamW skips it: no weight decay). A post
    hook on the node keeps the backward (one graph, zeros fed) and returns ``None`` for each input no
    output with a gradient depends on in the forward graph (``_reach``)."""
    nodes = {}
    for o in outputs:
        fn = getattr(o, "grad_fn", None)
        if fn is None:
            continue
        for node in (fn, *(n for n, _ in fn.next_functions)):
            if node is not None and compat.is_aot_backward_node(node):
                nodes[id(node)] = node
    if not nodes:
        return
    n_inputs, masks = reach[0], reach[1:]
    everything = (1 << n_inputs) - 1

    def hook(grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
        if len(grad_inputs) != n_inputs or len(grad_outputs) > len(masks):
            return None  # (not the layout _reach read: gradients as AOTAutograd gives them)
        reached = 0
        for g, mask in zip(grad_outputs, masks):
            if g is not None:
                reached |= mask
        if reached & everything == everything:
            return None
        return tuple(g if reached >> i & 1 else None for i, g in enumerate(grad_inputs))

    for node in nodes.values():
        node.register_hook(hook)


def _function_in_traceback(tb) -> str | None:
    """The qualified name of the autograd.Function whose forward/backward raised, if one did."""
    name = None
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if code.co_name in ("forward", "backward", "setup_context") and "ctx" in frame.f_locals:
            qual = getattr(code, "co_qualname", code.co_name)
            module = frame.f_globals.get("__name__", "?")
            name = f"{module}.{qual.rsplit('.', 1)[0]}"
        tb = tb.tb_next
    return name


class OnnxRuntimeEngine:
    """ORTWrap's engine on the maintained onnxruntime (see the module docstring)."""

    name = "onnxruntime"

    def __init__(self, options: Any) -> None:
        self.options = options
        self._compiled: dict[tuple, _Compiled] = {}
        self._failed: dict[tuple, str] = {}
        #: builds so far (one per signature: shapes included)
        self.build_count = 0
        #: calls that ran in PyTorch (their signature fell back)
        self.fallback_calls = 0
        self.last: _Compiled | None = None
        #: autograd.Functions AOTAutograd could not trace: opaque ops run in PyTorch (functions.py)
        self._opaque: set[type] = set()
        #: signature without shapes -> its split capture (a trace that stopped on a value: fragments.py)
        self._split: dict[tuple, EngineSplitCapture] = {}
        #: builds with symbolic sizes, per family of signatures (dynamic.py)
        self._shapes = DynamicShapes()
        if options.aggressive_cpu_fallback:
            # (the host shape program moves shape computations out of the graph: a build with symbolic sizes
            # has them, dynamic.py splits them off; a build with static sizes has none)
            logger.info(
                "onnxruntime engine: aggressive_cpu_fallback applies to builds with symbolic sizes (their shape "
                "computations move to a host shape program); a build with static sizes (a signature's first "
                "shape) computes no shapes, so nothing moves there"
            )

    def _trace(self, flat: nn.Module, leaves: list[torch.Tensor], compiler, tracer: FunctionTracer) -> Any:
        # NOTE: SDPA as its math composite, decomposed before autograd records it: the fused CPU/CUDA
        # kernels' backward ops have no ONNX translation. mkldnn off while tracing: with it, torch's
        # LSTM decomposition writes the first layer as ``aten.mkldnn_rnn_layer`` (no ONNX translation)
        # instead of its per-step ops; the traced graph runs on ORT, so no mkldnn kernel is lost.
        # compile_session: traced as torch.compile traces (is_compiling() is True), so library code
        # takes its trace-friendly branches (transformers' masks skip their data-dependent shortcut).
        # (a backward that fails the trace: AOTAutograd's anomaly mode warns before the engine retries)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Error detected in", category=UserWarning)
            return self._aot(flat, leaves, compiler, tracer)

    def _aot(self, flat: nn.Module, leaves: list[torch.Tensor], compiler, tracer: FunctionTracer) -> Any:
        # (symbolic sizes: the backward, which AOTAutograd may compile on its first call, compiled now)
        eager_backward = any(isinstance(s, torch.SymInt) for t in leaves for s in t.shape)
        with sdpa_kernel([SDPBackend.MATH]), _mkldnn_off(), compat.compile_session(), tracer.tracing():
            return compat.aot_module(
                flat,
                list(leaves),
                fw_compiler=compiler("forward"),
                bw_compiler=compiler("backward"),
                inference_compiler=compiler("inference"),
                decompositions=_decompositions(),
                recompute=self.options.recompute != "none",
                eager_backward=eager_backward,
            )

    def clear(self) -> None:
        self._compiled.clear()
        self._failed.clear()
        self._split.clear()
        self._shapes.clear()

    @property
    def split_capture(self) -> EngineSplitCapture | None:
        """The most recent split capture (fragments.py), or None."""
        return next(reversed(self._split.values()), None)

    def __call__(self, wrapper: Any, args: tuple, kwargs: dict) -> Any:
        integration = integrations.step_integration(wrapper)
        if integration is not None:
            # NOTE: an integration that takes calls over (DeepSpeed ZeRO-3: the wrapped module's
            # parameters gathered around the call, partitioned after its backward) runs this engine's
            # call as its step. zero3_gather="submodule" is a rewrite of the training engine's ORT
            # gradient graph (gather nodes per layer): nothing of it exists on AOTAutograd's graphs.
            if self.options.zero3_gather == "submodule":
                raise UnsupportedInputError(
                    "ORTWrap(engine='onnxruntime') gathers a ZeRO-3 module's parameters as a whole "
                    "(zero3_gather='module'); zero3_gather='submodule' rewrites the training engine's "
                    "gradient graph and needs engine='training' (docs/engines.md)"
                )
            return integration.step(wrapper, _Step(self, wrapper, args, kwargs))
        return self._run(wrapper, args, kwargs)

    def _run(self, wrapper: Any, args: tuple, kwargs: dict) -> Any:
        module = wrapper.module
        leaves: list[torch.Tensor] = []
        in_spec = wrapper._dispatch.flatten_inputs(args, kwargs, leaves)
        state = [*module.parameters(), *module.buffers()]
        needs_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in module.parameters()) or any(t.requires_grad for t in leaves)
        )
        key = (
            module.training,
            needs_grad,
            in_spec,
            tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in leaves),
            tuple((id(t), t.requires_grad) for t in state),
            _autocast_state(),
        )
        compiled = self._compiled.get(key)
        if compiled is None:
            split = self._split.get(shapeless_key(key)) if self._split else None
            if split is not None:
                return split(*args, **kwargs)
            if key in self._failed or any(t.numel() == 0 for t in leaves):
                self.fallback_calls += 1
                return module(*args, **kwargs)
            compiled = self._dynamic(wrapper, module, leaves, in_spec, key, args, kwargs)
        if compiled is None:
            try:
                with integrations.export_context(wrapper):  # (DeepSpeed's module hooks hidden from the trace)
                    compiled = self._build(module, leaves, in_spec, key)
                self._shapes.seen(family_of(key), leaves)
            except ORTWrapError as e:
                # NOTE: an input the module rejects (a wrong feature size, a user's assert) fails the
                # trace too: eager's own exception is raised, as on the training engine, and the
                # signature is neither marked failed nor warned about.
                wrapper._dispatch.raise_if_eager_raises(args, kwargs)
                if compat.data_dependent_trace_error(e) is not None:
                    # NOTE: no one graph (the module's Python reads a value, an op's shape depends on
                    # the values): a split capture, as the training engine's, whose fragments run on
                    # this engine (fragments.py); said once, naming the cause
                    split = self._split[shapeless_key(key)] = EngineSplitCapture(module, wrapper, self.options, e)
                    return split(*args, **kwargs)
                if not self.options.fallback:
                    raise
                self._failed[key] = str(e)
                wrapper._dispatch.fallback_reason = e
                warn_at_user_line(
                    f"ORTWrap(engine='onnxruntime') falls back to PyTorch for these calls of {type(module).__name__}: "
                    f"the {e.phase} phase failed: {sentence(e.detail)} Set fallback=False to raise instead.",
                    wrapper_warning(),
                )
                self.fallback_calls += 1
                return module(*args, **kwargs)
        outputs = compiled.fn(*leaves)
        if compiled.reach is not None and torch.is_grad_enabled():
            _none_grads(compiled.reach, outputs)
        return _tree.unflatten(compiled.out_spec, list(outputs))

    def _dynamic(
        self, wrapper: Any, module: nn.Module, leaves: list[torch.Tensor], in_spec: tuple, key: tuple, args, kwargs
    ):
        """The build with symbolic sizes that serves this call (built now if the family's sizes changed),
        or None: a per-shape build (dynamic.py)."""
        family = family_of(key)
        compiled = self._shapes.find(family, leaves)
        if compiled is not None:
            self._compiled[key] = compiled
            return compiled
        dims = self._shapes.dims(family, leaves)
        if dims is None:
            return None
        try:
            with integrations.export_context(wrapper):
                return self._build(module, leaves, in_spec, key, dims)
        except Exception as e:
            # (a bad batch is the input's fault, not the family's: eager's exception, dims kept dynamic)
            wrapper._dispatch.raise_if_eager_raises(args, kwargs)
            if self._shapes.refuse(family):
                logger.warning(
                    "onnxruntime engine: %s cannot run with symbolic sizes (%s: %s); it builds once per input shape",
                    type(module).__name__, type(e).__name__, _first_line(e),
                )  # fmt: skip
            return None

    def _build(
        self, module: nn.Module, leaves: list[torch.Tensor], in_spec: tuple, key: tuple, dynamic: list | None = None
    ) -> _Compiled:
        """One build: static sizes, or symbolic ones in the ``dynamic`` dims of each input (dynamic.py)."""
        if any(dtype == torch.bfloat16 for _, dtype in key[-1]) and not binds_bfloat16():
            raise ExportError(
                f"bfloat16 autocast on engine='onnxruntime' needs onnxruntime >= 1.20 (its IOBinding binds bfloat16 "
                f"tensors); this is {ort_version()}"
            )
        compiled = _Compiled()
        example = leaves
        if dynamic is not None:
            shape_env, example = compat.symbolic_inputs(leaves, dynamic)
        device = leaves[0].device if leaves else next(module.parameters(), torch.empty(0)).device
        options = self.options

        def compiler(what: str):
            def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
                compiled.graphs[what] = gm
                fusions = options.fusions and what != "backward"
                with compat.no_fake_mode():  # (AOTAutograd calls compilers in its fake mode)
                    in_torch = None if dynamic is not None else untranslatable(gm)
                    if dynamic is not None:
                        runner = DynamicRunner(gm, what, device, options, fusions)
                    elif in_torch:
                        runner = SplitRunner(gm, what, device, options, fusions, in_torch)
                        logger.info(
                            "onnxruntime engine: the %s graph of %s runs in %d ORT segments, with %s in PyTorch",
                            what, type(module).__name__, len(runner.segments), ", ".join(runner.in_torch),
                        )  # fmt: skip
                    else:
                        graph = translate_cached(gm, what, fusions, options.build_cache)
                        runner = GraphRunner(graph, device, options, what)
                compiled.runners[what] = runner
                logger.info("onnxruntime engine: %s graph of %s translated", what, type(module).__name__)
                return compat.boxed(runner)

            return compile_graph

        flat = _Flat(module, in_spec)
        first: tuple | None = None  # (the class made opaque, what its traced forward raised)
        made_opaque: list[tuple] = []
        while True:
            tracer = FunctionTracer(self._opaque)
            try:
                compiled.fn = self._trace(flat, example, compiler, tracer)
                break
            except ORTWrapError:
                raise
            except Exception as e:
                if dynamic is not None:
                    raise NotDynamic(f"AOTAutograd could not trace it: {type(e).__name__}: {_first_line(e)}") from e
                probe = tracer.probe_error
                if first is not None and probe is not None and _same_error(probe, first[1]):
                    # NOTE: the Function raised its own error, run eagerly too (a flag, a check of its
                    # arguments): not a trace failure. It is not kept opaque, and the caller gets the
                    # exception itself, as eager raises it (its type, its message), not a refusal.
                    self._opaque.discard(first[0])
                    raise probe from None
                untraceable = next((c for c in tracer.failed if c not in self._opaque), None)
                if untraceable is not None:
                    # NOTE: traced again with the Function as one opaque op (functions.py), run in
                    # PyTorch between ORT segments (split.py); said once per Function class, once that
                    # trace holds (not when the Function raised its own error, above).
                    self._opaque.add(untraceable)
                    made_opaque.append((untraceable, e))
                    first = (untraceable, e) if first is None else first
                    compiled.graphs.clear(), compiled.runners.clear()
                    continue
                opaque = next((c for c in tracer.failed if c in self._opaque), None)
                function = qualified_name(opaque) if opaque is not None else _function_in_traceback(sys.exc_info()[2])
                if function is not None:
                    raise UnsupportedFunctionError(
                        f"AOTAutograd could not trace torch.autograd.Function {function} into the joint graph, nor "
                        f"run it as an opaque op between ORT segments ({type(e).__name__}: {_first_line(e)}). An "
                        "opaque Function must take every tensor it reads as an argument (one that reads a module's "
                        "parameters from a closure, such as checkpoint(use_reentrant=True), cannot); "
                        "engine='training' runs any Function as a PythonOp"
                    ) from e
                if compat.data_dependent_trace_error(e) is not None:
                    raise data_dependent_error(module, e) from e
                raise ExportError(
                    f"AOTAutograd could not trace {type(module).__name__}: {type(e).__name__}: {str(e)[:500]}"
                ) from e
        for cls, e in made_opaque:
            logger.warning(
                "onnxruntime engine: torch.autograd.Function %s cannot be traced (%s: %s); it runs in PyTorch "
                "between ORT segments",
                qualified_name(cls), type(e).__name__, _first_line(e),
            )  # fmt: skip
        compiled.out_spec = flat.out_spec
        if "forward" in compiled.graphs:
            compiled.reach = _reach(compiled.graphs["forward"])
        if dynamic is not None:
            guards = compat.shape_guards(shape_env, example)
            if not guards(leaves):
                raise NotDynamic("the trace's guards do not hold for the inputs it traced")
            self._shapes.add(family_of(key), compiled, dynamic, leaves, guards)
            self._shapes.fix(family_of(key), compiled.graphs.get("forward", compiled.graphs.get("inference")), dynamic)
            logger.info("onnxruntime engine: %s built with symbolic sizes", type(module).__name__)
        self.build_count += 1
        self._compiled[key] = compiled
        self.last = compiled
        return compiled


def _autocast_state() -> tuple:
    """The autocast state a trace writes into the graphs: per device, whether it is on and its dtype
    (AOTAutograd traces under the caller's autocast, so autocast's casts are in the graphs)."""
    return tuple(
        (device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)
    )


def _same_error(a: BaseException, b: BaseException) -> bool:
    return type(a) is type(b) and a.args == b.args


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


class _Step:
    """A call an integration took over (``integrations.Step``), run by this engine."""

    def __init__(self, engine: OnnxRuntimeEngine, wrapper: Any, args: tuple, kwargs: dict) -> None:
        self._engine, self._wrapper, self.args, self.kwargs = engine, wrapper, args, kwargs

    @property
    def fell_back_before(self) -> bool:
        return bool(self._engine._failed)

    def run(self) -> integrations.StepOutcome:
        before = self._engine.fallback_calls
        output = self._engine._run(self._wrapper, self.args, self.kwargs)
        return integrations.StepOutcome(output, self._engine.fallback_calls != before)

    def fall_back(self, error: ORTWrapError) -> Any:
        self._wrapper._dispatch.fallback_reason = error
        self._engine.fallback_calls += 1
        warn_at_user_line(
            f"ORTWrap(engine='onnxruntime') runs this call of {type(self._wrapper.module).__name__} in PyTorch: "
            f"{sentence(error.detail)}",
            wrapper_warning(),
        )
        return self._wrapper.module(*self.args, **self.kwargs)


@contextlib.contextmanager
def _mkldnn_off() -> Iterator[None]:
    """mkldnn disabled for the block (only that flag: ``mkldnn.flags()`` resets the others too)."""
    saved = torch.backends.mkldnn.set_flags(False, None, None, None)
    try:
        yield
    finally:
        torch.backends.mkldnn.set_flags(saved[0], None, None, None)


def wrapper_warning() -> type:
    from ...errors import FallbackWarning

    return FallbackWarning


_DECOMPOSITIONS: dict | None = None


def _decompositions() -> dict:
    """torch.export's default decompositions (the core ATen set): backward ops become ops torchlib
    translates (``native_layer_norm_backward``, ``threshold_backward``, ...)."""
    global _DECOMPOSITIONS
    if _DECOMPOSITIONS is None:
        from .decompositions import engine_decompositions

        table = torch.export.default_decompositions()
        from .in_torch import KEEP_WHOLE

        kept = {op: table[op] for op in table.keys() if op not in KEEP_WHOLE}  # (random ops draw as eager)
        _DECOMPOSITIONS = {**kept, **engine_decompositions()}
    return _DECOMPOSITIONS
