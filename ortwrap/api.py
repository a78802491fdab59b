"""``ORTWrap``: an ``nn.Module`` that runs the module it wraps on ONNX Runtime's training engine.

It keeps the wrapped module (``.module``) and, per input schema, a compiled :class:`Program`. The
schema is the structure of the inputs, their non-tensor values, and for each tensor its rank,
dtype, device and ``requires_grad``, plus the train/eval mode and whether a backward is needed.
Shapes are not part of it: every dimension is dynamic.
"""

from __future__ import annotations

import inspect
import operator
import warnings
from typing import Any

import torch
from torch import nn

from . import _tree, integrations
from ._compat import torch as compat
from ._logging import configure, logger
from .bridge import state as bridge_state
from .errors import (
    FALLBACK_PHASES,
    ExportError,
    ORTWrapError,
    UnsupportedFunctionError,
    UnsupportedInputError,
    VerificationError,
)
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

    def __init__(self, module: nn.Module, /, **options: Any) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"ORTWrap(module): expected a torch.nn.Module, got {type(module).__qualname__}")
        if isinstance(module, ORTWrap):
            raise TypeError("ORTWrap(module): module is already an ORTWrap")
        integrations.check_wrappable(module)
        super().__init__()
        self.module = module
        # The submodule table itself (not a copy), as a plain attribute: read on every step.
        object.__setattr__(self, "_submodules", compat.submodule_table(self))
        self._options = Options.resolve(**options)
        configure(self._options.logging_level)
        self._programs: dict[tuple, ProgramSet] = {}
        self._export_count = 0
        self._last_artifacts: BuildArtifacts | None = None
        self._fallback_reason: ORTWrapError | None = None
        self._arg_names = _positional_names(module)
        # NOTE: the parameter list is cached for the per-step requires_grad check; it is refreshed
        # whenever the module's parameters may have been replaced (load_state_dict, _apply, builds).
        self._params: list[nn.Parameter] = list(module.parameters())
        self.register_load_state_dict_pre_hook(_add_module_prefix)

    # ------------------------------------------------------------------ public state
    @property
    def options(self) -> Options:
        """The resolved :class:`Options`."""
        return self._options

    @property
    def export_count(self) -> int:
        """How many times the module has been exported (one per new input schema or mode)."""
        return self._export_count

    @property
    def last_artifacts(self) -> BuildArtifacts | None:
        """The artifacts of the most recent build (ONNX models, pass records, stage times)."""
        return self._last_artifacts

    @property
    def fallback_reason(self) -> ORTWrapError | None:
        """The error that made ORTWrap fall back to PyTorch, or ``None``."""
        return self._fallback_reason

    # ------------------------------------------------------------------ state dict without prefix
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        self._params = list(self.module.parameters())
        return result

    # ------------------------------------------------------------------ forward
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # NOTE: per-step cost. nn.Module.__call__ goes through _wrapped_call_impl and _call_impl
        # (~2 us) to reach forward when no hook, compiled call or tracer is active; those are
        # checked the same way (compat.call_skips_hooks), and anything else takes nn.Module's path.
        if _call_skips_hooks(self):
            return self.forward(*args, **kwargs)
        return nn.Module.__call__(self, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._fallback_reason is not None:
            return self.module(*args, **kwargs)
        integration = _step_integration(self)
        if integration is not None:  # an integration takes the call over (partitioned parameters gathered around it)
            return integration.step(self, self.forward, args, kwargs)
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
            in_spec = self._flatten_inputs(args, kwargs, leaves)
            structure = in_spec
        needs_grad = grad_on and (True in params_rg or any(t.requires_grad for t in leaves))
        key = (
            self._submodules["module"].training,  # not self.module: nn.Module.__getattr__ costs ~1.5 us
            needs_grad,
            structure,
            tuple([(t.dim(), t.dtype, t.device, t.requires_grad) for t in leaves]),
            params_rg if needs_grad else (),
            autocast_state() if (_any_autocast or _bind_autocast_check())() else None,  # its own graph
        )
        try:
            programs = self._programs.get(key)
        except TypeError as e:  # an unhashable constant somewhere in the inputs
            raise UnsupportedInputError(f"forward() inputs hold a constant that cannot be hashed: {e}") from e
        program = programs.find(leaves) if programs is not None else None
        if program is None:
            if in_spec is None:
                in_spec = self._flatten_inputs(args, kwargs, [])
            try:
                program = self._build(key, leaves, in_spec, needs_grad, programs)
            except _GuardMiss as miss:
                return self._run_eagerly_once(miss.error, args, kwargs)
            if program is None:
                return self.module(*args, **kwargs)
            if self._options.verify:
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
            if not self._options.fallback:
                raise
            self._fall_back(e)
            return self.module(*args, **kwargs)
        n = program.n_outputs
        if program.buffer_outputs:
            with torch.no_grad():
                for buf, value in zip(program.buffer_outputs, outputs[n : n + len(program.buffer_outputs)]):
                    buf.copy_(value)
        spec = program.out_spec
        if spec is _tree.TENSOR:
            return outputs[0]
        return _tree.unflatten(spec, outputs[:n])

    def _fall_back(self, error: ORTWrapError) -> None:
        """Run the module in PyTorch from now on, saying why once."""
        self._fallback_reason = error
        self._programs.clear()
        warnings.warn(
            f"ORTWrap falls back to PyTorch for {type(self.module).__name__}: the {error.phase} phase failed: {error}. "
            "Set ORTWrap(..., fallback=False) or ORTWRAP_FALLBACK=0 to raise instead.",
            FallbackWarning,
            stacklevel=5,
        )
        logger.warning("falling back to PyTorch: %s", error)

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
        warnings.warn(
            f"ORTWrap ran one call of {type(self.module).__name__} in PyTorch: its input shapes break the dynamo "
            f"capture's assumptions and a new export failed: {error}",
            FallbackWarning,
            stacklevel=3,
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

    def _build(
        self, key: tuple, leaves: list[torch.Tensor], in_spec: tuple, needs_grad: bool, programs: ProgramSet | None
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
            if programs is not None and programs.guarded and isinstance(e, ExportError):
                raise _GuardMiss(e) from e
            if not self._options.fallback:
                raise
            self._fall_back(e)
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
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor


def _run_program(program: Program, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``program`` on ``leaves``: its flat outputs (user outputs, then buffer outputs, which the
    caller copies back). Used by every call and by verification."""
    feeds, values = program.bind(leaves)
    if program.with_backward:
        return run_training_graph(program, values, *feeds)
    outputs = program.runner.forward(values)
    if program.n_pythonops:
        bridge_state.entries_left(program.n_pythonops)  # inference contexts stay in ORT's map
    return outputs


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
        if kind == "T":
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


def _add_module_prefix(module: ORTWrap, state_dict: dict, prefix: str, *args: Any) -> None:
    """A parent's ``load_state_dict`` reaches the wrapped module through ``.module``: accept the
    unprefixed keys that ``ORTWrap.state_dict`` produces."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
