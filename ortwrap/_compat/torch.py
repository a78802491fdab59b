"""Every private PyTorch API ortwrap uses, the releases each was checked on, and the version flags.

ORTModule died because it reached into torch internals that moved. ortwrap reaches into some too
(the C entry points that keep a training step cheap, the TorchScript exporter's symbolic registry,
``nn.Module``'s hook and parameter tables), but only here:

- each private name is declared once in :data:`PRIVATE_APIS` with the torch releases whose full
  test suite ran against it;
- nothing private is touched when ``ortwrap`` is imported: every accessor resolves its name on
  first use (and caches it);
- a name missing from the running torch raises :class:`~ortwrap.errors.UnsupportedTorchError`, which
  names it, the releases it was checked on and the supported range, or, where a public equivalent
  exists, the accessor uses that instead (slower, same result);
- ``tests/test_compat.py`` fails when any other module of the package uses a private torch name,
  and resolves every entry of :data:`PRIVATE_APIS` on the running torch.

Supported releases: :data:`SUPPORTED_RANGE`. ``import ortwrap`` on an older torch raises an
``ImportError`` that says so; on a newer one it warns once (:func:`check_torch_version`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "CHECKED_RELEASES",
    "PRIVATE_APIS",
    "SUPPORTED_RANGE",
    "TORCH_VERSION",
    "UnsupportedTorchWarning",
    "check_torch_version",
]

#: torch releases the whole test suite ran on: ``.ci/run`` runs 2.13.0 and 2.14.1 (both on this
#: machine's disk) on every change; 2.15.0 (from the package registry, above the machine's pip cap)
#: was checked by hand in a throwaway venv (docs/compat.md says how).
CHECKED_RELEASES: tuple[str, ...] = ("2.13.0", "2.14.1", "2.15.0")
#: The range pyproject declares: ``torch>=2.13,<2.16``.
MIN_VERSION = (2, 13)
MAX_VERSION_EXCLUSIVE = (2, 16)
SUPPORTED_RANGE = ">=2.13,<2.16"


def _parse(version: str) -> tuple[int, int, int]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        return (0, 0, 0)
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


#: (major, minor, patch) of the running torch, from the public ``torch.__version__``.
TORCH_VERSION: tuple[int, int, int] = _parse(torch.__version__)


#: torch.onnx.export(dynamo=False), the TorchScript exporter, warns that it is deprecated from 2.9 on
#: (and dynamo=True became torch.onnx.export's default then).
TORCHSCRIPT_EXPORT_DEPRECATED = TORCH_VERSION[:2] >= (2, 9)


def default_exporter() -> str:
    """ortwrap's default exporter on the running torch: ``"dynamo"`` where the TorchScript exporter
    is deprecated, ``"torchscript"`` before."""
    return "dynamo" if TORCHSCRIPT_EXPORT_DEPRECATED else "torchscript"


class UnsupportedTorchWarning(UserWarning):
    """The running torch is newer than the releases ortwrap was tested with."""


def check_torch_version(version: str | None = None) -> None:
    """Refuse a torch older than the supported range; warn once about a newer one.

    Called by ``ortwrap/__init__.py`` before anything else is imported. Uses only ``torch.__version__``.

    Raises:
        ImportError: the torch release predates the supported range.
    """
    text = torch.__version__ if version is None else version
    v = _parse(text)[:2]
    supported = f"torch{SUPPORTED_RANGE} (tested on {', '.join(CHECKED_RELEASES)})"
    if v < MIN_VERSION:
        raise ImportError(
            f"ortwrap supports {supported}; this environment has torch {text}. "
            f"Install a supported release first, pinned: pip install torch=={CHECKED_RELEASES[-1]}"
        )
    if v >= MAX_VERSION_EXCLUSIVE:
        warnings.warn(
            f"ortwrap was tested with {supported}; torch {text} is newer. Parts of ortwrap that use torch "
            "internals may fail with UnsupportedTorchError naming what is missing.",
            UnsupportedTorchWarning,
            stacklevel=3,
        )


# ------------------------------------------------------------------------------- the declarations

#: Every private torch name ortwrap uses -> the releases it was checked on. Attribute names of
#: torch classes are written ``Class.name``.
PRIVATE_APIS: dict[str, tuple[str, ...]] = {}


def _declare(name: str, checked: tuple[str, ...] = CHECKED_RELEASES) -> str:
    PRIVATE_APIS[name] = checked
    return name


def _missing(name: str, cause: BaseException | None = None) -> Exception:
    from ..errors import UnsupportedTorchError

    checked = ", ".join(PRIVATE_APIS.get(name, CHECKED_RELEASES))
    return UnsupportedTorchError(
        f"ortwrap needs torch's private {name} (checked on torch {checked}), which torch {torch.__version__} "
        f"does not have. ortwrap supports torch{SUPPORTED_RANGE}: install one of those releases, or report this "
        "with your torch version"
    )


def _resolve(name: str) -> Any:
    """Import the longest importable module prefix of dotted ``name`` and walk the rest as attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError as e:
            raise _missing(name, e) from e
        return obj
    raise _missing(name)


def _first(*names: str) -> Any:
    """The first of ``names`` that resolves (a private module that moved between releases)."""
    error: Exception | None = None
    for name in names:
        try:
            return _resolve(name)
        except Exception as e:
            error = e
    assert error is not None
    raise error


# Tensors and autograd ---------------------------------------------------------------------------
_FROM_DLPACK = _declare("torch._C._from_dlpack")
_SET_GRAD_ENABLED = _declare("torch._C._set_grad_enabled")
_FUNCTORCH_ACTIVE = _declare("torch._C._are_functorch_transforms_active")
_FUNCTION_BASE = _declare("torch._C._FunctionBase")
_TRACING_STATE = _declare("torch._C._get_tracing_state")
_EXECUTION_ENGINE = _declare("torch.autograd.Variable._execution_engine")
_ANY_AUTOCAST = _declare("torch._C._is_any_autocast_enabled")
#: PyTorch's CPU flash attention and its backward (what eager SDPA runs on CPU; ortwrap_ops::attention).
_FLASH_CPU = _declare("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu")
_FLASH_CPU_BACKWARD = _declare("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward")
#: torch's own checks of the CPU's bfloat16 instructions (what its oneDNN kernels dispatch on).
_CPU_BF16_CHECKS = (_declare("torch.cpu._is_avx512_bf16_supported"), _declare("torch.cpu._is_amx_tile_supported"))
_declare("Tensor._version")  # the in-place version counter autograd checks
# torch.distributed's private collectives, replaced by ortwrap's stubs while exporting --------------
_PRIVATE_COLLECTIVES = tuple(
    _declare(f"torch.distributed.{n}") for n in ("_all_gather_base", "_reduce_scatter_base", "_broadcast_coalesced")
)
# nn.Module internals ----------------------------------------------------------------------------
_MODULE_GLOBAL_HOOKS = tuple(
    _declare(f"torch.nn.modules.module.{n}")
    for n in (
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
    )
)
#: nn.Module instance attributes ortwrap reads (Module.<name> in PRIVATE_APIS).
MODULE_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
MODULE_HOOK_SIDE_TABLES = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
_MODULE_ATTRS = (
    *MODULE_HOOK_TABLES,
    *MODULE_HOOK_SIDE_TABLES,
    "_compiled_call_impl",
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
)
for _name in _MODULE_ATTRS:
    _declare(f"Module.{_name}")
