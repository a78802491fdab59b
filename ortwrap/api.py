"""``ORTWrap``: an ``nn.Module`` that runs the module it wraps on ONNX Runtime's training engine.

It keeps the wrapped module (``.module``) and, per input schema, a compiled :class:`Program`. The
schema is the structure of the inputs, their non-tensor values, and for each tensor its rank,
dtype, device and ``requires_grad``, plus the train/eval mode and whether a backward is needed.
Shapes are not part of it: every dimension is dynamic.
"""

from __future__ import annotations

import functools
import inspect
import operator
import types
import warnings
from typing import Any

import torch
from torch import nn

from . import _tree, integrations
from ._compat import torch as compat
from ._logging import logger, set_verbosity, warn_at_user_line
from .bridge import state as bridge_state
from .engines import make_engine
from .errors import (
    FALLBACK_PHASES,
    ExportError,
    ORTWrapError,
    RuntimeRunError,
    UnsupportedFunctionError,
    UnsupportedInputError,
    VerificationError,
    sentence,
)
from .export import split_capture
from .options import Options
from .program import BuildArtifacts, Program, ProgramSet, compile_program
from .runtime.function import run_training_graph
from .verify import verify_program

__all__ = ["FallbackWarning", "ORTWrap"]


class FallbackWarning(UserWarning):
    """ORTWrap could not build the module for ONNX Runtime and runs it in PyTorch instead."""


def _unsupported_input(path: str, value: Any) -> tuple:
    raise UnsupportedInputError(
        f"forward() argument `{path}` has type {type(value).__module__}.{type(value).__qualname__}, which ORTWrap "
        "cannot feed to ONNX Runtime. Pass tensors, nested in tuples, lists, dicts or dataclasses, or "
        "int/float/bool/str/None constants; convert other values to tensors first."
    )


