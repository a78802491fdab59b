"""ONNX Runtime sessions for a built graph: a training runner and an inference runner."""

from __future__ import annotations

import functools
import logging

import onnx
import torch

from .._compat import torch as compat
from .._logging import ort_log_wanted
from .._ort import C, ort
from ..bridge import state as bridge_state
from ..bridge.aten import ATEN_DOMAIN, NATIVE_PREFIX
from ..errors import RuntimeRunError, SessionError
from ..grad import TrainingGraph
from ..kernels import release_cached
from ..ops import DTYPE_ARGUMENT_OPS
from ..options import Options
from . import cpu_region
from .dlpack import to_dlpack, to_tensors

_log = logging.getLogger("ortwrap")

#: The bridge's list of exceptions parked during a run (checked inline: it is on the hot path).
_pending = bridge_state._pending
_State = getattr(C, "PartialGraphExecutionState", None)  # (None without the training build: engines/)
_OrtValueVector = C.OrtValueVector


def _run(what: str, fn, *args, region=None) -> None:
    """Call an ORT run; an exception a Function or ATen op raised inside it is re-raised as itself
    (an ATen op may also fail without failing the run), any other failure as RuntimeRunError.
    ``region``: :func:`_region`'s bracket, called around the run.

    ``TrainingRunner`` inlines these lines: they run twice a training step."""
    if _pending:
        _pending.clear()
    entered = region is not None and region[0]()
    try:
        fn(*args)
    except Exception as e:
        _raise_run_error(what, e)
    finally:
        if entered:
            region[1]()
    if _pending:
        bridge_state.reraise_pending(None)


def _region(device: torch.device, options: Options, model: onnx.ModelProto):
    """The CPU region allocator's ``(enter, exit)`` for the runs of ``model`` on ``device``, or None:
    not on CPU, ``cpu_region=False``, the region cannot be built here (``runtime/cpu_region.py``), or
    PyTorch computes nothing inside the graph's runs.

    NOTE: the region pays where PyTorch's blocks interleave with ORT's inside a run: PyTorch's GEMMs
    and attention through the bridge (the native bf16 route, ``gemm="torch"``), other PyTorch ops
    as ATen nodes, Functions as PythonOps (GPT-2 small, batch 4: bf16 2000-2069 MiB against
    2234-2239 without, fp32 ``gemm="torch"`` 2234 against 2445-2450). In a graph of ORT's and the
    kernels' ops alone it costs: ORT's arena and the kernels' blocks sit in the region, where the
    optimizer step's temporaries, allocated outside the runs, cannot reuse the kernels' freed
    blocks (fp32 with ORT's GEMMs: 2172-2219 MiB against 2140)."""
    if device.type != "cpu" or not options.cpu_region:
        return None
    torch_inside = any(
        (n.domain == ATEN_DOMAIN and not (_operator(n) or "").startswith(NATIVE_PREFIX))
        or n.op_type in ("PythonOp", "PythonOpGrad")
        for n in model.graph.node
    )
    return cpu_region.bracket() if torch_inside else None


def _raise_run_error(what: str, e: Exception) -> None:
    bridge_state.reraise_pending(e)
    raise RuntimeRunError(f"{what} run failed: {e}") from e


def _has_bool_outputs(graph: TrainingGraph, model: onnx.ModelProto) -> bool:
    """Whether any forward output of ``graph`` (parsed as ``model``) is bool (ORT hands those over as uint8)."""
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.output, *model.graph.value_info)}
    return any(types.get(name, 9) == 9 for name in graph.info.user_output_names)


def uses_cpu_arena(model: onnx.ModelProto) -> bool:
    """Whether a session of ``model`` allocates from ORT's CPU arena: not where PyTorch's bf16 GEMMs run
    inside it (the native bf16 route, ``passes/half_matmul.py``: the ops with a dtype argument,
    ``ops.DTYPE_ARGUMENT_OPS``). Their results, the gradients and the weights' casts are PyTorch's
    tensors from glibc's heap; the arena would keep its own high-water mark of ORT's values (~255 MiB
    of regions on GPT-2 small, doubling as it grows) next to that heap, whose free blocks ORT's values
    can use instead (docs/performance.md, "Peak memory of the native bf16 route")."""
    return not any(node.domain == ATEN_DOMAIN and _operator(node) in DTYPE_ARGUMENT_OPS for node in model.graph.node)


