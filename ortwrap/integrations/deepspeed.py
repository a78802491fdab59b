"""DeepSpeed: ``deepspeed.initialize(model=ORTWrap(model), ...)`` with ZeRO stages 0 to 3.

ZeRO 1 and 2 need nothing from ortwrap: parameters stay whole, ONNX Runtime's gradients reach
``param.grad`` through autograd, and DeepSpeed's gradient hooks fire as in eager PyTorch.

ZeRO 3 partitions every parameter (``param.data`` is empty between uses). In eager PyTorch,
DeepSpeed's forward hooks gather a submodule's parameters before its forward and release them
after; ONNX Runtime runs one graph instead of the submodules' forwards, so those hooks never fire.
ortwrap therefore treats the whole wrapped module as the unit DeepSpeed gathers:

- before each run, :func:`zero3_forward` all-gathers the wrapped module's partitioned parameters
  (with DeepSpeed's own ``param.all_gather``; a collective, so every rank does it in the same order);
- the export traces the module with its parameters whole and DeepSpeed's module hooks hidden
  (:func:`export_guard`), so one graph serves every step;
- the parameters stay gathered until the backward through that run has finished: ONNX Runtime reads
  them during its backward, and autograd accumulates whole gradients into ``param.grad``, where
  DeepSpeed's own gradient hooks reduce-scatter them as in eager ZeRO-3. At the end of the backward
  (an autograd engine callback, queued after DeepSpeed's) they are partitioned again;
- a run without a backward (``torch.no_grad()``, eval) releases them right after the forward.

NOTE: peak parameter memory is therefore the whole wrapped module's parameters during a training
step (eager ZeRO-3 holds one submodule's at a time); between steps they are partitioned. With
``zero3_gather="submodule"`` the graph gathers each submodule's parameters itself, in the forward and
again in the backward, and hands the gradients to DeepSpeed inside ORT's backward
(``zero3_layers.py``; docs/distributed.md).

Nothing here imports DeepSpeed at module import.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._compat import torch as compat
from .._logging import logger
from .._tree import flatten
from ..errors import UnsupportedInputError
from . import Integration, Step, zero3_layers

if TYPE_CHECKING:
    from . import Wrapper

__all__ = [
    "ZERO3_MARK",
    "DeepSpeedZero3",
    "export_guard",
    "is_zero3_module",
    "zero3_forward",
]

#: DeepSpeed's ZeRO-3 stage sets this attribute on every module it hooks (its module id).
ZERO3_MARK = "ds_id"
#: Set on an ORTWrap while :func:`zero3_forward` runs its forward (guards against re-entry).
BUSY_MARK = "_ortwrap_zero3_busy"
_STATE = "_ortwrap_zero3"


def is_zero3_module(module: nn.Module) -> bool:
    """Whether DeepSpeed's ZeRO-3 stage hooked ``module`` (``deepspeed.initialize`` with stage 3)."""
    return ZERO3_MARK in module.__dict__


