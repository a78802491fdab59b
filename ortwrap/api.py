"""``ORTWrap``: an ``nn.Module`` that runs the module it wraps on ONNX Runtime's training engine.

This file is the wrapper's face: it presents the wrapped module (attribute routing, the subclass
named after the module's class, pickling and copies, ``state_dict``) and hands each call to its
engine, to an integration that takes the call over, or to its :class:`~ortwrap.dispatch.Dispatcher`
(``dispatch.py``: the per-schema programs, fallback, int promotion, eager re-runs), which builds
programs with ``build/`` and runs them with ``runtime/``. The schema is the structure of the inputs,
their non-tensor values, and for each tensor its rank, dtype, device and ``requires_grad``, plus the
train/eval mode and whether a backward is needed. Shapes are not part of it: every dimension is
dynamic.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from typing import Any

import torch
from torch import nn

from . import integrations
from ._compat import torch as compat
from ._logging import set_verbosity
from .build import BuildArtifacts
from .dispatch import Dispatcher
from .engines import make_engine
from .engines import resolve as resolve_engine
from .errors import FallbackWarning, ORTWrapError
from .options import Options
from .runtime.program import Program
from .split_capture import SplitCapture

__all__ = ["FallbackWarning", "ORTWrap"]


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
        # NOTE: another engine than the training build's takes every call (the one dispatch point,
        # in forward); it keeps its own compiled graphs (ortwrap/engines/).
        d["_engine"] = make_engine(resolve_engine(self._options.engine), self._options)
        #: the training engine's calls: programs by graph key, fallback, int promotion (dispatch.py)
        d["_dispatch"] = Dispatcher(self, module, self._options, options, ORTWrap)

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
        self._dispatch.forget()
        if self._engine is not None:
            self._engine.clear()

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
        self._dispatch.refresh_params()
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
        return self._dispatch.export_count

    @property
    def last_artifacts(self) -> BuildArtifacts | None:
        """The artifacts of the most recent build (ONNX models, pass records, stage times)."""
        return self._dispatch.last_artifacts

    @property
    def split_capture(self) -> SplitCapture | None:
        """The most recent split capture (a module whose capture stops on a data-dependent guard runs
        as graph fragments on ONNX Runtime: split_capture.py), or None."""
        if self._engine is not None:
            return getattr(self._engine, "split_capture", None)
        return next(reversed(self._dispatch.split.values()), None)

    @property
    def fallback_reason(self) -> ORTWrapError | None:
        """The error of this wrapper's most recent fallback to PyTorch, or ``None`` if no call has
        fallen back. Fallback is per input signature (the graph key: mode, gradients, input
        structure, dtypes, ranks, devices, autocast): calls of other signatures, training calls
        after an inference call fell back say, still run on ONNX Runtime."""
        return self._dispatch.fallback_reason

    # ------------------------------------------------------------------ state dict without prefix
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        self._dispatch.refresh_params()
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
            return self._dispatch.integration_step(integration, self, args, kwargs)
        return self._dispatch(args, kwargs)

    def programs(self) -> list[Program]:
        """Every compiled program of this wrapper (one per input schema and, where dimensions are
        static or guarded, per shape)."""
        return self._dispatch.all_programs()


_step_integration = integrations.step_integration
_call_skips_hooks = compat.call_skips_hooks
_compiling = torch.compiler.is_compiling


_disabled_call: Any = None


def _outside_compiled_graph() -> Any:
    """``nn.Module.__call__`` excluded from torch.compile (created on first use under compile)."""
    global _disabled_call
    if _disabled_call is None:
        _disabled_call = torch.compiler.disable(nn.Module.__call__, recursive=True)
    return _disabled_call


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
            dispatch = wrapper._dispatch
            dispatch.in_method = True
            try:
                return wrapper(*a, **k)
            finally:
                dispatch.in_method = False
                module.__dict__["forward"] = routed_forward

        module.__dict__["forward"] = routed_forward
        try:
            return method(*args, **kwargs)
        finally:
            module.__dict__.pop("forward", None)

    return call