def _serial_kernels(graph: TrainingGraph, model: onnx.ModelProto):
    """For a graph that ORT runs on one intra-op thread (``graph.ort_threads == 1``) and that calls
    ortwrap's kernels: their per-thread switch (``kernels.serial_setter``), set around each run so
    that they stay on the running thread too; ``None`` otherwise."""
    if graph.ort_threads != 1 or not any(
        n.domain == ATEN_DOMAIN and (_operator(n) or "").startswith(NATIVE_PREFIX) for n in model.graph.node
    ):
        return None
    from ..kernels import serial_setter

    return serial_setter()


def _operator(node: onnx.NodeProto) -> str | None:
    return next((a.s.decode() for a in node.attribute if a.name == "operator"), None)


@functools.cache
def plain_cpu_allocator() -> bool:
    """Register ORT's plain CPU allocator (no arena) with ORT's environment, once per process;
    whether sessions can use it (``session.use_env_allocators``).

    NOTE: the training build's Python module keeps one CPU execution provider per process, made by
    the first session created (``GetProviderInstanceHash``: "for CPU, only 1 instance"), and every
    later session gets that provider's allocator, with the arena or without it as the *first*
    session's ``enable_cpu_mem_arena`` said. So ``enable_cpu_mem_arena=False`` did nothing in a
    process where any session with the arena came first (one of the build's own helper sessions, a
    GEMM measurement, an earlier ORTWrap model, the user's): GPT-2 small's native bf16 step then
    kept ~265 MiB of arena regions between steps, and its peak RSS depended on what ran before it
    (docs/performance.md, "Peak memory of the native bf16 route"). A session that wants no arena
    takes this registered allocator instead (:func:`session_options`), whatever came first.
    False where the environment has a CPU allocator already (registered by someone else, with
    whatever arena setting they chose): those sessions then keep the provider's.
    """
    info = C.OrtMemoryInfo("Cpu", C.OrtAllocatorType.ORT_DEVICE_ALLOCATOR, 0, C.OrtMemType.DEFAULT)
    try:
        C.create_and_register_allocator(info, None)
    except Exception as e:  # ORT raises its own exception type when one is registered already
        _log.debug(
            "ortwrap: ORT's environment has a CPU allocator already (%s); sessions without the arena "
            "use the CPU execution provider's allocator",
            e,
        )
        return False
    return True


def session_options(options: Options, *, cpu_arena: bool = True, threads: int = 0) -> ort.SessionOptions:
    """Session options: threads and spinning set deliberately (see ``Options.allow_spinning``);
    ``cpu_arena``: ORT's CPU memory arena (:func:`uses_cpu_arena`); ``threads``: the build's choice
    of intra-op threads (``TrainingGraph.ort_threads``; 0: none), below ``intra_op_threads``.

    Without the arena, the session allocates from :func:`plain_cpu_allocator` (the process's one CPU
    execution provider may have an arena: see there). ``enable_cpu_mem_arena`` stays on, so that
    where ortwrap's session is the process's first, the provider it creates has the arena that
    later sessions with ``cpu_arena`` ask for."""
    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = True
    if not cpu_arena:
        if plain_cpu_allocator():
            so.add_session_config_entry("session.use_env_allocators", "1")
        else:
            so.enable_cpu_mem_arena = False  # decides only where this is the process's first session
    threads = options.intra_op_threads or threads or torch.get_num_threads()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    spin = "1" if options.allow_spinning else "0"
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    so.add_session_config_entry("session.inter_op.allow_spinning", spin)
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.enable_mem_pattern = False
    # NOTE: the forward's outputs are handed to torch without a copy. With memory reuse on, ORT's
    # planner may give their buffers to backward values, overwriting tensors the user still holds.
    so.enable_mem_reuse = False
    # ORT logs a failing kernel's status at ERROR before returning it; ortwrap raises it (or eager's
    # own exception, for a bad batch) with that message, so the log line is only console noise.
    # At ortwrap's DEBUG verbosity (ortwrap.set_verbosity) ORT's errors and warnings show as they happen.
    so.log_severity_level = 2 if ort_log_wanted() else 4
    return so


