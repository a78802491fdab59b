"""Which program runs a call: the graph key of a call, the programs by key and the keys that fell
back, the decision to fall back, int arguments promoted to graph inputs, and the calls run in
PyTorch again (eager re-runs: a bad batch's own exception, an empty batch, shapes a capture cannot
take).

``ORTWrap`` (``api.py``) keeps one :class:`Dispatcher` and hands it every call its engine and its
integrations do not take over. A call's :class:`GraphKey` selects a :class:`ProgramSet`: the
programs of that input schema. No program and no fallback for the key: ``build/``'s
``compile_program`` builds one.
"""

from __future__ import annotations

import inspect
import operator
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from . import _tree, integrations
from ._compat import torch as compat
from ._logging import logger, warn_at_user_line
from .bridge import state as bridge_state
from .build import BuildArtifacts, compile_program
from .errors import (
    FALLBACK_PHASES,
    ExportError,
    FallbackWarning,
    ORTWrapError,
    RuntimeRunError,
    UnsupportedFunctionError,
    UnsupportedInputError,
    VerificationError,
    sentence,
)
from .options import Options
from .runtime.function import run_training_graph
from .runtime.program import Program
from .split_capture import SplitCapture, is_data_dependent
from .verify import verify_program

__all__ = ["Dispatcher", "GraphKey", "ProgramSet", "autocast_state"]


class GraphKey(NamedTuple):
    """What selects a call's programs: calls with equal keys share them (shapes are not part of it)."""

    #: the module's train/eval mode
    training: bool
    #: a backward is built (grad mode on and a parameter or input requires grad)
    needs_grad: bool
    #: the input structure: the argument count on the fast path (only positional tensors), else
    #: the tree spec (with its non-tensor values)
    structure: Any
    #: per tensor leaf: (rank, dtype, device, requires_grad)
    tensors: tuple
    #: each parameter's requires_grad, when a backward is built (else ``()``)
    params_requires_grad: tuple
    #: ``autocast_state()`` where autocast is on, else None
    autocast: tuple | None


#: ``GraphKey`` from a tuple of its six values, without NamedTuple's argument handling (per step).
_tuple_new = tuple.__new__


class ProgramSet:
    """The programs of one input schema: the one kind of value ``ORTWrap`` caches per schema key.

    Usually a single program (every input dimension dynamic). A graph whose non-batch dimensions
    are static has one program per such shape; a dynamo capture that fixed or tied dimensions has
    one per set of shape guards, and the first whose guards hold serves a call.
    """

    __slots__ = ("_by_shape", "_dynamic", "_guarded")

    def __init__(self) -> None:
        self._dynamic: Program | None = None
        self._by_shape: dict[tuple, Program] = {}
        self._guarded: list[Program] = []

    def find(self, leaves: list[torch.Tensor]) -> Program | None:
        """The program that serves these inputs, or None (a build is needed, or, for an input with a
        zero-size dimension, a run in PyTorch: ``ORTWrap.forward``)."""
        # NOTE: no program serves a zero-size input, though a dynamic batch dimension (the TorchScript
        # exporter's) admits 0: ORT kernels reject empty tensors (Gemm's gradient with K = 0) and the
        # trace dropped any branch of forward() on an empty batch. (The dynamo exporter's programs
        # guard each dynamic size to be at least 2: torch.export specializes 0 and 1.) Checked on
        # every call: one numel() a leaf.
        for t in leaves:
            if not t.numel():
                return None
        if self._dynamic is not None:
            return self._dynamic
        if self._by_shape:
            program = self._by_shape.get(tuple(tuple(t.shape[1:]) for t in leaves))
            if program is not None:
                return program
        for program in self._guarded:
            if program.shape_guards.check(leaves):
                return program
        return None

    @property
    def guarded(self) -> bool:
        """Whether the schema's programs carry shape guards (a miss means: new shapes)."""
        return bool(self._guarded)

    def add(self, program: Program, leaves: list[torch.Tensor]) -> None:
        if program.static_spatial:
            self._by_shape[tuple(tuple(t.shape[1:]) for t in leaves)] = program
        elif program.shape_guards:
            self._guarded.append(program)
        else:
            self._dynamic = program

    def remove(self, program: Program) -> None:
        if self._dynamic is program:
            self._dynamic = None
        self._by_shape = {k: p for k, p in self._by_shape.items() if p is not program}
        self._guarded = [p for p in self._guarded if p is not program]

    def __iter__(self):
        if self._dynamic is not None:
            yield self._dynamic
        yield from self._by_shape.values()
        yield from self._guarded

    def __bool__(self) -> bool:
        return self._dynamic is not None or bool(self._by_shape) or bool(self._guarded)