# The TorchScript exporter -----------------------------------------------------------------------
_TS = "torch.onnx._internal.torchscript_exporter"
_TS_REGISTRY = _declare(f"{_TS}.registration.registry")
_declare("_SymbolicFunctionGroup._functions")  # the registry's per-opset table of one op
_TS_HELPER = _declare(f"{_TS}.symbolic_helper")
_TS_TYPE_UTILS = _declare(f"{_TS}._type_utils.JitScalarType")
_TS_OVERLOAD_NAME = _declare(f"{_TS}.utils._get_aten_op_overload_name")
#: torch's symbolics per opset (``symbolic_opset9`` ... ``symbolic_opset20``), imported lazily by the exporter
_TS_OPSETS = {n: _declare(f"{_TS}.symbolic_opset{n}") for n in range(9, 21)}
_TS_ONNX_BLOCK = _declare("torch._C._jit_pass_onnx_block")
# The dynamo (torch.export-based) ONNX exporter -------------------------------------------------
_DYN = "torch.onnx._internal.exporter"
_DYN_REGISTRY = _declare(f"{_DYN}._registration.ONNXRegistry")
_DYN_TRANSLATE = _declare(f"{_DYN}._core._exported_program_to_onnx_program")
_DYN_DTYPES = _declare(f"{_DYN}._core._TORCH_DTYPE_TO_ONNX")
_DYN_PREPARE = _declare(f"{_DYN}._core._prepare_exported_program_for_export")
_DYN_PROMOTE = _declare(f"{_DYN}._fx_passes.insert_type_promotion_nodes")  # what tests compare ortwrap's with
_DYN_NO_ASSERTS = _declare(f"{_DYN}._fx_passes.remove_assertion_nodes")
_DYN_FLAGS = _declare(f"{_DYN}._flags._is_onnx_exporting")
# ortwrap's lazy copy of ONNXRegistry.from_torchlib (it also sets the registry's _opset_version)
_DYN_REGISTER = _declare(f"{_DYN}._registration.ONNXRegistry._register")
_DYN_OPSET_CLEANUP = _declare(f"{_DYN}._registration.ONNXRegistry._cleanup_registry_based_on_opset_version")
_DYN_DECOMP_META = _declare(f"{_DYN}._registration.OnnxDecompMeta")
_DYN_GET_OVERLOAD = _declare(f"{_DYN}._registration._get_overload")
_DYN_OWN_TORCHLIB = _declare(f"{_DYN}._torchlib._torchlib_registry.get_torchlib_ops")
_DYN_SIGNATURE = _declare(f"{_DYN}._schemas.op_signature_from_function")
# ortwrap's type promotion: the exporter's pass, without re-running the nodes it leaves alone
_PROMOTE = "torch.onnx._internal.fx.passes.type_promotion"
_PROMOTE_PASS = _declare(f"{_PROMOTE}.InsertTypePromotion")
_PROMOTE_INTERPRETER = _declare(f"{_PROMOTE}._TypePromotionInterpreter")
_PROMOTE_TABLE = _declare(f"{_PROMOTE}.TypePromotionTable")
_PROMOTE_RULE = _declare(f"{_PROMOTE}.get_type_promotion_rule")
_declare("ExportedProgram._graph_module")
#: builds the frames of each fx node's recorded stack trace (``CapturedTraceback.summary``)
_SYMBOLIZED_TB = _declare("torch.utils._traceback._extract_symbolized_tb")
#: replaces ``with_effects(token, op, ...)`` by ``op(...)`` and drops the tokens (the exporter cannot translate it)
_REMOVE_EFFECT_TOKENS = _declare("torch.export._remove_effect_tokens_pass._remove_effect_tokens")
# Operators --------------------------------------------------------------------------------------
_declare("OpOverload._schema")
_BN_FUNCTIONAL = _declare("torch.ops.aten._native_batch_norm_legit_functional")
_GROUPED_MM = _declare("torch.ops.aten._grouped_mm")
_ASSERT_METADATA = _declare("torch.ops.aten._assert_tensor_metadata")
#: linalg's error check (raises on a singular input), which torch.export wraps in ``with_effects``
_LINALG_CHECK_ERRORS = _declare("torch.ops.aten._linalg_check_errors")
# AOTAutograd (the onnxruntime engine, ortwrap/engines/onnxruntime/) ----------------------------
#: the joint forward/backward trace of a module with its parameters and buffers lifted to inputs,
#: partitioned by ``partition_fn`` into a forward and a backward graph, run by AOTAutograd's own
#: autograd.Function (its runtime wrappers: input mutations, aliased outputs, saved values)
_AOT_MODULE = _declare("torch._functorch.aot_autograd.aot_module_simplified")
#: AOTAutograd's training partitioner (its default for training in torch.compile): min-cut with recompute
_MIN_CUT = _declare("torch._functorch.partitioners.min_cut_rematerialization_partition")
#: whether AOTAutograd traces the backward under the forward's autocast state (``"same_as_forward"``,
#: its default) or with autocast off (``"off"``: eager's, where ``backward()`` runs outside autocast)
_BACKWARD_AUTOCAST = _declare("torch._functorch.config.backward_pass_autocast")
# (AOTAutograd calls a compiled graph with its argument list when the callable has ``_boxed_call``: ``boxed``)
# Pytrees ----------------------------------------------------------------------------------------
_PYTREE_NODES = _declare("torch.utils._pytree.SUPPORTED_NODES")


# ------------------------------------------------------------------------------- tensors, autograd


@functools.cache
def from_dlpack() -> Callable[[Any], torch.Tensor]:
    """DLPack capsule -> tensor: the C entry point (``torch.utils.dlpack.from_dlpack`` adds Python
    checks costing about a microsecond a tensor on every step), or the public function."""
    try:
        return _resolve(_FROM_DLPACK)
    except Exception:
        import torch.utils.dlpack

        return torch.utils.dlpack.from_dlpack


def to_dlpack() -> Callable[[torch.Tensor], Any]:
    """Tensor -> DLPack capsule (the public function is the C entry point itself)."""
    import torch.utils.dlpack

    return torch.utils.dlpack.to_dlpack