def providers_for(device: torch.device) -> tuple[list[str], list[dict], C.OrtDevice]:
    """Execution providers and the ORT device for tensors on ``device``."""
    if device.type == "cpu":
        return ["CPUExecutionProvider"], [{}], C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise SessionError(
                f"inputs are on {device} but this onnxruntime has no CUDAExecutionProvider; "
                "install ortwrap[cuda] (onnxruntime-training==1.19.2) instead of ortwrap[cpu]"
            )
        if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
            # NOTE: checked before ORT sees a CUDA provider: creating one with no GPU aborts the
            # whole process (cudaDriverWrapper) instead of raising.
            raise SessionError(
                f"inputs are on {device} but PyTorch sees {torch.cuda.device_count()} CUDA device(s) on this machine; "
                "move the model and inputs to an existing device (or to the CPU)"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        # NOTE: ORT computes on torch's current stream, so its kernels are ordered after the torch
        # kernels that produced the inputs and before those that consume the outputs.
        stream = torch.cuda.current_stream(index).cuda_stream
        cuda_options = {
            "device_id": str(index),
            "cudnn_conv_algo_search": "HEURISTIC",
            "has_user_compute_stream": "1",
            "user_compute_stream": str(stream),
        }
        return (
            ["CUDAExecutionProvider", "CPUExecutionProvider"],
            [cuda_options, {}],
            C.OrtDevice(C.OrtDevice.cuda(), C.OrtDevice.default_memory(), index),
        )
    raise SessionError(f"device {device} is not supported; ortwrap runs on cpu and cuda")


def _create_session(
    graph: TrainingGraph, device: torch.device, options: Options, model: onnx.ModelProto | None = None
) -> tuple[ort.InferenceSession, C.OrtDevice]:
    """A session of ``graph`` (``model``: ``graph.model()``, where the caller has it parsed)."""
    if model is None:
        model = onnx.load_model_from_string(graph.model_bytes)
    providers, provider_options, ort_device = providers_for(device)
    # NOTE: ORT's common subexpression elimination would merge recomputed copies of forward nodes
    # back into the originals (grad/recompute.py).
    disabled = ["CommonSubexpressionElimination"] if graph.has_backward and options.recompute != "none" else []
    try:
        sess = ort.InferenceSession(
            graph.model_bytes,
            session_options(options, cpu_arena=uses_cpu_arena(model), threads=graph.ort_threads),
            providers,
            provider_options,
            disabled_optimizers=disabled,
        )
    except Exception as e:
        raise SessionError(f"onnxruntime could not create a session: {e}") from e
    missing = [p for p in providers if p not in sess.get_providers()]
    if missing:
        # ORT falls back to the CPU provider when one fails to load (a missing CUDA/cuDNN library).
        raise SessionError(
            f"onnxruntime created the session without {', '.join(missing)} (it failed to load; onnxruntime's log "
            f"says why: most often a missing CUDA 11.8 / cuDNN 8 library); the session has {sess.get_providers()}. "
            "Install ortwrap[cuda] with its NVIDIA libraries, or run on the CPU"
        )
    return sess, ort_device


#: Arguments of RunTrainingGraph.apply before the feeds: the program and the feeds' OrtValues.
_LEADING_ARGS = 2

#: Ops whose ORT kernels may return their input's buffer instead of a new one.
_ALIASING_OPS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Cast"})


def _neutral(name: str, producers: dict, value: float) -> bool:
    """Whether ``name`` is a constant whose every element is ``value`` (through Unsqueeze/Reshape/Cast/Identity)."""
    node = producers.get(name)
    while node is not None and node.op_type in ("Unsqueeze", "Reshape", "Cast", "Identity", "Expand"):
        name = node.input[0]
        node = producers.get(name)
    if node is None:  # an initializer (the gradient builder folds constants into them)
        tensor = producers.get(("initializer", name))
    elif node.op_type == "Constant":
        tensor = next((a.t for a in node.attribute if a.name == "value"), None)
    else:
        return False
    if tensor is None:
        return False
    array = onnx.numpy_helper.to_array(tensor)
    return array.size > 0 and bool((array == value).all())


def _through_noops(node, producers: dict):
    """The producer that remains after ORT's optimizer drops ``x * 1``, ``x / 1``, ``x + 0`` and ``x - 0``
    (``GroupNorm(affine=False)``: its output became a Reshape's view, changed during the backward)."""
    while node is not None and node.domain in ("", "ai.onnx") and len(node.input) == 2:
        neutral = {"Mul": 1.0, "Div": 1.0, "Add": 0.0, "Sub": 0.0}.get(node.op_type)
        if neutral is None:
            break
        a, b = node.input
        if _neutral(b, producers, neutral):
            node = producers.get(a)
        elif node.op_type in ("Mul", "Add") and _neutral(a, producers, neutral):
            node = producers.get(b)
        else:
            break
    return node


def _aliased_outputs(graph: TrainingGraph, model: onnx.ModelProto) -> tuple[int, ...]:
    """Forward outputs that ORT may hand over as a view of an intermediate buffer.

    NOTE: such a buffer is not protected like a graph output's own: ORT 1.19.2's planner can
    write backward values into it after the YieldOp (seen with logits returned as
    ``Reshape(MatMul)`` and also fed to cross-entropy: the returned logits changed during
    ``loss.backward()``). These outputs are copied once after the forward, before the backward
    can run; other outputs are ORT's own buffers and cross without a copy.
    """
    producers: dict = {o: n for n in model.graph.node for o in n.output}
    producers.update({("initializer", t.name): t for t in model.graph.initializer})
    inputs = {i.name for i in model.graph.input}
    found = []
    for i, name in enumerate(graph.info.user_output_names):
        node = _through_noops(producers.get(name), producers)
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _ALIASING_OPS:
            continue
        source = node.input[0] if node.input else ""
        if source in inputs:
            continue  # a graph input's buffer belongs to the caller
        found.append(i)
    return tuple(found)


def _declared_dtypes(model: onnx.ModelProto, names: tuple[str, ...] | list[str]) -> list[torch.dtype | None]:
    """The dtype the graph declares for each of ``names`` (None where unknown)."""
    from ..bridge.aten import TORCH_DTYPES

    elem = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.value_info, *model.graph.output)}
    return [TORCH_DTYPES.get(elem.get(name, 0)) for name in names]