class Dispatcher:
    """One wrapper's calls on the training engine: its program table (:class:`ProgramSet` by
    :class:`GraphKey`), the keys that fell back, and how each call is served.

    Args:
        wrapper: the ``ORTWrap`` (held weakly: integrations' export contexts take it).
        module: the wrapped module.
        options: the wrapper's resolved options.
    """

    def __init__(
        self,
        wrapper: nn.Module,
        module: nn.Module,
        options: Options,
        option_values: dict | None = None,
        wrap: Callable[..., nn.Module] | None = None,
    ) -> None:
        self._wrapper = weakref.ref(wrapper)
        self.module = module
        self.options = options
        self.option_values = option_values or {}
        self.wrap = wrap  # what trains a split capture's fragment (ORTWrap)
        self.table: dict[GraphKey, ProgramSet] = {}
        #: graph key -> its split capture (split_capture.py): a key whose capture stops on a data-dependent guard
        self.split: dict[GraphKey, SplitCapture] = {}
        # NOTE: fallback is per graph key: the keys whose build (or first run) failed on an input
        # PyTorch accepts, each with its error's text (not the error: its traceback holds the frames
        # of that call, its tensors included). Their calls run in PyTorch; every other key keeps
        # building and running on ONNX Runtime.
        self.failed: dict[GraphKey, str] = {}
        # NOTE: calls whose build failed and which eager PyTorch rejects too (a batch of a bad shape):
        # by graph key, the leaves' shapes of each such call (at most _BAD_SHAPES a key). The same
        # signature again runs in PyTorch straight away (eager's exception, no new export); if it
        # passes there, it is forgotten and the next such call builds.
        self.bad_shapes: dict[GraphKey, set] = {}
        self.fallback_calls = 0  # calls run in PyTorch for a failed key (_Step.run compares it)
        self.export_count = 0
        self.last_artifacts: BuildArtifacts | None = None
        self.fallback_reason: ORTWrapError | None = None
        self.empty_logged = False
        self.in_method = False  # a method of the module is running (api.py's _routed_method)
        self.method_warned = False
        self.arg_names = _positional_names(module)
        # NOTE: int arguments that change between calls (``promote_ints``): by the input spec
        # without its int values, the values of the last build, the int positions fed as graph
        # inputs, the positions that failed alone, and the promotions tried.
        self.ints_seen: dict = {}
        self.ints_fed: dict = {}
        self.ints_refused: dict = {}
        self.ints_tries: dict = {}
        # NOTE: the parameter list is cached for the per-step requires_grad check; it is refreshed
        # whenever the module's parameters may have been replaced (load_state_dict, _apply, builds).
        self.params: list[nn.Parameter] = list(module.parameters())

    def forget(self) -> None:
        """The module changed: every program is rebuilt on its next call, and the keys that fell
        back are tried again (what changed may be what failed)."""
        self.table.clear()
        self.failed.clear()
        self.split.clear()
        self.bad_shapes.clear()
        self.refresh_params()

    def refresh_params(self) -> None:
        self.params = list(self.module.parameters())

    def integration_step(
        self, integration: integrations.Integration, wrapper: nn.Module, args: tuple, kwargs: dict
    ) -> Any:
        """A call an integration takes over (partitioned parameters gathered around it)."""
        if self.failed and self.falls_back(args, kwargs):
            # NOTE: a signature that fell back runs in PyTorch before the integration gathers
            # anything: the module's own hooks (the integration's) manage its parameters.
            self.fallback_calls += 1
            return self.module(*args, **kwargs)
        return integration.step(wrapper, _Step(self, args, kwargs))

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        """Run one call: its program (built on first use), or PyTorch where its signature fell back."""
        try:
            key, leaves, in_spec = self.signature(args, kwargs)
        except UnsupportedInputError as e:
            if not self.in_method:
                raise
            # A method of the module (generate with a KV cache object, say) calls self(...) with
            # inputs ORTWrap cannot feed: that call runs in PyTorch, said once.
            if not self.method_warned:
                self.method_warned = True
                warn_at_user_line(
                    f"ORTWrap runs calls of {type(self.module).__name__} that a method of the module makes "
                    f"with inputs ONNX Runtime cannot take in PyTorch: {e}",
                    FallbackWarning,
                )
            return self.module(*args, **kwargs)
        needs_grad = key.needs_grad
        try:
            programs = self.table.get(key)
        except TypeError as e:  # an unhashable constant somewhere in the inputs
            raise UnsupportedInputError(f"forward() inputs hold a constant that cannot be hashed: {e}") from e
        program = programs.find(leaves) if programs is not None else None
        if program is None:
            if self.split and key in self.split:
                return self.split[key](*args, **kwargs)
            if programs is None and self.failed and key in self.failed:
                self.fallback_calls += 1  # this signature fell back (said once, when it did)
                return self.module(*args, **kwargs)
            if self.bad_shapes and key in self.bad_shapes:
                shapes = tuple(t.shape for t in leaves)
                if shapes in self.bad_shapes[key]:
                    out = self.module(*args, **kwargs)  # eager's exception, as on the first such call
                    self.bad_shapes[key].discard(shapes)  # (eager took it this time: build the next one)
                    return out
            if in_spec is None:
                in_spec = self.flatten_inputs(args, kwargs, [])
            if any(t.numel() == 0 for t in leaves):
                # NOTE: an empty batch runs in PyTorch (ORT kernels reject zero-size inputs); it
                # gets eager's loss (0 or nan), gradients or exception, and builds nothing.
                if not self.empty_logged:
                    self.empty_logged = True
                    logger.info(
                        "an input with a zero-size dimension runs in PyTorch (ORT kernels reject empty tensors)"
                    )
                return self.module(*args, **kwargs)
            promoted = self.promote_ints(key, leaves, in_spec, needs_grad, args, kwargs)
            if promoted is not None:
                program, leaves, key = promoted
            else:
                try:
                    program = self.build(key, leaves, in_spec, needs_grad, programs, args, kwargs)
                except _GuardMiss as miss:
                    return self.run_eagerly_once(miss.error, args, kwargs)
                if program is None:  # this key fell back, or is split where its capture stops on data
                    return self.split[key](*args, **kwargs) if key in self.split else self.module(*args, **kwargs)
            if self.options.verify and promoted is None:
                try:
                    verify_program(self.module, program, args, kwargs, leaves, _run_program)
                except VerificationError:
                    self.evict(key, program)
                    raise
        if program.n_pythonops:
            bridge_state.collect_abandoned()  # a safe point: no ORT run is in progress
            bridge_state.maybe_purge()
        try:
            outputs = _run_program(program, leaves)
        except UnsupportedFunctionError as e:
            # Found only when the Function first runs: treated like a build failure.
            self.raise_if_eager_raises(args, kwargs)
            if not self.options.fallback:
                raise
            self.fall_back(e, key, in_spec, args, kwargs)
            return self.module(*args, **kwargs)
        except Exception as e:
            # NOTE: a bad input (wrong feature size, a user's shape assert traced away) reaches ORT
            # as a broadcast or shape error: the user gets eager's own exception, on every call,
            # and the program stays for the next good batch.
            self.raise_if_eager_raises(args, kwargs)
            error = RuntimeRunError(
                f"ONNX Runtime failed to run the {program} on an input PyTorch accepts: {sentence(str(e))} "
                "Report it with ORTWrap(..., debug_dir=...)'s artifacts"
            )
            if program.runs == 0 and self.options.fallback:
                # A program that never ran, on an input eager accepts: the build is what failed (an
                # ATen node ORT cannot feed, a kernel ORT lacks at run time), not the batch.
                error.__cause__ = e
                self.fall_back(error, key, in_spec, args, kwargs)
                return self.module(*args, **kwargs)
            raise RuntimeRunError(f"{error.detail} (fallback=True applies only to a program's first run)") from e
        program.runs += 1
        n = program.n_outputs
        if program.buffer_outputs:
            with torch.no_grad():
                for buf, value in zip(program.buffer_outputs, outputs[n : n + len(program.buffer_outputs)]):
                    buf.copy_(value)
        spec = program.out_spec
        if spec is _tree.TENSOR:
            return outputs[0]
        return _tree.unflatten(spec, outputs[:n])

    def signature(self, args: tuple, kwargs: dict) -> tuple[GraphKey, list[torch.Tensor], tuple | None]:
        """The call's graph key (mode, gradients, input structure, each tensor's rank, dtype, device
        and requires_grad, the parameters' requires_grad, autocast), its tensor leaves, and its
        tree spec (``None`` on the fast path: only plain positional tensors). Raises
        ``UnsupportedInputError`` for an input ORTWrap cannot feed."""
        params_rg = tuple(map(_requires_grad, self.params))
        grad_on = _grad_enabled()
        in_spec: tuple | None = None
        if not kwargs and ((len(args) == 1 and type(args[0]) is _Tensor) or all(type(a) is _Tensor for a in args)):
            # Fast path: only plain positional tensors. Its key is the argument count; the tree
            # spec is built only if a build is needed.
            leaves = list(args)
            structure: Any = len(args)
        else:
            leaves = []
            in_spec = structure = self.flatten_inputs(args, kwargs, leaves)
            if self.ints_fed and _tree.int_constants(in_spec):
                fed = self.ints_fed.get(_tree.rewrite_ints(in_spec, list(leaves), lambda i, v: None))
                if fed is not None:
                    in_spec = structure = _tree.rewrite_ints(
                        in_spec, leaves, lambda i, v: _tree.INT if i in fed else v, self.int_device(leaves)
                    )
        needs_grad = grad_on and (True in params_rg or any(t.requires_grad for t in leaves))
        key = _tuple_new(
            GraphKey,
            (
                self.module.training,
                needs_grad,
                structure,
                tuple([(t.dim(), t.dtype, t.device, t.requires_grad) for t in leaves]),
                params_rg if needs_grad else (),
                autocast_state() if (_any_autocast or _bind_autocast_check())() else None,  # its own graph
            ),
        )
        return key, leaves, in_spec

    def falls_back(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call's signature fell back (asked before an integration takes a call over)."""
        try:
            return self.signature(args, kwargs)[0] in self.failed
        except (UnsupportedInputError, TypeError):  # (the call itself says so, on its own path)
            return False

    def promote_ints(
        self, key: GraphKey, leaves: list[torch.Tensor], in_spec: tuple, needs_grad: bool, args: tuple, kwargs: dict
    ) -> tuple[Program, list[torch.Tensor], GraphKey] | None:
        """A build for a call whose ``int`` arguments differ from the last build's for the same
        inputs otherwise: those ints become 0-d int64 graph inputs, so that the next values reuse
        the graph. Returns the program, the call's leaves (the ints added) and its key, or None: no int
        changed, or the graph cannot take them as inputs (an int deciding a shape or a loop count:
        they stay constants, one export per value, as before).

        The promoted build must match eager on this call and on this call's tensors with the last
        build's ints (an int the trace turned into a constant gives the first value's result for
        the second): else it is dropped. An int that failed alone stays a constant; ints that
        failed together are tried again when fewer change at once, up to ``_INT_TRIES`` builds.
        """
        values = _tree.int_constants(in_spec)
        if not values:
            return None
        stripped = _tree.rewrite_ints(in_spec, list(leaves), lambda i, v: None)
        previous = self.ints_seen.get(stripped)
        self.ints_seen[stripped] = values
        if previous is None or stripped in self.ints_fed or self.ints_tries.get(stripped, 0) >= _INT_TRIES:
            return None
        refused = self.ints_refused.get(stripped, frozenset())
        changed = frozenset(i for i, (a, b) in enumerate(zip(previous, values)) if a != b and i not in refused)
        if not changed:
            return None
        self.ints_tries[stripped] = self.ints_tries.get(stripped, 0) + 1
        fed_leaves = list(leaves)
        device = self.int_device(leaves)
        spec = _tree.rewrite_ints(in_spec, fed_leaves, lambda i, v: _tree.INT if i in changed else v, device)
        fed_key = key._replace(
            structure=spec, tensors=tuple([(t.dim(), t.dtype, t.device, t.requires_grad) for t in fed_leaves])
        )
        program = None
        try:
            program = self.build(fed_key, fed_leaves, spec, needs_grad, None, args, kwargs, may_fall_back=False)
            if program is None or _random_ops(program):
                raise _NotPromoted("its graph has random ops: its results cannot be compared with eager")
            verify_program(self.module, program, args, kwargs, fed_leaves, _run_program)
            old_spec = _tree.rewrite_ints(in_spec, list(leaves), lambda i, v: previous[i])
            old_args, old_kwargs = _tree.unflatten(old_spec, leaves)
            old_leaves = list(leaves)
            _tree.rewrite_ints(old_spec, old_leaves, lambda i, v: _tree.INT if i in changed else v, device)
            verify_program(self.module, program, old_args, old_kwargs, old_leaves, _run_program)
        except Exception as e:
            if len(changed) == 1:  # (several: one of them may be a value, tried when it changes alone)
                self.ints_refused[stripped] = refused | changed
            self.table.pop(fed_key, None)  # the set this build made: no later call may run it
            logger.info(
                "int arguments of %s that change between calls stay graph constants (one export per value): %s",
                type(self.module).__name__,
                str(e).split(". ")[0][:300],
            )
            return None
        self.ints_fed[stripped] = changed
        logger.info("int arguments of %s that change between calls are graph inputs", type(self.module).__name__)
        return program, fed_leaves, fed_key

    def int_device(self, leaves: list[torch.Tensor]) -> torch.device:
        """Where ints fed as graph inputs go: with the call's tensors (or the parameters)."""
        if leaves:
            return leaves[0].device
        return self.params[0].device if self.params else torch.device("cpu")

    def fall_back(self, error: ORTWrapError, key: GraphKey, in_spec: tuple | None, args: tuple, kwargs: dict) -> None:
        """Run the calls of graph key ``key`` in PyTorch from now on, saying why once; other keys
        keep building and running on ONNX Runtime. ``in_spec``: the call's tree spec, or None (the
        fast path's: made from ``args`` and ``kwargs`` for the warning)."""
        if in_spec is None:
            in_spec = self.flatten_inputs(args, kwargs, [])
        self.table.pop(key, None)
        self.failed[key] = f"the {error.phase} phase failed: {error.detail}"
        self.fallback_reason = error
        self.fallback_calls += 1
        calls = self.describe_calls(key, in_spec)
        warn_at_user_line(
            f"ORTWrap falls back to PyTorch for {calls} of {type(self.module).__name__}: the {error.phase} phase "
            f"failed: {sentence(error.detail)} Calls with other inputs or modes still run on ONNX Runtime. "
            "Set ORTWrap(..., fallback=False) or ORTWRAP_FALLBACK=0 to raise instead.",
            FallbackWarning,
        )
        logger.info("falling back to PyTorch for %s: %s", calls, error.detail)  # (the FallbackWarning says it)

    def fall_back_call(self, error: ORTWrapError, args: tuple, kwargs: dict) -> Any:
        """Fall back for this call's signature (an integration found it cannot take the call over)
        and run the call in PyTorch."""
        key, _, in_spec = self.signature(args, kwargs)
        self.fall_back(error, key, in_spec, args, kwargs)
        return self.module(*args, **kwargs)

    def describe_calls(self, key: GraphKey, in_spec: tuple) -> str:
        """The calls of graph key ``key`` in short: mode, gradients, each input tensor's path,
        dtype, rank and device, autocast."""
        mode = "training-mode" if key.training else "eval-mode"
        grads = "with gradients" if key.needs_grad else "without gradients (inference)"
        paths = _leaf_paths(in_spec, self.arg_names)
        shapes = key.tensors
        paths += [f"input{i}" for i in range(len(paths), len(shapes))]  # (a promotion's key: its ints)
        inputs = ", ".join(
            f"{path}: {str(dtype).removeprefix('torch.')} {dim}-d on {device}"
            for path, (dim, dtype, device, _) in zip(paths, shapes)
        )
        text = f"{mode} calls {grads} on inputs ({inputs or 'none'})"
        if key.autocast is not None and key.autocast[0]:
            text += " under autocast " + ", ".join(f"{d}:{str(t).removeprefix('torch.')}" for d, t in key.autocast[0])
        return text

    def evict(self, key: GraphKey, program: Program) -> None:
        """Forget ``program`` (it failed verification), so that no later call runs it."""
        programs = self.table.get(key)
        if programs is not None:
            programs.remove(program)
            if not programs:
                del self.table[key]

    def all_programs(self) -> list[Program]:
        """Every compiled program of this wrapper (one per input schema and, where dimensions are
        static or guarded, per shape)."""
        return [p for programs in self.table.values() for p in programs]

    def run_eagerly_once(self, error: ORTWrapError, args: tuple, kwargs: dict) -> Any:
        """Shapes outside a dynamo capture's assumptions that do not export either: most often an
        input the module rejects (a wrong feature size). Run this call in PyTorch, so the module
        raises its own error; the programs for the shapes that worked stay."""
        out = self.module(*args, **kwargs)
        warn_at_user_line(
            f"ORTWrap ran one call of {type(self.module).__name__} in PyTorch: its input shapes break the dynamo "
            f"capture's assumptions and a new export failed: {error.detail}",
            FallbackWarning,
        )
        return out

    def flatten_inputs(self, args: tuple, kwargs: dict, leaves: list[torch.Tensor]) -> tuple:
        """Append the tensors of ``(args, kwargs)`` to ``leaves``; return their tree spec."""
        names = self.arg_names
        arg_specs = tuple(
            _tree.flatten(a, names[i] if i < len(names) else f"args[{i}]", leaves, _unsupported_input)
            for i, a in enumerate(args)
        )
        kw_keys = tuple(kwargs)
        kw_specs = tuple(_tree.flatten(kwargs[k], k, leaves, _unsupported_input) for k in kw_keys)
        return ("S", tuple, (("S", tuple, arg_specs), ("M", dict, kw_keys, kw_specs)))

    def raise_if_eager_raises(self, args: tuple, kwargs: dict) -> None:
        """Run the module eagerly on the input that failed; raise its exception if it raises.

        The run is discarded: no autograd graph, and buffers and RNG states are restored."""
        error = _eager_error(self.module, args, kwargs)
        if error is not None:
            raise error.with_traceback(error.__traceback__) from None

    def build(
        self,
        key: GraphKey,
        leaves: list[torch.Tensor],
        in_spec: tuple,
        needs_grad: bool,
        programs: ProgramSet | None,
        args: tuple = (),
        kwargs: dict | None = None,
        may_fall_back: bool = True,
    ) -> Program | None:
        devices = {t.device for t in leaves} | {p.device for p in self.module.parameters()}
        if len(devices) > 1:
            raise UnsupportedInputError(
                f"inputs and parameters are on several devices {sorted(map(str, devices))}; move them to one device"
            )
        device = devices.pop() if devices else torch.device("cpu")
        self.params = list(self.module.parameters())
        paths = _leaf_paths(in_spec, self.arg_names)
        try:
            with integrations.export_context(self._wrapper()):  # (an integration's module hooks hidden from the trace)
                program, artifacts = compile_program(
                    self.module,
                    leaves,
                    in_spec,
                    paths,
                    training=self.module.training,
                    with_backward=needs_grad,
                    device=device,
                    options=self.options,
                    build_index=self.export_count + 1,
                    autocast=key.autocast,
                )
        except FALLBACK_PHASES as e:
            self.export_count += 1 if isinstance(e, ExportError) else 2
            # NOTE: an input the module rejects (a wrong dtype or rank, a user's assert) fails the
            # build too: eager's exception is raised, and nothing is cached or switched off; the
            # signature is remembered, so that the same bad batch does not export again.
            error = _eager_error(self.module, args, kwargs or {})
            if error is not None:
                bad = self.bad_shapes.setdefault(key, set())
                if len(bad) < _BAD_SHAPES:
                    bad.add(tuple(t.shape for t in leaves))
                raise error.with_traceback(error.__traceback__) from None
            if programs is not None and programs.guarded and isinstance(e, ExportError):
                raise _GuardMiss(e) from e
            if (
                may_fall_back
                and self.wrap is not None
                and self.options.exporter in ("auto", "dynamo")
                and is_data_dependent(e)
            ):
                self.split[key] = SplitCapture(self.module, self.option_values, self.options, e, self.wrap)
                return None
            if not self.options.fallback or not may_fall_back:
                raise
            self.fall_back(e, key, in_spec, args, kwargs)
            return None
        self.export_count += artifacts.exports
        if programs is None:
            programs = self.table[key] = ProgramSet()
        programs.add(program, leaves)
        self.last_artifacts = artifacts
        if self.options.debug_dir:
            paths_saved = artifacts.save(self.options.debug_dir, self.export_count)
            logger.info("saved build artifacts: %s", ", ".join(paths_saved))
        return program


def _unsupported_input(path: str, value: Any) -> tuple:
    raise UnsupportedInputError(
        f"forward() argument `{path}` has type {type(value).__module__}.{type(value).__qualname__}, which ORTWrap "
        "cannot feed to ONNX Runtime. Pass tensors, nested in tuples, lists, dicts or dataclasses, or "
        "int/float/bool/str/None constants; convert other values to tensors first."
    )


class _Step:
    """A call an integration took over (``integrations.Step``)."""

    __slots__ = ("_dispatcher", "args", "kwargs")

    def __init__(self, dispatcher: Dispatcher, args: tuple, kwargs: dict) -> None:
        self._dispatcher, self.args, self.kwargs = dispatcher, args, kwargs

    @property
    def fell_back_before(self) -> bool:
        return bool(self._dispatcher.failed)

    def run(self) -> integrations.StepOutcome:
        d = self._dispatcher
        before = d.fallback_calls
        output = d(self.args, self.kwargs)
        return integrations.StepOutcome(output, d.fallback_calls != before)

    def fall_back(self, error: ORTWrapError) -> Any:
        return self._dispatcher.fall_back_call(error, self.args, self.kwargs)


_requires_grad = operator.attrgetter("requires_grad")
_any_autocast = None  # bound on first use (compat, never at import)


def _bind_autocast_check():
    global _any_autocast
    _any_autocast = compat.any_autocast_enabled()
    return _any_autocast


def autocast_state() -> tuple:
    """The autocast settings a forward runs under: (device type, dtype) of each device type where
    autocast is on, and whether its cast cache is on. Part of the program key."""
    return (
        tuple((d, torch.get_autocast_dtype(d)) for d in compat.AUTOCAST_DEVICES if torch.is_autocast_enabled(d)),
        torch.is_autocast_cache_enabled(),
    )


_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor


def _run_program(program: Program, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``program`` on ``leaves``: its flat outputs (user outputs, then buffer outputs, which the
    caller copies back). Used by every call and by verification."""
    feeds, values = program.bind(leaves)
    if program.with_backward:
        outputs = run_training_graph(program, values, *feeds)
    else:
        outputs = program.runner.forward(values)
        if program.n_pythonops:
            bridge_state.entries_left(program.n_pythonops)  # inference contexts stay in ORT's map
    if program.constant_outputs:  # a new tensor each call, as the module's forward makes one
        outputs = list(outputs)
        for i, value in program.constant_outputs:
            outputs.insert(i, value.clone())
    return outputs


def _eager_error(module: nn.Module, args: tuple, kwargs: dict) -> Exception | None:
    """The exception ``module(*args, **kwargs)`` raises in PyTorch, or ``None``; the run leaves no
    trace (no autograd graph; buffers, CPU and CUDA RNG states restored)."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        with torch.no_grad():
            module(*args, **kwargs)
    except Exception as e:
        return e
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return None


#: Promotions of changing ints tried per input structure (each a build and two checks).
_INT_TRIES = 3
#: Bad-batch shapes remembered per graph key (``Dispatcher.bad_shapes``).
_BAD_SHAPES = 16


class _NotPromoted(Exception):
    """Internal: int arguments cannot be graph inputs of this build (``Dispatcher.promote_ints``)."""


def _random_ops(program: Program) -> bool:
    from .verify import _random_nodes

    return bool(_random_nodes(program))


class _GuardMiss(Exception):
    """A dynamo program exists for the input schema, but these shapes neither fit nor export."""

    def __init__(self, error: ORTWrapError) -> None:
        super().__init__(str(error))
        self.error = error


def _positional_names(module: nn.Module) -> list[str]:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _leaf_paths(in_spec: tuple, arg_names: list[str]) -> list[str]:
    """A readable, unique name for each tensor leaf, in flattening order."""
    paths: list[str] = []

    def walk(spec: tuple, path: str) -> None:
        kind = spec[0]
        if kind in ("T", "I"):  # a tensor, an int fed as a 0-d tensor
            paths.append(path)
        elif kind == "S":
            for i, c in enumerate(spec[2]):
                walk(c, f"{path}[{i}]")
        elif kind == "M":
            for k, c in zip(spec[2], spec[3]):
                walk(c, f"{path}[{k!r}]")
        elif kind == "D":
            for k, c in zip(spec[2], spec[3]):
                walk(c, f"{path}.{k}")

    arg_specs, (_, _, kw_keys, kw_specs) = spec_children = in_spec[2][0][2], in_spec[2][1]
    del spec_children
    for i, s in enumerate(arg_specs):
        walk(s, arg_names[i] if i < len(arg_names) else f"args{i}")
    for k, s in zip(kw_keys, kw_specs):
        walk(s, str(k))
    return paths