@functools.cache
def set_grad_enabled() -> Callable[[bool], Any]:
    """``f(mode)`` that sets grad mode without a context manager object."""
    try:
        return _resolve(_SET_GRAD_ENABLED)
    except Exception:
        return torch.set_grad_enabled  # calling it sets the mode at once


@functools.cache
def functorch_transforms_active() -> Callable[[], bool]:
    """``f()``: is a functorch transform (vmap, grad, ...) active? Without the private check,
    always True, which makes callers take ``Function.apply``'s own path (slower, same result)."""
    try:
        return _resolve(_FUNCTORCH_ACTIVE)
    except Exception:
        return lambda: True


def autograd_c_apply(function_cls: type) -> Callable[..., Any]:
    """autograd's C ``apply`` bound to ``function_cls``, without ``Function.apply``'s Python frame
    (torch 2.13 writes ``apply`` in Python; 2.14 makes it the C builtin itself); public ``apply``
    where the C entry point is missing."""
    try:
        return _resolve(_FUNCTION_BASE).__dict__["apply"].__get__(None, function_cls)
    except Exception:
        return function_cls.apply


@functools.cache
def tracing_state() -> Callable[[], Any]:
    """``f()``: the TorchScript tracer's state, falsy when not tracing (``torch.jit.is_tracing`` is
    the public, slower equivalent)."""
    try:
        return _resolve(_TRACING_STATE)
    except Exception:
        return torch.jit.is_tracing


#: Device types whose autocast state ortwrap reads.
AUTOCAST_DEVICES = ("cpu", "cuda")


@functools.cache
def any_autocast_enabled() -> Callable[[], bool]:
    """``f()``: is autocast on for any device (one C call; the public checks take one per device)."""
    try:
        return _resolve(_ANY_AUTOCAST)
    except Exception:
        return lambda: any(torch.is_autocast_enabled(d) for d in AUTOCAST_DEVICES)


@functools.cache
def flash_attention_cpu() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """PyTorch's CPU flash attention ``(q, k, v, dropout_p, is_causal, *, attn_mask, scale) -> (out,
    logsumexp)`` and its backward ``(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *,
    attn_mask, scale) -> (dq, dk, dv)``."""
    return _resolve(_FLASH_CPU), _resolve(_FLASH_CPU_BACKWARD)


#: The library of the x86 Linux wheels that bundles MKL, whose ``cblas_gemm_bf16bf16f32`` (bf16 inputs,
#: float32 result; AMX where the CPU has it) ortwrap's bf16 attention kernel calls (``kernels/_cpu.c``
#: looks the symbol up in the already loaded library). Checked on 2.13.0, 2.14.1 and 2.15.0 (MKL 2024, LP64).
_MKL_LIBRARY = "libtorch_cpu.so"


@functools.cache
def bundled_mkl_library() -> str | None:
    """The path of the loaded PyTorch library that bundles MKL (the kernel checks for the symbol it
    needs), or None where the file is not there (other platforms, other builds)."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", _MKL_LIBRARY)
    return path if os.path.exists(path) else None


def native_bf16_checks() -> tuple[Callable[[], bool], ...]:
    """torch's checks for hardware bfloat16 (AVX512-BF16, AMX tiles); raises where one is missing
    (``ortwrap/cpu.py`` then reads ``/proc/cpuinfo``)."""
    return tuple(_resolve(name) for name in _CPU_BF16_CHECKS)


def private_collectives() -> tuple[str, ...]:
    """Names of ``torch.distributed``'s private collectives (``_all_gather_base``, ...), which a
    Function may call while exporting like the public ones (``integrations/distributed.py`` stubs them
    where the namespace has them)."""
    return tuple(name.rpartition(".")[2] for name in _PRIVATE_COLLECTIVES)


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter: it grows with every in-place write (optimizer steps, ``copy_``)."""
    return t._version


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (autograd engine's callback queue)."""
    _resolve(_EXECUTION_ENGINE).queue_callback(callback)


def has_setup_context(function_cls: type) -> bool:
    """Whether a ``torch.autograd.Function`` defines ``setup_context`` (forward without ctx)."""
    return function_cls.setup_context is not torch.autograd.Function.setup_context


# ------------------------------------------------------------------------------- nn.Module internals


@functools.cache
def _global_hook_tables() -> tuple[dict, ...] | None:
    try:
        return tuple(_resolve(n) for n in _MODULE_GLOBAL_HOOKS)
    except Exception:
        return None


def call_skips_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module(...)`` would go straight to ``forward``: no module or global hooks, no
    ``torch.compile``'d call and no TorchScript tracer. False when that cannot be told (callers
    then take ``nn.Module.__call__``)."""
    tables = _global_hook_tables()
    if tables is None:
        return False
    d = module.__dict__
    try:
        if d["_compiled_call_impl"] is not None:
            return False
        if d["_forward_pre_hooks"] or d["_forward_hooks"] or d["_backward_pre_hooks"] or d["_backward_hooks"]:
            return False
    except KeyError:
        return False
    return not (tables[0] or tables[1] or tables[2] or tables[3] or tracing_state()())


@functools.cache
def module_internal_attributes() -> frozenset[str]:
    """The instance attributes every ``nn.Module`` has (torch's own tables: parameters, buffers,
    hooks, ...), read off a fresh module: what is left in ``vars(module)`` is the user's."""
    return frozenset(vars(torch.nn.Module()))