def _is_zero_param(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id") and hasattr(p, "ds_status")


def _status(name: str) -> Any:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return getattr(ZeroParamStatus, name)


# --------------------------------------------------------------------------- DeepSpeed's module hooks


def _is_deepspeed_hook(hook: Any) -> bool:
    fn = getattr(hook, "func", hook)  # functools.partial
    return (getattr(fn, "__module__", None) or "").startswith("deepspeed.")


@contextlib.contextmanager
def _deepspeed_hooks_hidden(root: nn.Module) -> Iterator[int]:
    """Hide DeepSpeed's forward/backward hooks on ``root`` and its submodules; restore them in order."""
    saved: list[tuple[dict, dict]] = []
    hidden = 0
    for m in root.modules():
        for hooks, side_tables in compat.hook_tables(m):
            ids = [k for k, h in hooks.items() if _is_deepspeed_hook(h)]
            if not ids:
                continue
            saved.append((hooks, dict(hooks)))
            for k in ids:
                del hooks[k]
            hidden += len(ids)
            for extra in side_tables:
                if any(k in extra for k in ids):
                    saved.append((extra, dict(extra)))
                    for k in ids:
                        extra.pop(k, None)
    try:
        yield hidden
    finally:
        for d, original in reversed(saved):
            d.clear()
            d.update(original)


@contextlib.contextmanager
def export_guard(wrapper: Wrapper) -> Iterator[None]:
    """While ORTWrap builds a program for a ZeRO-3 module: hide DeepSpeed's module hooks.

    Tracing would otherwise run them: they fetch and release parameters with collectives (which the
    export's collective stubs would turn into garbage) and add autograd Functions to the graph. The
    parameters are already whole (:func:`zero3_forward`), and ``F.linear`` is torch's own while
    tracing (:func:`_plain_linear`; DeepSpeed's Function would be a PythonOp per Linear: a Python
    call each step, and a graph the build cache cannot keep). A no-op for any other module.
    """
    if not is_zero3_module(wrapper):
        yield
        return
    with _deepspeed_hooks_hidden(wrapper.module) as n:
        logger.debug("ZeRO-3: %d DeepSpeed module hooks hidden while exporting", n)
        if not _per_submodule(wrapper):
            with _plain_linear():
                yield
            return
        with _submodule_export(wrapper):
            yield


@contextlib.contextmanager
def _submodule_export(wrapper: Wrapper) -> Iterator[None]:
    """``zero3_gather="submodule"``: the trace reads each submodule's parameters from a gather node.

    The parameters are whole while the module is traced (gathered here, partitioned after), and the
    submodules that own partitioned parameters get the export hooks of ``zero3_layers``.
    """
    st = _state(wrapper)
    table = _layer_table(wrapper, st)
    # The fetch op becomes an ATen node under either exporter: the TorchScript exporter through its
    # symbolic, the dynamo exporter through its ATen fallback (an op without a translation).
    zero3_layers.register_symbolics(wrapper.options.opset)
    _gather(wrapper, st)
    remove = zero3_layers.install_export_hooks(wrapper.module, table)
    table.exporting = True
    zero3_layers.set_current(table)
    try:
        with _plain_linear():
            yield
    finally:
        table.exporting = False
        remove()
        _release_if_idle(wrapper, st)


@contextlib.contextmanager
def _plain_linear() -> Iterator[None]:
    """``torch.nn.functional.linear`` as torch defines it while exporting.

    DeepSpeed's ZeRO-3 replaces it (``memory_efficient_linear``, on by default) with an autograd
    Function that saves the weight *parameter* for its backward, to gather it again there. Inside
    ORT that Function would be a PythonOp whose saved weight is a whole copy kept until the backward;
    exported as torch's linear, ORT differentiates it and the graph gathers the weight again itself.
    """
    from deepspeed.runtime.zero import linear as ds_linear
    from deepspeed.runtime.zero import partition_parameters as ds_pp

    functional = torch.nn.functional
    original = getattr(ds_pp.InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    patched = functional.linear
    if original is None or patched is not ds_linear.zero3_linear_wrap:
        yield
        return
    functional.linear = original
    try:
        yield
    finally:
        functional.linear = patched


# --------------------------------------------------------------------------- gathering around a run


class _Zero3State:
    """One ORTWrap's ZeRO-3 bookkeeping.

    NOTE: ``gathered`` are the parameters this wrapper all-gathered and still has to partition;
    ``pending`` are the autograd nodes of training runs whose backward has not run yet. Parameters
    are partitioned when no run is pending: after the last pending backward, or at once after a run
    without a backward. A run whose outputs are dropped without a backward stops being pending when
    autograd frees its node.
    """

    def __init__(self) -> None:
        self.gathered: list[nn.Parameter] = []
        self.pending: weakref.WeakSet = weakref.WeakSet()
        self.checked: set[int] = set()
        self.table: zero3_layers.LayerTable | None = None
        self.handed_over: list[nn.Parameter] = []
        self.table_of: int | None = None


def _state(wrapper: Wrapper) -> _Zero3State:
    st = wrapper.__dict__.get(_STATE)
    if st is None:
        st = wrapper.__dict__[_STATE] = _Zero3State()
    return st


def _check_supported(wrapper: Wrapper, st: _Zero3State) -> None:
    """Refuse ZeRO-3 set-ups whose DeepSpeed hooks ORT would skip (checked once per module set)."""
    key = id(wrapper.module)
    if key in st.checked:
        return
    leaves = [
        name or type(wrapper.module).__name__
        for name, m in wrapper.module.named_modules()
        if getattr(m, "_z3_leaf", False)
    ]
    if leaves:
        raise UnsupportedInputError(
            f"ORTWrap under DeepSpeed ZeRO-3: {', '.join(leaves)} are ZeRO-3 leaf modules "
            "(deepspeed.utils.set_z3_leaf_modules): DeepSpeed reduces their gradients in a module backward hook, "
            "which does not fire when ONNX Runtime runs the graph. Unset the leaf flag, or wrap a module that "
            "contains no leaf module"
        )
    st.checked.add(key)


def _per_submodule(wrapper: Wrapper) -> bool:
    return wrapper.options.zero3_gather == "submodule"


def zero3_forward(wrapper: Wrapper, step: Step) -> Any:
    """The call ``step`` of ``wrapper`` for a module whose parameters DeepSpeed ZeRO-3 partitions.

    Gathers the partitioned parameters (``zero3_gather="module"``; with ``"submodule"`` the graph
    gathers each submodule's itself, see ``zero3_layers``), runs the wrapper's forward (which exports
    with :func:`export_guard` on its first call), and arranges for the parameters to be partitioned
    again after the backward, or at once when no backward will run.
    """
    st = _state(wrapper)
    _check_supported(wrapper, st)
    per_submodule = _per_submodule(wrapper)
    if per_submodule:
        zero3_layers.define_ops()
        zero3_layers.set_current(_layer_table(wrapper, st))
    else:
        try:
            _gather(wrapper, st)
        except _Prefetched as e:
            if not step.fell_back_before or not wrapper.options.fallback:
                raise
            # NOTE: an earlier call fell back, so the module ran under DeepSpeed's own hooks, and
            # DeepSpeed's prefetch now gathers its parameters ahead of ortwrap: this signature runs
            # in PyTorch too (said once, remembered), as every call did before fallback was per signature.
            return step.fall_back(e)
    wrapper.__dict__[BUSY_MARK] = True
    try:
        outcome = step.run()  # not wrapper(...): DeepSpeed's hooks on it already ran
    except BaseException:
        _release_if_idle(wrapper, st)
        raise
    finally:
        del wrapper.__dict__[BUSY_MARK]
    out = outcome.output
    if outcome.fell_back:
        # This call fell back (fallback is per input signature: other calls may still run on ORT): the
        # module ran in PyTorch, with DeepSpeed's own hooks, which gather what its backward needs.
        _release_if_idle(wrapper, st)
        return out
    node = _backward_node(out)
    if node is None:
        _release_if_idle(wrapper, st)
        return out
    try:
        st.pending.add(node)
        node_ref: weakref.ref | None = weakref.ref(node)
    except TypeError:  # a C++ node: no weak reference; it is simply not counted as pending
        node_ref = None
    if per_submodule:
        table = st.table
        # NOTE: the graph's gather nodes read the current table; the backward may run after another
        # wrapper's forward, so it is set again just before this run's backward.
        node.register_prehook(lambda grad_outputs: zero3_layers.set_current(table))
    node.register_hook(_on_backward(wrapper, node_ref))
    return out


def _layer_table(wrapper: Wrapper, st: _Zero3State) -> zero3_layers.LayerTable:
    """The wrapper's per-submodule gather table (``zero3_gather="submodule"``)."""
    if st.table is None:
        not_available = _status("NOT_AVAILABLE")

        def gather(params: list[nn.Parameter]) -> None:
            # NOTE: a collective: every rank's graph gathers the same layers in the same order.
            with torch.no_grad():
                params[0].all_gather(param_list=params)
            known = {id(p) for p in st.gathered}
            st.gathered.extend(p for p in params if id(p) not in known)

        def partition(params: list[nn.Parameter]) -> None:
            to_release = [p for p in params if not getattr(p, "ds_persist", False) and not p.ds_active_sub_modules]
            if to_release:
                with torch.no_grad():
                    to_release[0].partition(param_list=to_release)
            released = {id(p) for p in to_release}
            st.gathered[:] = [p for p in st.gathered if id(p) not in released]

        def hand_over(p: nn.Parameter, grad: torch.Tensor) -> None:
            # NOTE: the parameter's own AccumulateGrad: p.grad += grad, then its post-accumulate-grad
            # hooks, where DeepSpeed adds the gradient to its reduce-scatter bucket, as when eager
            # autograd reaches the parameter. The parameter is also an input of ortwrap's autograd
            # node, whose backward returns no gradient for it; torch still runs its AccumulateGrad
            # (and the hooks) at the end of the backward: ``ds_grad_is_ready`` (DeepSpeed's own flag
            # for gradients produced in pieces) makes DeepSpeed skip that second call.
            p.ds_grad_is_ready = True
            torch.autograd.graph.get_gradient_edge(p).node(grad)
            p.ds_grad_is_ready = False
            st.handed_over.append(p)

        st.table = zero3_layers.LayerTable(
            gather=gather,
            partition=partition,
            available=lambda p: p.ds_status != not_available,
            hand_over=hand_over,
        )
    if st.table_of != id(wrapper.module):  # (a new wrapped module: number its submodules)
        st.table.register(wrapper.module, _is_zero_param)
        st.table_of = id(wrapper.module)
    return st.table


class _Prefetched(UnsupportedInputError):
    """DeepSpeed's prefetch is gathering the wrapped module's parameters when ortwrap would."""


def _gather(wrapper: Wrapper, st: _Zero3State) -> None:
    """All-gather the wrapped module's partitioned parameters (a collective: every rank gathers the
    same parameters in the same order)."""
    params = [p for p in wrapper.module.parameters() if _is_zero_param(p)]
    not_available = _status("NOT_AVAILABLE")
    inflight = [p for p in params if p.ds_status == _status("INFLIGHT")]
    if inflight:
        raise _Prefetched(
            f"ORTWrap under DeepSpeed ZeRO-3: {len(inflight)} parameters are being gathered by DeepSpeed's "
            "prefetch when ORTWrap runs; ortwrap gathers the wrapped module's parameters itself"
        )
    to_gather = [p for p in params if p.ds_status == not_available]
    if to_gather:
        # NOTE: a collective: every rank gathers the same parameters in the same order.
        with torch.no_grad():
            to_gather[0].all_gather(param_list=to_gather)
        known = {id(p) for p in st.gathered}
        st.gathered.extend(p for p in to_gather if id(p) not in known)


def _backward_node(out: Any) -> Any:
    """The autograd node that runs the backward of this call's outputs, or ``None``."""
    leaves: list[torch.Tensor] = []
    flatten(out, "output", leaves, lambda path, value: ("O", None))
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            return t.grad_fn
    return None


def _on_backward(wrapper: Wrapper, node_ref: weakref.ref | None) -> Any:
    # NOTE: weak references only: the hook lives on the node, and a strong reference to the node (or to
    # the wrapper) would keep an abandoned run pending forever.
    ref = weakref.ref(wrapper)

    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        # NOTE: this node's backward just ran; the parameters' gradients are accumulated (and handed to
        # DeepSpeed's hooks) later in this backward, and DeepSpeed queues its own epilogue then. Our
        # callback runs at the end of the backward and re-queues itself once, so that it runs after
        # every callback queued before it, DeepSpeed's included.
        def release() -> None:
            w = ref()
            if w is not None:
                st = _state(w)
                node = node_ref() if node_ref is not None else None
                if node is not None:
                    st.pending.discard(node)
                _release_if_idle(w, st)

        compat.queue_backward_callback(lambda: compat.queue_backward_callback(release))

    return hook


def _release_if_idle(wrapper: Wrapper, st: _Zero3State) -> None:
    """Partition what this wrapper gathered, unless a run still waits for its backward."""
    if len(st.pending):
        return
    for p in st.handed_over:  # (zero3_gather="submodule": see hand_over)
        p.ds_grad_is_ready = True
    st.handed_over.clear()
    if not st.gathered:
        return
    available = _status("AVAILABLE")
    to_release = [
        p
        for p in st.gathered
        if p.ds_status == available and not getattr(p, "ds_persist", False) and not p.ds_active_sub_modules
    ]
    st.gathered.clear()
    if to_release:
        with torch.no_grad():
            to_release[0].partition(param_list=to_release)
    # The programs' cached OrtValues would keep the whole parameters' memory alive.
    for program in wrapper.programs():
        program.forget_state_values()


class DeepSpeedZero3(Integration):
    """The integration seam's ZeRO-3 hooks (``ortwrap.integrations.Integration``): around a step,
    gather and release; before export, DeepSpeed's module hooks hidden."""

    name = "deepspeed-zero3"
    #: DeepSpeed's per-module bookkeeping (ZeRO-3's hooks set these on every module they walk, the
    #: wrapper included) belongs to the wrapper, not to the wrapped module.
    wrapper_attributes = (
        "ds_",
        "_ds_",
        "_external_params",
        "_original_parameters",
        "all_parameters",
        "applied_pre_backward_ref_cnt",
        "post_bwd_fn",
        "pre_bwd_fn",
    )

    def check_wrappable(self, module: nn.Module) -> None:
        pass  # (the wrap-order check of DeepSpeed engines is DataParallelWrappers')

    def applies(self, wrapper: Wrapper) -> bool:
        d = wrapper.__dict__
        return ZERO3_MARK in d and BUSY_MARK not in d

    def step(self, wrapper: Wrapper, step: Step) -> Any:
        return zero3_forward(wrapper, step)

    def export_context(self, wrapper: Wrapper) -> Any:
        return export_guard(wrapper)

    def rewrite_graph(self, graph: Any) -> Any:
        return zero3_layers.rewrite_training_graph(graph)