def _check_dtypes(declared: list[torch.dtype | None], outputs: list[torch.Tensor], names) -> None:
    """On a program's first run: each output has the dtype the graph declares. An ATen node whose
    PyTorch op returns another dtype than type inference found would otherwise go on silently into
    the user's hands (or into another ATen node)."""
    for name, want, t in zip(names, declared, outputs):
        if want is not None and t.dtype != want:
            raise RuntimeRunError(
                f"graph output {name!r} came back as {t.dtype} where the graph declares {want}: a kernel "
                "returned another dtype than the build inferred. Report it with ORTWrap(..., debug_dir=...)'s artifacts"
            )


def _grad_dependencies(graph: TrainingGraph, model: onnx.ModelProto) -> tuple[int, ...]:
    """For each backward output (``graph.grad_names``), a bit mask of the user outputs whose
    gradients it is computed from (bit ``i``: user output ``i``, through the YieldOp's outputs).
    Where the graph is not shaped as expected, every gradient gets every bit (never None).

    A gradient with no bit set is a constant: the input reaches no output through anything
    differentiable. Where the graph holds subgraphs (If, Loop), every gradient gets every bit."""
    names = graph.info.user_output_names
    all_bits = (1 << len(names)) - 1
    yields = [n for n in model.graph.node if n.op_type == "YieldOp"]
    if len(yields) != 1:
        return (all_bits,) * len(graph.grad_names)
    # The YieldOp takes the user outputs and yields their gradients (named ``<output>_grad`` or
    # ``<output>_grad_external``), one per differentiable output, in order.
    outputs = [i for i, name in enumerate(yields[0].input) if i not in graph.info.non_differentiable_outputs]
    if len(outputs) != len(yields[0].output) or list(yields[0].input) != list(names):
        return (all_bits,) * len(graph.grad_names)
    bit = {grad: 1 << i for i, grad in zip(outputs, yields[0].output) if grad}
    if any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in model.graph.node for a in n.attribute
    ):
        return (all_bits,) * len(graph.grad_names)
    producer = {out: node for node in model.graph.node for out in node.output if out}
    masks: dict[str, int] = {}
    for name in graph.grad_names:
        stack = [name]
        while stack:  # iterative post-order over producers (graphs are deep)
            value = stack[-1]
            if value in masks:
                stack.pop()
                continue
            if value in bit:
                masks[value] = bit[value]
                stack.pop()
                continue
            node = producer.get(value)
            if node is None:  # a graph input or initializer: no output gradient behind it
                masks[value] = 0
                stack.pop()
                continue
            pending = [i for i in node.input if i and i not in masks]
            if pending:
                stack.extend(pending)
                continue
            mask = 0
            for i in node.input:
                if i:
                    mask |= masks[i]
            for out in node.output:
                if out:
                    masks[out] = mask
            stack.pop()
    return tuple(masks[name] for name in graph.grad_names)