class ORTWrap(nn.Module):
    """Train ``module`` on ONNX Runtime: ``model = ORTWrap(model)`` in an unchanged training loop.

    Args:
        module: the ``torch.nn.Module`` to run.
        **options: keyword-only fields of :class:`ortwrap.Options` (``fallback``, ``log_level``,
            ``debug_dir``, ``opset``, ``intra_op_threads``, ``allow_spinning``, ...). Options not
            given are read from their environment variables.

    Parameters, buffers and ``state_dict`` keys are the wrapped module's own. ``train()``,
    ``eval()`` and ``torch.no_grad()`` behave as in eager PyTorch.
    """

    def __new__(cls, module: nn.Module = None, /, **options: Any) -> ORTWrap:  # type: ignore[assignment]
        # One subclass per wrapped class, named after it and with its forward's signature: Trainer,
        # accelerate and PEFT read these off the class (see _specialized).
        if isinstance(module, nn.Module) and not isinstance(module, ORTWrap) and "_ortwrap_wrapped" not in cls.__dict__:
            cls = _specialized(cls, type(module))
        return super().__new__(cls)

    def __init__(self, module: nn.Module, /, **options: Any) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"ORTWrap(module): expected a torch.nn.Module, got {type(module).__qualname__}")
        if isinstance(module, ORTWrap):
            raise TypeError("ORTWrap(module): module is already an ORTWrap")
        if compat.is_compiled_module(module):
            raise TypeError(
                "ORTWrap(module): module is compiled with torch.compile; ORTWrap exports the module itself. "
                "Wrap the uncompiled module, and compile the wrapper if you like: torch.compile(ORTWrap(model)) "
                "(ORTWrap runs outside the compiled graph)"
            )
        integrations.check_wrappable(module)
        super().__init__()
        d = self.__dict__
        # NOTE: the wrapper presents the wrapped module. Its parameter, buffer and submodule tables
        # are the module's own (named_parameters, named_modules, state_dict give the bare names;
        # register_buffer on either registers on both); attribute reads it cannot answer, and
        # writes to names that are not its own, go to the module (__getattr__, __setattr__);
        # ``training`` is the module's.
        compat.share_structure(self, module)
        del d["training"]
        d["module"] = module
        d["_option_values"] = options
        d["_options"] = Options.resolve(**options)
        if self._options.log_level is not None:
            # NOTE: verbosity is one setting for the process; the option stays as a way to set it.
            set_verbosity(self._options.log_level)
            warnings.warn(
                "ORTWrap(..., log_level=...) sets ortwrap's verbosity for the whole process, for every wrapper "
                "until changed; call ortwrap.set_verbosity(level) (or set ORTWRAP_LOG_LEVEL) instead",
                FutureWarning,
                stacklevel=2,
            )
        d["_programs"] = {}
        # NOTE: another engine than the training build's takes every call (the one dispatch point,
        # in forward); it keeps its own compiled graphs (ortwrap/engines/).
        d["_engine"] = make_engine(self._options.resolved_engine, self._options)
        # NOTE: fallback is per graph key (the ``key`` of ``forward``): the keys whose build (or
        # first run) failed on an input PyTorch accepts, each with its error's text (not the error:
        # its traceback holds the frames of that call, its tensors included). Their calls run in
        # PyTorch; every other key keeps building and running on ONNX Runtime.
        d["_failed"] = {}
        d["_split"] = {}  # graph key -> its SplitCapture (export/split_capture.py): a data-dependent capture
        # NOTE: calls whose build failed and which eager PyTorch rejects too (a batch of a bad shape):
        # by graph key, the leaves' shapes of each such call (at most _BAD_SHAPES a key). The same
        # signature again runs in PyTorch straight away (eager's exception, no new export); if it
        # passes there, it is forgotten and the next such call builds.
        d["_bad_shapes"] = {}
        d["_fallback_calls"] = 0  # calls run in PyTorch for a failed key (integrations compare it around a call)
        d["_export_count"] = 0
        d["_last_artifacts"] = None
        d["_fallback_reason"] = None
        d["_empty_logged"] = False
        d["_in_method"] = False  # a method of the module is running (see _routed_method)
        d["_method_warned"] = False
        d["_arg_names"] = _positional_names(module)
        # NOTE: int arguments that change between calls (``_promote_ints``): by the input spec
        # without its int values, the values of the last build, the int positions fed as graph
        # inputs, the positions that failed alone, and the promotions tried.
        d["_ints_seen"] = {}
        d["_ints_fed"] = {}
        d["_ints_refused"] = {}
        d["_ints_tries"] = {}
        # NOTE: the parameter list is cached for the per-step requires_grad check; it is refreshed
        # whenever the module's parameters may have been replaced (load_state_dict, _apply, builds).
        d["_params"] = list(module.parameters())

    # ------------------------------------------------------------------ the wrapped module's face
    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the module's parameters, buffers and submodules
        # (shared tables), then anything the module has. Its methods run with ``self`` = the module,
        # their calls of ``self(...)``/``self.forward(...)`` routed through this wrapper.
        d = self.__dict__
        value = compat.structure_member(self, name)
        if value is not compat.MISSING:
            return value
        module = d.get("module")
        if module is None:
            raise AttributeError(f"'ORTWrap' object has no attribute '{name}'")
        value = getattr(module, name)
        if type(value) is types.MethodType and value.__self__ is module:
            return _routed_method(self, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        module = d.get("module")
        if module is None or name in d or name in _OWN_ATTRIBUTES or integrations.wrapper_attribute(name):
            nn.Module.__setattr__(self, name, value)
            return
        setattr(module, name, value)
        self._module_changed()

    def __delattr__(self, name: str) -> None:
        d = self.__dict__
        module = d.get("module")
        if module is None or name in d or name in _OWN_ATTRIBUTES:
            nn.Module.__delattr__(self, name)
            return
        delattr(module, name)
        self._module_changed()

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(type(self))) | set(dir(self.module)))

    def __repr__(self) -> str:
        return f"ORTWrap({self.module!r})"

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # Copies and pickles hold the module, the options and the wrapper's own hooks; compiled
        # programs (ONNX Runtime sessions) are rebuilt lazily, from the build cache where enabled,
        # and the keys that fell back are tried again (a new wrapper: fallback_reason is None).
        hooks = {k: self.__dict__[k] for k in _HOOK_STATE if k in self.__dict__}
        return (_rebuild, (self.module, self._option_values, hooks))

    def _module_changed(self) -> None:
        """The module was changed through the wrapper (an attribute, buffer, parameter or submodule
        set): compiled programs may read what changed, so they are rebuilt on the next call; the
        keys that fell back are tried again too (what changed may be what failed)."""
        self._programs.clear()
        self._failed.clear()
        self._split.clear()
        self._bad_shapes.clear()
        if self._engine is not None:
            self._engine.clear()
        self.__dict__["_params"] = list(self.module.parameters())

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        super().register_buffer(name, tensor, persistent)
        self._module_changed()

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        super().register_parameter(name, param)
        if "module" in self.__dict__:
            self._module_changed()

    def add_module(self, name: str, module: nn.Module | None) -> None:
        super().add_module(name, module)
        self._module_changed()

    register_module = add_module

    def train(self, mode: bool = True) -> ORTWrap:
        self.module.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> ORTWrap:
        compat.apply_to_tensors(self.module, fn, recurse)
        self.__dict__["_params"] = list(self.module.parameters())
        return self

    # ------------------------------------------------------------------ public state
    @property
    def options(self) -> Options:
        """The resolved :class:`Options`."""
        return self._options

    @property
    def export_count(self) -> int:
        """How many times the module has been exported (one per new input schema or mode; a build the
        build cache serves captures the forward but translates nothing, and counts 0)."""
        return self._export_count

    @property
    def last_artifacts(self) -> BuildArtifacts | None:
        """The artifacts of the most recent build (ONNX models, pass records, stage times)."""
        return self._last_artifacts

    @property
    def split_capture(self) -> split_capture.SplitCapture | None:
        """The most recent split capture (a module whose capture stops on a data-dependent guard runs
        as graph fragments on ONNX Runtime: export/split_capture.py), or None."""
        return next(reversed(self._split.values()), None)

    @property
    def fallback_reason(self) -> ORTWrapError | None:
        """The error of this wrapper's most recent fallback to PyTorch, or ``None`` if no call has
        fallen back. Fallback is per input signature (the graph key: mode, gradients, input
        structure, dtypes, ranks, devices, autocast): calls of other signatures, training calls
        after an inference call fell back say, still run on ONNX Runtime."""
        return self._fallback_reason

    # ------------------------------------------------------------------ state dict without prefix
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        self.__dict__["_params"] = list(self.module.parameters())
        return result

    # ------------------------------------------------------------------ forward
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # NOTE: per-step cost. nn.Module.__call__ goes through _wrapped_call_impl and _call_impl
        # (~2 us) to reach forward when no hook, compiled call or tracer is active; those are
        # checked the same way (compat.call_skips_hooks), and anything else takes nn.Module's path.
        if _compiling():
            # NOTE: under torch.compile (of this wrapper or of a parent), dynamo must not trace into
            # ORTWrap's own code: the call runs outside the compiled graph (a graph break).
            return _outside_compiled_graph()(self, *args, **kwargs)
        if _call_skips_hooks(self):
            if "forward" in self.__dict__:  # replaced on the instance (accelerate's autocast wrapper)
                return self.forward(*args, **kwargs)
            return _forward(self, *args, **kwargs)
        return nn.Module.__call__(self, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._engine is not None:
            return self._engine(self, args, kwargs)
        integration = _step_integration(self)
        if integration is not None:  # an integration takes the call over (partitioned parameters gathered around it)
            if self._failed and self._falls_back(args, kwargs):
                # NOTE: a signature that fell back runs in PyTorch before the integration gathers
                # anything: the module's own hooks (the integration's) manage its parameters.
                self.__dict__["_fallback_calls"] += 1
                return self.module(*args, **kwargs)
            return integration.step(self, self.forward, args, kwargs)
        try:
            key, leaves, in_spec = self._signature(args, kwargs)
        except UnsupportedInputError as e:
            if not self._in_method:
                raise
            # A method of the module (generate with a KV cache object, say) calls self(...) with
            # inputs ORTWrap cannot feed: that call runs in PyTorch, said once.
            if not self._method_warned:
                self.__dict__["_method_warned"] = True
                warn_at_user_line(
                    f"ORTWrap runs calls of {type(self.module).__name__} that a method of the module makes "
                    f"with inputs ONNX Runtime cannot take in PyTorch: {e}",
                    FallbackWarning,
                )
            return self.module(*args, **kwargs)
        needs_grad = key[1]
        try:
            programs = self._programs.get(key)
        except TypeError as e:  # an unhashable constant somewhere in the inputs
            raise UnsupportedInputError(f"forward() inputs hold a constant that cannot be hashed: {e}") from e
        program = programs.find(leaves) if programs is not None else None
        if program is None:
            if self._split and key in self._split:
                return self._split[key](*args, **kwargs)
            if programs is None and self._failed and key in self._failed:
                self.__dict__["_fallback_calls"] += 1  # this signature fell back (said once, when it did)
                return self.module(*args, **kwargs)
            if self._bad_shapes and key in self._bad_shapes:
                shapes = tuple(t.shape for t in leaves)
                if shapes in self._bad_shapes[key]:
                    out = self.module(*args, **kwargs)  # eager's exception, as on the first such call
                    self._bad_shapes[key].discard(shapes)  # (eager took it this time: build the next one)
                    return out
            if in_spec is None:
                in_spec = self._flatten_inputs(args, kwargs, [])
            if any(t.numel() == 0 for t in leaves):
                # NOTE: an empty batch runs in PyTorch (ORT kernels reject zero-size inputs); it
                # gets eager's loss (0 or nan), gradients or exception, and builds nothing.
                if not self._empty_logged:
                    self.__dict__["_empty_logged"] = True
                    logger.info(
                        "an input with a zero-size dimension runs in PyTorch (ORT kernels reject empty tensors)"
                    )
                return self.module(*args, **kwargs)
            promoted = self._promote_ints(key, leaves, in_spec, needs_grad, args, kwargs)
            if promoted is not None:
                program, leaves, key = promoted
            else:
                try:
                    program = self._build(key, leaves, in_spec, needs_grad, programs, args, kwargs)
                except _GuardMiss as miss:
                    return self._run_eagerly_once(miss.error, args, kwargs)
                if program is None:  # this key fell back, or is split where its capture stops on data
                    return self._split[key](*args, **kwargs) if key in self._split else self.module(*args, **kwargs)
            if self._options.verify and promoted is None:
                try:
                    verify_program(self.module, program, args, kwargs, leaves, _run_program)
                except VerificationError:
                    self._evict(key, program)
                    raise
        if program.n_pythonops:
            bridge_state.collect_abandoned()  # a safe point: no ORT run is in progress
            bridge_state.maybe_purge()
        try:
            outputs = _run_program(program, leaves)
        except UnsupportedFunctionError as e:
            # Found only when the Function first runs: treated like a build failure.
            self._raise_if_eager_raises(args, kwargs)
            if not self._options.fallback:
                raise
            self._fall_back(e, key, in_spec, args, kwargs)
            return self.module(*args, **kwargs)
        except Exception as e:
            # NOTE: a bad input (wrong feature size, a user's shape assert traced away) reaches ORT
            # as a broadcast or shape error: the user gets eager's own exception, on every call,
            # and the program stays for the next good batch.
            self._raise_if_eager_raises(args, kwargs)
            error = RuntimeRunError(
                f"ONNX Runtime failed to run the {program} on an input PyTorch accepts: {sentence(str(e))} "
                "Report it with ORTWrap(..., debug_dir=...)'s artifacts"
            )
            if program.runs == 0 and self._options.fallback:
                # A program that never ran, on an input eager accepts: the build is what failed (an
                # ATen node ORT cannot feed, a kernel ORT lacks at run time), not the batch.
                error.__cause__ = e
                self._fall_back(error, key, in_spec, args, kwargs)
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

    def _signature(self, args: tuple, kwargs: dict) -> tuple[tuple, list[torch.Tensor], tuple | None]:
        """The call's graph key (mode, gradients, input structure, each tensor's rank, dtype, device
        and requires_grad, the parameters' requires_grad, autocast), its tensor leaves, and its
        tree spec (``None`` on the fast path: only plain positional tensors). Raises
        ``UnsupportedInputError`` for an input ORTWrap cannot feed."""
        params_rg = tuple(map(_requires_grad, self._params))
        grad_on = _grad_enabled()
        in_spec: tuple | None = None
        if not kwargs and ((len(args) == 1 and type(args[0]) is _Tensor) or all(type(a) is _Tensor for a in args)):
            # Fast path: only plain positional tensors. Its key is the argument count; the tree
            # spec is built only if a build is needed.
            leaves = list(args)
            structure: Any = len(args)
        else:
            leaves = []
            in_spec = structure = self._flatten_inputs(args, kwargs, leaves)
            if self._ints_fed and _tree.int_constants(in_spec):
                fed = self._ints_fed.get(_tree.rewrite_ints(in_spec, list(leaves), lambda i, v: None))
                if fed is not None:
                    in_spec = structure = _tree.rewrite_ints(
                        in_spec, leaves, lambda i, v: _tree.INT if i in fed else v, self._int_device(leaves)
                    )
        needs_grad = grad_on and (True in params_rg or any(t.requires_grad for t in leaves))
        key = (
            self.module.training,
            needs_grad,
            structure,
            tuple([(t.dim(), t.dtype, t.device, t.requires_grad) for t in leaves]),
            params_rg if needs_grad else (),
            autocast_state() if (_any_autocast or _bind_autocast_check())() else None,  # its own graph
        )
        return key, leaves, in_spec

    def _falls_back(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call's signature fell back (asked before an integration takes a call over)."""
        try:
            return self._signature(args, kwargs)[0] in self._failed
        except (UnsupportedInputError, TypeError):  # (the call itself says so, on its own path)
            return False

    def _promote_ints(
        self, key: tuple, leaves: list[torch.Tensor], in_spec: tuple, needs_grad: bool, args: tuple, kwargs: dict
    ) -> tuple[Program, list[torch.Tensor], tuple] | None:
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
        previous = self._ints_seen.get(stripped)
        self._ints_seen[stripped] = values
        if previous is None or stripped in self._ints_fed or self._ints_tries.get(stripped, 0) >= _INT_TRIES:
            return None
        refused = self._ints_refused.get(stripped, frozenset())
        changed = frozenset(i for i, (a, b) in enumerate(zip(previous, values)) if a != b and i not in refused)
        if not changed:
            return None
        self._ints_tries[stripped] = self._ints_tries.get(stripped, 0) + 1
        fed_leaves = list(leaves)
        device = self._int_device(leaves)
        spec = _tree.rewrite_ints(in_spec, fed_leaves, lambda i, v: _tree.INT if i in changed else v, device)
        fed_key = (key[0], key[1], spec, tuple([(t.dim(), t.dtype, t.device, t.requires_grad) for t in fed_leaves]),
                   *key[4:])  # fmt: skip
        program = None
        try:
            program = self._build(fed_key, fed_leaves, spec, needs_grad, None, args, kwargs, may_fall_back=False)
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
                self._ints_refused[stripped] = refused | changed
            self._programs.pop(fed_key, None)  # the set this build made: no later call may run it
            logger.info(
                "int arguments of %s that change between calls stay graph constants (one export per value): %s",
                type(self.module).__name__,
                str(e).split(". ")[0][:300],
            )
            return None
        self._ints_fed[stripped] = changed
        logger.info("int arguments of %s that change between calls are graph inputs", type(self.module).__name__)
        return program, fed_leaves, fed_key

    def _int_device(self, leaves: list[torch.Tensor]) -> torch.device:
        """Where ints fed as graph inputs go: with the call's tensors (or the parameters)."""
        if leaves:
            return leaves[0].device
        return self._params[0].device if self._params else torch.device("cpu")

    def _fall_back(self, error: ORTWrapError, key: tuple, in_spec: tuple | None, args: tuple, kwargs: dict) -> None:
        """Run the calls of graph key ``key`` in PyTorch from now on, saying why once; other keys
        keep building and running on ONNX Runtime. ``in_spec``: the call's tree spec, or None (the
        fast path's: made from ``args`` and ``kwargs`` for the warning)."""
        if in_spec is None:
            in_spec = self._flatten_inputs(args, kwargs, [])
        self._programs.pop(key, None)
        self._failed[key] = f"the {error.phase} phase failed: {error.detail}"
        self._fallback_reason = error
        self.__dict__["_fallback_calls"] += 1
        calls = self._describe_calls(key, in_spec)
        warn_at_user_line(
            f"ORTWrap falls back to PyTorch for {calls} of {type(self.module).__name__}: the {error.phase} phase "
            f"failed: {sentence(error.detail)} Calls with other inputs or modes still run on ONNX Runtime. "
            "Set ORTWrap(..., fallback=False) or ORTWRAP_FALLBACK=0 to raise instead.",
            FallbackWarning,
        )
        logger.info("falling back to PyTorch for %s: %s", calls, error.detail)  # (the FallbackWarning says it)

    def _fall_back_call(self, error: ORTWrapError, args: tuple, kwargs: dict) -> Any:
        """Fall back for this call's signature (an integration found it cannot take the call over)
        and run the call in PyTorch."""
        key, _, in_spec = self._signature(args, kwargs)
        self._fall_back(error, key, in_spec, args, kwargs)
        return self.module(*args, **kwargs)

    def _describe_calls(self, key: tuple, in_spec: tuple) -> str:
        """The calls of graph key ``key`` in short: mode, gradients, each input tensor's path,
        dtype, rank and device, autocast."""
        mode = "training-mode" if key[0] else "eval-mode"
        grads = "with gradients" if key[1] else "without gradients (inference)"
        paths = _leaf_paths(in_spec, self._arg_names)
        shapes = key[3]
        paths += [f"input{i}" for i in range(len(paths), len(shapes))]  # (a promotion's key: its ints)
        inputs = ", ".join(
            f"{path}: {str(dtype).removeprefix('torch.')} {dim}-d on {device}"
            for path, (dim, dtype, device, _) in zip(paths, shapes)
        )
        text = f"{mode} calls {grads} on inputs ({inputs or 'none'})"
        if key[5] is not None and key[5][0]:
            text += " under autocast " + ", ".join(f"{d}:{str(t).removeprefix('torch.')}" for d, t in key[5][0])
        return text

    def _evict(self, key: tuple, program: Program) -> None:
        """Forget ``program`` (it failed verification), so that no later call runs it."""
        programs = self._programs.get(key)
        if programs is not None:
            programs.remove(program)
            if not programs:
                del self._programs[key]

    def programs(self) -> list[Program]:
        """Every compiled program of this wrapper (one per input schema and, where dimensions are
        static or guarded, per shape)."""
        return [p for programs in self._programs.values() for p in programs]

    def _run_eagerly_once(self, error: ORTWrapError, args: tuple, kwargs: dict) -> Any:
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

    def _flatten_inputs(self, args: tuple, kwargs: dict, leaves: list[torch.Tensor]) -> tuple:
        """Append the tensors of ``(args, kwargs)`` to ``leaves``; return their tree spec."""
        names = self._arg_names
        arg_specs = tuple(
            _tree.flatten(a, names[i] if i < len(names) else f"args[{i}]", leaves, _unsupported_input)
            for i, a in enumerate(args)
        )
        kw_keys = tuple(kwargs)
        kw_specs = tuple(_tree.flatten(kwargs[k], k, leaves, _unsupported_input) for k in kw_keys)
        return ("S", tuple, (("S", tuple, arg_specs), ("M", dict, kw_keys, kw_specs)))

    def _raise_if_eager_raises(self, args: tuple, kwargs: dict) -> None:
        """Run the module eagerly on the input that failed; raise its exception if it raises.

        The run is discarded: no autograd graph, and buffers and RNG states are restored."""
        error = _eager_error(self.module, args, kwargs)
        if error is not None:
            raise error.with_traceback(error.__traceback__) from None

    def _build(
        self,
        key: tuple,
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
        self._params = list(self.module.parameters())
        paths = _leaf_paths(in_spec, self._arg_names)
        try:
            with integrations.export_context(self):  # (an integration's module hooks hidden from the trace)
                program, artifacts = compile_program(
                    self.module,
                    leaves,
                    in_spec,
                    paths,
                    training=self.module.training,
                    with_backward=needs_grad,
                    device=device,
                    options=self._options,
                    build_index=self._export_count + 1,
                    autocast=key[5],
                )
        except FALLBACK_PHASES as e:
            self._export_count += 1 if isinstance(e, ExportError) else 2
            # NOTE: an input the module rejects (a wrong dtype or rank, a user's assert) fails the
            # build too: eager's exception is raised, and nothing is cached or switched off; the
            # signature is remembered, so that the same bad batch does not export again.
            error = _eager_error(self.module, args, kwargs or {})
            if error is not None:
                bad = self._bad_shapes.setdefault(key, set())
                if len(bad) < _BAD_SHAPES:
                    bad.add(tuple(t.shape for t in leaves))
                raise error.with_traceback(error.__traceback__) from None
            if programs is not None and programs.guarded and isinstance(e, ExportError):
                raise _GuardMiss(e) from e
            if may_fall_back and self._options.exporter in ("auto", "dynamo") and split_capture.is_data_dependent(e):
                self._split[key] = split_capture.SplitCapture(self.module, self._option_values, self._options, e)
                return None
            if not self._options.fallback or not may_fall_back:
                raise
            self._fall_back(e, key, in_spec, args, kwargs)
            return None
        self._export_count += artifacts.exports
        if programs is None:
            programs = self._programs[key] = ProgramSet()
        programs.add(program, leaves)
        self._last_artifacts = artifacts
        if self._options.debug_dir:
            paths_saved = artifacts.save(self._options.debug_dir, self._export_count)
            logger.info("saved build artifacts: %s", ", ".join(paths_saved))
        return program


_requires_grad = operator.attrgetter("requires_grad")
_step_integration = integrations.step_integration
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


_call_skips_hooks = compat.call_skips_hooks
_compiling = torch.compiler.is_compiling


_disabled_call: Any = None


def _outside_compiled_graph() -> Any:
    """``nn.Module.__call__`` excluded from torch.compile (created on first use under compile)."""
    global _disabled_call
    if _disabled_call is None:
        _disabled_call = torch.compiler.disable(nn.Module.__call__, recursive=True)
    return _disabled_call


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
#: Bad-batch shapes remembered per graph key (``ORTWrap._bad_shapes``).
_BAD_SHAPES = 16


class _NotPromoted(Exception):
    """Internal: int arguments cannot be graph inputs of this build (``ORTWrap._promote_ints``)."""


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


_forward = ORTWrap.forward
#: Attributes that always stay on the wrapper (set on it, not on the module): an instance-level
#: ``forward`` (accelerate's autocast wrapper replaces it, keeping the original).
_OWN_ATTRIBUTES = frozenset({"forward", "_original_forward"})
_HOOK_STATE = (*compat.MODULE_HOOK_TABLES, *compat.MODULE_HOOK_SIDE_TABLES)
_SUBCLASSES: dict[tuple[type, type], type] = {}


def _specialized(base: type, wrapped: type) -> type:
    """``base``'s subclass for modules of class ``wrapped``: named after it, with its forward's
    signature, and ``__class__`` answering ``wrapped`` (``isinstance(wrapper, PreTrainedModel)``
    holds, as Trainer needs to save checkpoints the model's way); ``type()`` is still an ORTWrap."""
    sub = _SUBCLASSES.get((base, wrapped))
    if sub is not None:
        return sub
    base_forward = base.forward

    def forward(self: ORTWrap, *args: Any, **kwargs: Any) -> Any:
        return base_forward(self, *args, **kwargs)

    try:
        forward.__signature__ = inspect.signature(wrapped.forward)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass
    forward.__doc__ = wrapped.forward.__doc__
    forward.__qualname__ = f"{wrapped.__qualname__}.forward"
    namespace = {
        "__module__": base.__module__,
        "__qualname__": f"{base.__qualname__}[{wrapped.__qualname__}]",
        "__doc__": wrapped.__doc__,
        "_ortwrap_wrapped": wrapped,
        "__class__": property(lambda self: wrapped),
        "forward": forward,
    }
    sub = _SUBCLASSES[(base, wrapped)] = type(wrapped.__name__, (base,), namespace)
    return sub


def _rebuild(module: nn.Module, options: dict, hooks: dict) -> ORTWrap:
    """Unpickle or copy an ORTWrap: a new wrapper of the (copied) module, with the wrapper's hooks."""
    # (log_level set the process's verbosity when the original was made: a copy does not set it again)
    wrapper = ORTWrap(module, **{k: v for k, v in options.items() if k != "log_level"})
    wrapper.__dict__.update(hooks)
    return wrapper


def _routed_method(wrapper: ORTWrap, method: types.MethodType) -> Any:
    """``method`` of the wrapped module, bound to it; while it runs, the module's ``self(...)`` and
    ``self.forward(...)`` go through ``wrapper`` (and so run on ONNX Runtime)."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        module = method.__self__
        if "forward" in module.__dict__:  # already routed (a method calling another), or the user's own
            return method(*args, **kwargs)

        def routed_forward(*a: Any, **k: Any) -> Any:
            # NOTE: lifted while the wrapper runs, so that export and eager runs see the real forward.
            del module.__dict__["forward"]
            wrapper.__dict__["_in_method"] = True
            try:
                return wrapper(*a, **k)
            finally:
                wrapper.__dict__["_in_method"] = False
                module.__dict__["forward"] = routed_forward

        module.__dict__["forward"] = routed_forward
        try:
            return method(*args, **kwargs)
        finally:
            module.__dict__.pop("forward", None)

    return call