def parameter_table(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """The module's own ``name -> Parameter`` dict (what ``module.name`` reads), not a copy."""
    return module.__dict__["_parameters"]


def buffer_table(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own ``name -> buffer`` dict, not a copy."""
    return module.__dict__["_buffers"]


MODULE_STRUCTURE_TABLES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def share_structure(view: torch.nn.Module, module: torch.nn.Module) -> None:
    """Make ``view``'s parameter, buffer and submodule tables ``module``'s own (the same objects):
    ``view`` then has ``module``'s names, and registering on either registers on both."""
    for name in MODULE_STRUCTURE_TABLES:
        view.__dict__[name] = module.__dict__[name]


_MISSING = object()


def structure_member(module: torch.nn.Module, name: str, default: Any = _MISSING) -> Any:
    """``module``'s parameter, buffer or submodule ``name`` (what ``nn.Module.__getattr__`` finds),
    else ``default`` (or :data:`MISSING`)."""
    d = module.__dict__
    for table in ("_parameters", "_buffers", "_modules"):
        t = d.get(table)
        if t is not None and name in t:
            return t[name]
    return default


#: What :func:`structure_member` returns for a name none of the tables has.
MISSING = _MISSING
_declare("Module._apply")


def apply_to_tensors(module: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> None:
    """``module._apply(fn, recurse)``: what ``to()``, ``float()``, ``cuda()`` ... run on parameters and buffers."""
    module._apply(fn, recurse)


_OPTIMIZED_MODULE = _declare("torch._dynamo.eval_frame.OptimizedModule")


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(m)``'s wrapper or was compiled in place (``m.compile()``).

    Resolved only where dynamo is already imported (a compiled module exists only then)."""
    import sys

    if module.__dict__.get("_compiled_call_impl") is not None:
        return True
    if "torch._dynamo" not in sys.modules:
        return False
    return isinstance(module, _resolve(_OPTIMIZED_MODULE))


_DYNAMO_CONFIG = _declare("torch._dynamo.config")


def dynamo_recompile_limits(per_code: int, total: int) -> contextlib.AbstractContextManager:
    """A context in which torch.compile captures one code object up to ``per_code`` times, and up to
    ``total`` over all (the defaults, 8 and 256, run a frame past them in PyTorch, silently)."""
    return _resolve(_DYNAMO_CONFIG).patch(recompile_limit=per_code, accumulated_recompile_limit=total)


_SPECIALIZE_FLOAT = _declare("torch._dynamo.config.specialize_float")
_DUCK_SHAPE = _declare("torch.fx.experimental._config.use_duck_shape")


def dynamo_dynamic_capture(per_code: int, total: int) -> contextlib.AbstractContextManager:
    """:func:`dynamo_recompile_limits`, for a ``torch.compile(dynamic=True)`` whose sizes are what
    changes: float values stay constants (``specialize_float``), and two sizes equal in one call
    are not assumed equal (``use_duck_shape``: a length of 8 and a head dim of 8)."""
    _resolve(_SPECIALIZE_FLOAT), _resolve(_DUCK_SHAPE)  # (each raises naming itself where torch lacks it)
    stack = contextlib.ExitStack()
    stack.enter_context(dynamo_recompile_limits(per_code, total))
    stack.enter_context(_resolve(_DYNAMO_CONFIG).patch(specialize_float=True))
    stack.enter_context(_resolve(_DUCK_SHAPE.rsplit(".", 1)[0]).patch(use_duck_shape=False))
    return stack


def non_persistent_buffers(module: torch.nn.Module) -> set[str]:
    """The mutable set of the module's buffer names left out of ``state_dict``."""
    return module.__dict__["_non_persistent_buffers_set"]


def hook_tables(module: torch.nn.Module) -> list[tuple[dict, list[dict]]]:
    """Each non-empty forward/backward hook table of ``module`` with its side tables (kwargs and
    always-called flags keyed by the same hook ids)."""
    d = module.__dict__
    out = []
    for name in MODULE_HOOK_TABLES:
        table = d.get(name)
        if table:
            out.append((table, [d[s] for s in MODULE_HOOK_SIDE_TABLES if d.get(s) is not None]))
    return out


# ------------------------------------------------------------------------------- the TorchScript exporter


def _ts_registry() -> Any:
    return _first(_TS_REGISTRY, "torch.onnx._internal.registration.registry")


def ts_symbolic(name: str, opset: int) -> Callable[..., Any] | None:
    """The symbolic the TorchScript exporter uses for ``name`` (``"aten::embedding"``) at ``opset``."""
    group = _ts_registry().get_function_group(name)
    return group.get(opset) if group is not None else None


def ts_custom_symbolic(name: str, opset: int) -> Callable[..., Any] | None:
    """The custom symbolic registered for ``name`` at exactly ``opset`` (a user's, or ortwrap's), or None."""
    group = _ts_registry().get_function_group(name)
    if group is None:
        return None
    table = group._functions
    return table[opset] if table.overridden(opset) else None


def ts_register(name: str, opset: int, fn: Callable[..., Any]) -> None:
    """Register ``fn`` as the custom symbolic of ``name`` at ``opset``."""
    _ts_registry().register(name, opset, fn, custom=True)


def ts_unregister(name: str, opset: int) -> None:
    """Remove the custom symbolic of ``name`` at ``opset``."""
    _ts_registry().unregister(name, opset)


def _ts_helper() -> Any:
    return _first(_TS_HELPER, "torch.onnx.symbolic_helper")


def ts_constant(value: Any, desc: str) -> Any:
    """A symbolic argument's constant value (``desc``: ``"i"``, ``"f"``, ``"b"``, ``"is"``...), or the value."""
    return _ts_helper()._maybe_get_const(value, desc)


def ts_is_none(value: Any) -> bool:
    """Whether a symbolic argument is an absent optional (``None``)."""
    return _ts_helper()._is_none(value)


def ts_rank(value: Any) -> int | None:
    """The rank of a symbolic argument, if known."""
    return _ts_helper()._get_tensor_rank(value)


def ts_unpack_list(value: Any) -> list[Any] | None:
    """The values of a symbolic ``Tensor[]`` argument built in the graph (``prim::ListConstruct``), or None."""
    helper = _ts_helper()
    return helper._unpack_list(value) if helper._is_value(value) and helper._is_packed_list(value) else None


def ts_sizes(value: Any) -> list[int | None] | None:
    """The sizes of a symbolic argument (None for a dynamic dim), if its rank is known."""
    return _ts_helper()._get_tensor_sizes(value)


def ts_scalar_type(value: Any, default: str = "FLOAT") -> tuple[int, torch.dtype]:
    """(ONNX element type, torch dtype) of a symbolic argument."""
    jst = _first(_TS_TYPE_UTILS, "torch.onnx._type_utils.JitScalarType")
    scalar = jst.from_value(value, getattr(jst, default))
    return scalar.onnx_type(), scalar.dtype()


def ts_overload_name(node: Any) -> str:
    """The ATen overload name of a TorchScript node (``""`` for the default overload)."""
    return _first(_TS_OVERLOAD_NAME, "torch.onnx.utils._get_aten_op_overload_name")(node)


def ts_load_opset_symbolics(opset: int) -> None:
    """Register torch's symbolics of every opset up to ``opset`` (the exporter imports them lazily:
    before that, the registry answers an op with an older opset's symbolic, ``squeeze``'s opset 9
    one, which writes ``Squeeze`` where opset 11+ writes an ``If`` for a dynamic dim)."""
    for n, name in _TS_OPSETS.items():
        if n <= opset:
            try:
                _first(name, f"torch.onnx.symbolic_opset{n}")
            except Exception:  # an opset this release has no module for
                pass


def ts_inline_block(g: Any, node: Any, tensor_args: list[Any]) -> list[Any]:
    """Export the ops a ``prim::PythonOp`` node recorded (its sub-block, with
    ``autograd_inlining=True``) into the graph being built, instead of the node itself.

    Args:
        g: the symbolic's graph context.
        node: the ``prim::PythonOp`` node.
        tensor_args: the ONNX values of the node's tensor arguments, in order.

    Returns:
        The ONNX values of the node's outputs.
    """
    blocks = list(node.blocks())
    if not blocks:
        raise RuntimeError("the Function call recorded no sub-block (export with autograd_inlining=True)")
    block = blocks[0]
    env = dict(g.env)
    for block_input, value in zip(block.inputs(), tensor_args):
        env[block_input] = value
    env = _resolve(_TS_ONNX_BLOCK)(
        block,
        g.block,
        torch.onnx.OperatorExportTypes.ONNX_ATEN_FALLBACK,
        env,
        set(g.values_in_env) | set(tensor_args),
        True,
    )
    return [env[o] for o in block.outputs()]


# ------------------------------------------------------------------------------- the dynamo exporter

_torchlib_registries: dict[int, Any] = {}


def is_linalg_check_errors(target: Any) -> bool:
    """Whether an FX node's target is ``aten._linalg_check_errors`` (any overload)."""
    return getattr(target, "overloadpacket", None) is _resolve(_LINALG_CHECK_ERRORS)


def remove_effect_tokens(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` with its ``with_effects`` calls made plain calls and its effect tokens dropped (in place)."""
    return _resolve(_REMOVE_EFFECT_TOKENS)(program)


def dynamo_registry(opset: int, table: dict[Any, Callable[..., Any]]) -> Any:
    """torchlib's registry at ``opset`` (built once per process and opset, :func:`_lazy_torchlib`)
    with ``table``'s translations first.

    ``table`` is laid over a copy for each export: its functions are not the same objects from one
    export to the next (``translations._softmax_in`` makes new ones), so keying a whole registry by
    them rebuilt torchlib's on every export (~0.5 CPU s of each dynamo build).
    """
    registry = _torchlib_registries.get(opset)
    if registry is None:
        registry = _torchlib_registries[opset] = _lazy_torchlib(opset)
    return with_extra_translations(registry, table)


def _lazy_torchlib(opset: int) -> Any:
    """What ``ONNXRegistry.from_torchlib(opset_version=opset)`` builds, with the ONNX signature of each
    onnxscript function inferred when the exporter first dispatches to it.

    ``from_torchlib`` compiles every torchlib function to ONNX IR (``function_ir``) and infers its
    signature up front: ~600 functions, 0.7-1.2 CPU s of a process's first dynamo build, for the few
    dozen a graph uses. The entries, their order and their opsets are ``from_torchlib``'s
    (``tests/test_dynamo.py`` compares the two registries entry by entry).
    """
    registry_cls = _resolve(_DYN_REGISTRY)
    register, get_overload = _resolve(_DYN_REGISTER), _resolve(_DYN_GET_OVERLOAD)
    lazy = _lazy_signature_meta()
    registry = registry_cls()
    registry._opset_version = opset
    for meta in _resolve(_DYN_OWN_TORCHLIB)():
        register(registry, meta.fx_target, meta)
    from onnxscript.function_libs.torch_lib import ops, registration  # importing ops registers them

    del ops
    for qualified_name, overloads in registration.default_registry.items():
        if qualified_name.startswith("internal::"):
            continue
        target = get_overload(qualified_name)
        if target is None:
            continue
        for fn, is_complex in [*((f, False) for f in overloads.overloads), *((f, True) for f in overloads.complex)]:
            meta = lazy(onnx_function=fn, fx_target=target, signature=None, is_custom=False, is_complex=is_complex)
            register(registry, target, meta)
    _resolve(_DYN_OPSET_CLEANUP)(registry)
    return registry


@functools.cache
def _lazy_signature_meta() -> type:
    """``OnnxDecompMeta`` whose ``signature`` is inferred on first read (``__post_init__`` infers it
    at construction), exactly as ``__post_init__`` would (and written to the function, where the
    exporter's ``eval_function`` reads it)."""
    import onnxscript

    base = _resolve(_DYN_DECOMP_META)
    infer = _resolve(_DYN_SIGNATURE)

    class LazySignatureMeta(base):
        def __post_init__(self) -> None:
            pass

        @property
        def signature(self) -> Any:
            signature = self.__dict__.get("_signature")
            if signature is None:
                fn = self.onnx_function
                if isinstance(fn, onnxscript.OnnxFunction):
                    signature = infer(fn, fn.function_ir.domain, fn.name, since_version=fn.opset.version)
                else:  # a traceable function
                    signature = infer(fn, "__traced", fn.__name__)
                self.__dict__["_signature"] = signature
                fn._pt_onnx_signature = signature
            return signature

        @signature.setter
        def signature(self, value: Any) -> None:
            self.__dict__["_signature"] = value

    return LazySignatureMeta


def assert_metadata_op() -> Any:
    """``aten._assert_tensor_metadata.default``: the capture's checks of its own metadata."""
    return _resolve(_ASSERT_METADATA).default


@contextlib.contextmanager
def onnx_exporting() -> Iterator[None]:
    """What ``torch.onnx.export`` sets while it runs (``torch.onnx.is_in_onnx_export()``)."""
    flags = importlib.import_module(_DYN_FLAGS.rpartition(".")[0])
    _resolve(_DYN_FLAGS)
    flags._is_onnx_exporting = True
    try:
        yield
    finally:
        flags._is_onnx_exporting = False


def with_extra_translations(registry: Any, extra: dict[Any, Callable[..., Any]]) -> Any:
    """A copy of ``registry`` whose first choice for each op of ``extra`` is ``extra``'s translation."""
    import copy

    if not extra:
        return registry
    out = copy.copy(registry)
    out.functions = dict(registry.functions)
    for op in extra:
        out.functions[op.name()] = list(registry.functions.get(op.name(), []))
    for op, fn in extra.items():
        # ``value_kinds``: the calls a translation takes, by whether they have complex inputs
        for is_complex in getattr(fn, "value_kinds", (bool(getattr(fn, "complex_values", False)),)):
            out.register_op(op, fn, is_complex=is_complex)
    return out


_EXPORT_PROXY_MAP = _declare("torch.fx.experimental.proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT")
_SHAPE_ENV = _declare("torch.fx.experimental.symbolic_shapes.ShapeEnv")


def release_export_state() -> None:
    """Drop what ``torch.export`` keeps of the last export once it has returned.

    NOTE: non-strict export records, for its fake-tensor leak check, a module-level map from fake
    tensor ids to the traced graph's nodes (proxy_tensor.py), and clears it only at the next trace:
    until then it keeps the last export's fx graph, its fake tensors and its ShapeEnv alive (a
    few MiB on a small transformer). ``ShapeEnv``'s methods are memoized with ``functools.lru_cache``
    on the class (some through torch's ``_lru_cache``, which has the same ``cache_clear``), whose keys hold the last capture's ShapeEnv, with its tracked fake tensors and
    their FakeTensorMode: those caches are emptied too (the next capture has a ShapeEnv of its own).
    Only what is loaded is touched; a torch without these names is left alone (nothing to release)."""
    import sys

    module, _, attr = _EXPORT_PROXY_MAP.rpartition(".")
    table = getattr(sys.modules.get(module), attr, None)
    if isinstance(table, dict):
        table.clear()
    module, _, attr = _SHAPE_ENV.rpartition(".")
    shape_env = getattr(sys.modules.get(module), attr, None)
    for member in vars(shape_env).values() if isinstance(shape_env, type) else ():
        clear = getattr(member, "cache_clear", None)  # functools.lru_cache, and torch's own wrapper of it
        if callable(clear):
            clear()


def remove_assertion_nodes(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The exporter's pass that drops assertion nodes (a new graph module, or ``gm``)."""
    return _resolve(_DYN_NO_ASSERTS)(gm)


def set_graph_module(program: torch.export.ExportedProgram, gm: torch.fx.GraphModule) -> None:
    """Make ``gm`` ``program``'s graph module (the exporter's passes may return a new one)."""
    program._graph_module = gm


_PATCH_LOCK = threading.Lock()
#: (id(owner), attribute) -> [the original value, how many contexts use the replacement]
_PATCHES: dict[tuple[int, str], list[Any]] = {}


@contextlib.contextmanager
def _patched(owner: Any, attr: str, value: Any) -> Iterator[None]:
    """``owner.attr`` is ``value`` while any context of it is open (nested or in other threads);
    the original comes back when the last one closes."""
    key = (id(owner), attr)
    with _PATCH_LOCK:
        entry = _PATCHES.get(key)
        if entry is None:
            original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            entry = _PATCHES[key] = [original, 0]
            setattr(owner, attr, value)
        entry[1] += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            entry[1] -= 1
            if entry[1] == 0:
                setattr(owner, attr, entry[0])
                del _PATCHES[key]


def _extract_frames_lazily(tb: Any, skip: int) -> Any:
    """``_extract_symbolized_tb``'s loop, with ``lookup_line=False``: :func:`lazy_stack_trace_lines`."""
    import traceback

    stack = traceback.StackSummary()
    for f in reversed(tb[skip:]):
        stack.append(traceback.FrameSummary(f["filename"], f["line"], f["name"], lookup_line=False))
    return stack


def lazy_stack_trace_lines() -> contextlib.AbstractContextManager:
    """While tracing, read the source line of a recorded stack frame only when the trace is formatted.

    NOTE: tracing records a stack trace on every fx node (``node.meta["stack_trace"]``, which the
    exporter copies into the ONNX node's ``pkg.torch.onnx.stack_trace`` and ortwrap's errors read
    for the user's ``file:line``). torch builds a ``FrameSummary`` for each of the ~80 frames of the
    whole stack, each reading its source line through ``linecache`` (``lookup_line=True``), then keeps
    the few frames in ``forward`` functions and formats only those. Here the frames are made with
    ``lookup_line=False``; formatting reads the kept frames' lines on demand (``FrameSummary.line``),
    so the recorded text is the same (~0.05 CPU s of the GPT-2-small capture). Checked on torch
    2.13.0, 2.14.1 and 2.15.0 (the same loop); a torch without the function is left alone.
    """
    module_name, _, attr = _SYMBOLIZED_TB.rpartition(".")
    module = importlib.import_module(module_name)
    if not callable(getattr(module, attr, None)):
        return contextlib.nullcontext()
    return _patched(module, attr, _extract_frames_lazily)


#: (domain, op type, since_version) of a standard ONNX operator -> its onnx_ir OpSignature
_OP_SIGNATURES: dict[tuple[str, str, int], Any] = {}


def _op_signatures_memoized() -> contextlib.AbstractContextManager:
    """While the exporter translates, parse each standard ONNX operator's schema into an onnx_ir
    ``OpSignature`` once per process.

    NOTE: the exporter's graph builder (``_building.OpRecorder.eval``) calls
    ``OpSignature.from_op_schema(schema)`` for every ONNX op a torchlib function emits: ~1400 calls,
    on ~30 operators, at the GPT-2-small size, each on a new ``OpSchema`` object. The signature is
    only read (by the exporter and onnxscript). A schema of the default domain is the one ONNX
    registers for that (op type, since_version), so that triple names it; other domains' schemas
    (functions, custom ops) are parsed each time, as before.
    """
    import onnx_ir as ir

    cls = ir.schemas.OpSignature
    parse = _PATCHES.get((id(cls), "from_op_schema"), [cls.__dict__["from_op_schema"]])[0].__func__

    def from_op_schema(klass: type, op_schema: Any) -> Any:
        if klass is not cls or op_schema.domain not in ("", "ai.onnx"):
            return parse(klass, op_schema)
        key = ("", op_schema.name, op_schema.since_version)
        signature = _OP_SIGNATURES.get(key)
        if signature is None:
            signature = _OP_SIGNATURES[key] = parse(klass, op_schema)
        return signature

    return _patched(cls, "from_op_schema", classmethod(from_op_schema))


def translate_exported(program: torch.export.ExportedProgram, registry: Any) -> Any:
    """The exporter's translation of ``program`` with ``registry`` (its ``ONNXProgram``).

    The exporter types a complex value as its real ``[..., 2]`` form through its dtype table, which
    has no complex32 (``Tensor.chalf()``: a KeyError). While it translates, complex32 reads as
    complex64, whose real form the exporter takes from the dtype itself (float16)."""
    import onnx_ir as ir

    dtypes = _resolve(_DYN_DTYPES)
    added = torch.complex32 not in dtypes
    if added:
        dtypes[torch.complex32] = ir.DataType.COMPLEX64
    try:
        with _op_signatures_memoized():
            return _resolve(_DYN_TRANSLATE)(program, registry=registry)
    finally:
        if added:
            dtypes.pop(torch.complex32, None)


def prepare_exported(program: torch.export.ExportedProgram, registry: Any) -> torch.export.ExportedProgram:
    """The exporter's own preparation of ``program`` (``run_decompositions`` with its table)."""
    return _resolve(_DYN_PREPARE)(program, registry=registry)


def insert_type_promotion(gm: torch.fx.GraphModule) -> None:
    """The exporter's type promotion pass (``insert_type_promotion_nodes``: explicit casts where an
    op's inputs have other dtypes than it computes in), re-running on fake tensors only the nodes it
    adds or changes.

    The exporter's pass re-runs every node of the graph on fake tensors to know its inputs' dtypes
    (0.15-0.6 CPU s: a third of the translation's time). A node the pass does not touch keeps the
    value the capture recorded (``meta["val"]``, the same fake tensor a re-run computes): the pass
    casts a changed node's output back to the dtype it had, so what follows sees the same dtypes.
    The graphs are the same as the exporter's pass makes (``tests/test_dynamo.py``).
    """
    base = _lazy_promotion_interpreter()
    table = _resolve(_PROMOTE_TABLE)()
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            raise AssertionError(f"expected a GraphModule, got {type(module)}")
        transform = _resolve(_PROMOTE_PASS)(module)
        transform.interpreter = base(module, table)
        transform.run()


@functools.cache
def _lazy_promotion_interpreter() -> type:
    base = _resolve(_PROMOTE_INTERPRETER)
    rule_of = _resolve(_PROMOTE_RULE)
    run_any = torch.fx.Interpreter.run_node

    class ReusingInterpreter(base):
        def run_node(self, n: torch.fx.Node) -> Any:
            args, kwargs, target = n.args, n.kwargs, n.target
            with self._set_current_node(n):
                if rule := rule_of(n, self.type_promotion_table):
                    self._maybe_promote_node(n, rule)
            untouched = n.args is args and n.kwargs is kwargs and n.target is target
            if untouched and n.op == "call_function" and "val" in n.meta:
                return n.meta["val"]
            return run_any(self, n)

    return ReusingInterpreter


# ------------------------------------------------------------------------------- pytrees


def pytree_children(obj: Any) -> tuple[list[Any], Any] | None:
    """``(children, context)`` of an object whose type is registered with torch's pytree (by torch,
    or by a library: ``register_pytree_node``); None for any other type."""
    node = _resolve(_PYTREE_NODES).get(type(obj))
    if node is None:
        return None
    children, context = node.flatten_fn(obj)
    return list(children), context


def pytree_rebuild(cls: type, children: list[Any], context: Any) -> Any:
    """The object of registered pytree type ``cls`` made of ``children`` (:func:`pytree_children`)."""
    return _resolve(_PYTREE_NODES)[cls].unflatten_fn(children, context)


# ------------------------------------------------------------------------------- operators


@functools.cache
def _op_overload_type() -> type:
    return type(torch.ops.aten.add.Tensor)


def is_op_overload(target: Any) -> bool:
    """Whether an FX node's target is one ATen (or custom) operator overload."""
    return isinstance(target, _op_overload_type())


def op_schema(op: Any) -> Any:
    """The ``FunctionSchema`` of an ``OpOverload`` (``torch.ops.aten.add.Tensor``)."""
    return op._schema


def grouped_mm_op() -> Any | None:
    """``torch.ops.aten._grouped_mm`` (mixture-of-experts layers), or None on a torch without it."""
    try:
        return _resolve(_GROUPED_MM).default
    except Exception:
        return None


def batch_norm_functional_op() -> Any:
    """``torch.ops.aten._native_batch_norm_legit_functional``: BatchNorm in training mode as
    ``torch.export`` writes it."""
    return _resolve(_BN_FUNCTIONAL)


# ------------------------------------------------------------------------------------------------ logs

#: Loggers whose records a capture (torch.export's fake tensors, symbolic shapes, dynamo, the ONNX
#: exporters, onnxscript's optimizer) writes while ortwrap builds: a batch with a bad shape logs a
#: fake-tensor traceback for each failing op there before the user's own error. Private module
#: names (checked on CHECKED_RELEASES); a name a release lacks is simply never written to.
CAPTURE_LOGGERS: tuple[str, ...] = (
    "torch._subclasses",
    "torch.fx",
    "torch._dynamo",
    "torch._export",
    "torch.export",
    "torch.onnx",
    "torch._functorch",
    "torch._guards",
    "torch.utils._sympy",
    "torch.__trace",
    "onnxscript",
)


@contextlib.contextmanager
def quiet_capture_logs(enabled: bool = True) -> Iterator[None]:
    """Mute :data:`CAPTURE_LOGGERS` (and each of their loggers with a level of its own) for the
    duration of a build. Failures still raise; ortwrap reports them. Levels are restored after."""
    import logging

    if not enabled:
        yield
        return
    names = [
        n
        for n, lg in list(logging.Logger.manager.loggerDict.items())
        if isinstance(lg, logging.Logger) and lg.level and any(n.startswith(p + ".") for p in CAPTURE_LOGGERS)
    ]
    loggers = [logging.getLogger(n) for n in (*CAPTURE_LOGGERS, *names)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# ------------------------------------------------------------------------------- AOTAutograd


def aot_module(
    module: torch.nn.Module,
    example_inputs: list[torch.Tensor],
    *,
    fw_compiler: Callable[..., Any],
    bw_compiler: Callable[..., Any],
    inference_compiler: Callable[..., Any],
    decompositions: dict[Any, Callable[..., Any]],
    recompute: bool = True,
    eager_backward: bool = False,
) -> Callable[..., Any]:
    """AOTAutograd over ``module`` (``aot_module_simplified``): the compilers get the partitioned
    forward and backward FX graphs (or the inference graph) and return boxed callables
    (:func:`boxed`). ``recompute``: the min-cut partitioner (AOTAutograd's default for training,
    which recomputes cheap ops in the backward) instead of the default partition (saves what the
    backward reads, recomputes nothing)."""
    partition = _resolve(_MIN_CUT) if recompute else _resolve("torch._functorch.partitioners.default_partition")
    if eager_backward:
        # (AOTAutograd compiles a backward with saved SymInts at trace time, but keeps a failure for the
        # first backward call: this flag makes it raise here, where the engine can fall back)
        module_name, _, flag = _EAGER_BACKWARD.rpartition(".")
        with importlib.import_module(module_name).patch({flag: True}):
            return aot_module(module, example_inputs, fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                              inference_compiler=inference_compiler, decompositions=decompositions,
                              recompute=recompute)  # fmt: skip
    _resolve(_BACKWARD_AUTOCAST)  # (the option exists)
    config = importlib.import_module("torch._functorch.config")
    # NOTE: the backward is traced with autocast off, as eager's ``loss.backward()`` runs outside the
    # autocast block (AOTAutograd's default traces it under the forward's autocast state).
    with config.patch(backward_pass_autocast="off"):
        return _resolve(_AOT_MODULE)(
            module,
            example_inputs,
            fw_compiler=fw_compiler,
            bw_compiler=bw_compiler,
            inference_compiler=inference_compiler,
            partition_fn=partition,
            decompositions=decompositions,
        )


_declare("torch._functorch.partitioners.default_partition")
_EAGER_BACKWARD = _declare("torch._functorch.config.force_non_lazy_backward_lowering")
_COMPILE_SESSION = _declare("torch.compiler._compile_session_context")
_UNSET_FAKE = _declare("torch._subclasses.fake_tensor.unset_fake_temporarily")
_NO_DISPATCH_MODES = _declare("torch.utils._python_dispatch._disable_current_modes")
_BACKWARD_C_FUNCTION = _declare("torch.autograd.function.BackwardCFunction")


def compile_session() -> Any:
    """The context ``torch.compile`` traces in: ``torch.compiler.is_compiling()`` is True, so library
    code takes its trace-friendly branch (transformers skips its data-dependent ``mask.all()``
    shortcut), as it does when AOTAutograd runs under ``torch.compile``."""
    return _resolve(_COMPILE_SESSION)()


_DATA_DEPENDENT_ERRORS = (
    _declare("torch._subclasses.fake_tensor.DataDependentOutputException"),
    _declare("torch._subclasses.fake_tensor.DynamicOutputShapeException"),
    _declare("torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode"),
)


def data_dependent_trace_error(error: BaseException) -> BaseException | None:
    """The exception in ``error``'s chain (itself, or one it was raised from) that is a fake-tensor
    trace's refusal of a value it cannot know, or None: a tensor's value read into Python
    (``.item()``, ``if tensor``: fake tensor's ``DataDependentOutputException``), an op whose output
    shape depends on the values (``nonzero``, ``masked_select``: ``DynamicOutputShapeException``),
    or a guard on such a size (``GuardOnDataDependentSymNode``)."""
    classes = tuple(_resolve(name) for name in _DATA_DEPENDENT_ERRORS)
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, classes):
            return e
        e = e.__cause__ or e.__context__
    return None


def no_fake_mode() -> Any:
    """Leave the active FakeTensorMode for the block: AOTAutograd calls its graph compilers inside
    it, and a compiler that computes with real tensors (constant folding) must run outside."""
    return _resolve(_UNSET_FAKE)()


def no_dispatch_modes() -> Any:
    """Leave every active TorchDispatchMode (AOTAutograd's proxy, functional and fake modes) for the
    block: real computation inside a trace that must not be recorded (the onnxruntime engine's probe
    of an untraceable autograd.Function's output shapes)."""
    return _resolve(_NO_DISPATCH_MODES)()


def backward_from(ctx: Any, function: type) -> None:
    """The backward of the autograd node ``ctx`` (an ``autograd.Function``'s ctx, in its forward)
    becomes ``function.backward``: ``BackwardCFunction`` looks up ``self._forward_cls`` when the node
    runs, so an attribute of this one ctx redirects this one call, and no class changes."""
    if not isinstance(ctx, _resolve(_BACKWARD_C_FUNCTION)) or not hasattr(type(ctx), "_forward_cls"):
        raise _missing(_BACKWARD_C_FUNCTION)
    ctx._forward_cls = function


#: The class name autograd gives the backward node of AOTAutograd's runtime Function (a class made
#: inside ``aot_dispatch_autograd``, so not an attribute to declare): checked on 2.13.0, 2.14.1 and
#: 2.15.0 (test_engine_onnxruntime's None-gradient tests).
_AOT_BACKWARD_NODE = "CompiledFunctionBackward"


def is_aot_backward_node(node: Any) -> bool:
    """Whether the autograd node ``node`` is the backward of an AOTAutograd-compiled call."""
    return type(node).__name__ == _AOT_BACKWARD_NODE


_GET_DECOMPOSITIONS = _declare("torch._decomp.get_decompositions")


def decompositions_of(ops: list[Any]) -> dict[Any, Callable[..., Any]]:
    """torch's own decompositions of ``ops`` (``torch._decomp.get_decompositions``)."""
    return _resolve(_GET_DECOMPOSITIONS)(ops)


def boxed(fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """``fn``, which takes the argument list (and may clear it), marked for AOTAutograd's boxed
    calling convention."""

    def call(args: list[Any]) -> Any:
        return fn(args)

    call._boxed_call = True  # type: ignore[attr-defined]
    return call


# ----------------------------------------------------------- symbolic sizes (the onnxruntime engine)

_FAKE_MODE = _declare("torch._subclasses.fake_tensor.FakeTensorMode")
_STATELESS_CONTEXT = _declare("torch.fx.experimental.symbolic_shapes.StatelessSymbolicContext")
_DIM_DYNAMIC = _declare("torch.fx.experimental.symbolic_shapes.DimDynamic")
_FLOOR_DIV = _declare("torch.utils._sympy.functions.FloorDiv")


def symbolic_inputs(tensors: list[torch.Tensor], dynamic: list[set[int]]) -> tuple[Any, list[torch.Tensor]]:
    """Fake copies of ``tensors`` in a new FakeTensorMode with a ShapeEnv, the dims in ``dynamic[i]``
    of tensor ``i`` symbolic (each its own symbol: no duck sizing), the others static. AOTAutograd
    traces with the mode it finds in its example inputs, so its graphs get symbolic sizes. Returns
    ``(shape_env, fakes)``."""
    shape_env = _resolve(_SHAPE_ENV)(duck_shape=False, tracked_fakes=[])
    mode = _resolve(_FAKE_MODE)(shape_env=shape_env)
    context, dim = _resolve(_STATELESS_CONTEXT), _resolve(_DIM_DYNAMIC)
    fakes = [
        mode.from_tensor(
            t,
            symbolic_context=context(dynamic_sizes=[dim.DYNAMIC if d in dims else dim.STATIC for d in range(t.dim())]),
        )
        for t, dims in zip(tensors, dynamic)
    ]
    return shape_env, fakes


def shape_guards(shape_env: Any, fakes: list[torch.Tensor]) -> Callable[[list[torch.Tensor]], bool]:
    """The guards the trace put on the symbolic sizes of ``fakes`` (``ShapeEnv.produce_guards_expression``:
    relations, specializations, the ``>= 2`` of every dynamic size), as a check of real inputs. Static
    dims are checked too: with ``ignore_static`` a symbolic dim the trace specialized (an LSTM's loop over
    the length fixes it) would go unchecked."""
    code = shape_env.produce_guards_expression(fakes, ignore_static=False)
    if not code:
        return lambda args: True
    return lambda args: bool(shape_env.evaluate_guards_expression(code, args))


def sym_expr(value: Any) -> Any:
    """The sympy expression of a SymInt (``value.node.expr``), or the int itself."""
    return value.node.expr if isinstance(value, torch.SymInt) else value


def sym_hint(value: Any) -> int:
    """The value a SymInt had in the trace's example (its hint), or the int itself."""
    if isinstance(value, torch.SymInt):
        return int(value.node.hint)
    return int(value)


def floor_div_type() -> type:
    """torch's sympy ``FloorDiv`` (the ``//`` of symbolic sizes)."""
    return _resolve(_FLOOR_DIV)