class TrainingRunner:
    """Runs the forward of a training graph, then, given output gradients, its backward.

    NOTE: ``forward`` returns a ``PartialGraphExecutionState`` that holds every activation the
    backward needs. The caller owns it: passing it to ``backward`` consumes it, and dropping it
    frees those activations.

    Attributes:
        grad_outputs: indices of the user outputs whose gradients the backward takes, in order.
        full_shape_outputs: indices of outputs whose missing gradient must be zeros of full shape.
    """

    def __init__(self, graph: TrainingGraph, device: torch.device, options: Options) -> None:
        self.graph = graph
        self.device = device
        model = graph.model()
        sess, ort_device = _create_session(graph, device, options, model)
        self._session = sess
        info = graph.info
        n_fw = len(info.user_output_names) + info.frontier_count
        try:
            self._agent = C.TrainingAgent(
                sess._sess,
                list(graph.feed_names),
                [ort_device] * n_fw,
                list(graph.grad_names),
                [ort_device] * len(graph.grad_names),
                device.index or 0,
            )
        except Exception as e:
            raise SessionError(f"onnxruntime could not create a TrainingAgent: {e}") from e

        self._output_types: list[tuple[torch.dtype, torch.device]] | None = None
        self._from_dlpack = compat.from_dlpack()
        self._bool_outputs = _has_bool_outputs(graph, model)
        self._declared = _declared_dtypes(model, info.user_output_names)
        self.grad_outputs = tuple(
            i for i in range(len(info.user_output_names)) if i not in info.non_differentiable_outputs
        )
        self.full_shape_outputs = info.full_shape_grad_outputs
        # Autograd wants one gradient (or None) per input of RunTrainingGraph.forward: the program,
        # the OrtValues, then every feed. When the gradients are those of the last feeds, in order
        # (no user input requires grad), the result is a constant prefix of Nones plus ORT's list.
        n_feeds, index = len(graph.feed_names), info.grad_feed_index
        self._n_feeds = n_feeds
        self._grad_index = index
        tail = tuple(range(n_feeds - len(index), n_feeds))
        self._grad_prefix: tuple[None, ...] | None = (
            (None,) * (_LEADING_ARGS + n_feeds - len(index)) if index == tail else None
        )
        #: outputs that may share memory with a value the backward reuses (see _aliased_outputs)
        self._copy_outputs = _aliased_outputs(graph, model)
        # Which output gradients each backward result depends on: a result none of whose outputs
        # got a gradient from autograd is None, as eager leaves ``.grad`` of a parameter the loss
        # does not reach (AdamW then skips it; a zero gradient would decay it).
        self._grad_deps = _grad_dependencies(graph, model)
        self._constant_grads = tuple(j for j, m in enumerate(self._grad_deps) if m == 0)
        self._serial = _serial_kernels(graph, model)
        self._region = _region(device, options, model)

    def zero_grad(self, index: int, shape: tuple) -> torch.Tensor:
        """A zero gradient for user output ``index`` (a scalar where ORT accepts one)."""
        assert self._output_types is not None
        dtype, device = self._output_types[index]
        return torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, feeds: C.OrtValueVector) -> tuple[list[torch.Tensor], C.PartialGraphExecutionState]:
        state = _State()
        fetches = _OrtValueVector()
        if _pending:
            _pending.clear()
        serial = self._serial
        region = self._region
        entered = region is not None and region[0]()
        try:
            if serial is not None:
                serial(1)
            self._agent.run_forward(feeds, fetches, state, None)
        except Exception as e:
            _raise_run_error("forward", e)
        finally:
            if serial is not None:
                serial(0)
            if entered:
                region[1]()
        if _pending:
            bridge_state.reraise_pending(None)
        outputs = fetches.to_dlpacks(self._from_dlpack)
        if self._bool_outputs:
            for i in fetches.bool_tensor_indices():
                outputs[i] = outputs[i].view(torch.bool)
        if self._output_types is None:
            _check_dtypes(self._declared, outputs, self.graph.info.user_output_names)
            self._output_types = [(t.dtype, t.device) for t in outputs]
        for i in self._copy_outputs:
            outputs[i] = outputs[i].clone()
        return outputs, state

    def backward(self, state: C.PartialGraphExecutionState, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        vec = _OrtValueVector()
        push = vec.push_back
        for g in grads:
            # Gradients of reductions arrive expanded (stride 0); ORT reads dense memory.
            push(to_dlpack(g if g.is_contiguous() else g.contiguous()), False)
        fetches = _OrtValueVector()
        if _pending:
            _pending.clear()
        serial = self._serial
        region = self._region
        entered = region is not None and region[0]()
        try:
            if serial is not None:
                serial(1)
            self._agent.run_backward(vec, fetches, state)
        except Exception as e:
            _raise_run_error("backward", e)
        finally:
            if serial is not None:
                serial(0)
            if entered:
                region[1]()
        release_cached()  # the kernels' freed blocks, for the optimizer step (kernels.release_cached)
        if _pending:
            bridge_state.reraise_pending(None)
        if not self._grad_index:
            # NOTE: with no gradient to fetch (DeepSpeed ZeRO-3 per submodule: the graph hands them to the
            # parameters itself), ORT 1.19.2's agent fills the vector with values that are not tensors.
            return []
        return fetches.to_dlpacks(self._from_dlpack)  # gradients are never bool

    def place_grads(self, results: list[torch.Tensor], missing: int = 0) -> tuple[torch.Tensor | None, ...]:
        """``results`` (ORT's gradients) as autograd wants them from ``RunTrainingGraph.backward``:
        ``None`` for the program and the OrtValues, then one entry per feed. ``missing``: bit mask
        of the user outputs autograd gave no gradient (see ``_grad_dependencies``)."""
        if (missing or self._constant_grads) and results:
            results = list(results)
            deps = self._grad_deps
            for j in range(len(results)):
                if not deps[j] & ~missing:
                    results[j] = None
        if self._grad_prefix is not None:
            return self._grad_prefix + tuple(results)
        out: list[torch.Tensor | None] = [None] * (_LEADING_ARGS + self._n_feeds)
        for index, g in zip(self._grad_index, results):
            out[_LEADING_ARGS + index] = g
        return tuple(out)


class InferenceRunner:
    """Runs a forward-only graph (``torch.no_grad()``, or nothing requires grad)."""

    def __init__(self, graph: TrainingGraph, device: torch.device, options: Options) -> None:
        self.graph = graph
        self.device = device
        model = graph.model()
        self._session, ort_device = _create_session(graph, device, options, model)
        self._sess = self._session._sess
        self._feed_names = list(graph.feed_names)
        self._fetch_names = list(graph.info.user_output_names)
        self._devices = [ort_device] * len(self._fetch_names)
        self._run_options = ort.RunOptions()
        self._bool_outputs = _has_bool_outputs(graph, model)
        self._declared: list[torch.dtype | None] | None = _declared_dtypes(model, self._fetch_names)
        self._region = _region(device, options, model)

    def forward(self, feeds: C.OrtValueVector) -> list[torch.Tensor]:
        fetches = C.OrtValueVector()
        _run(
            "forward",
            self._sess.run_with_ortvaluevector,
            self._run_options,
            self._feed_names,
            feeds,
            self._fetch_names,
            fetches,
            self._devices,
            region=self._region,
        )
        outputs = to_tensors(fetches, self._bool_outputs)
        if self._declared is not None:  # (the first run only)
            _check_dtypes(self._declared, outputs, self._fetch_names)
            self._declared = None
        return outputs
