"""Typed, frozen options of :class:`ortwrap.ORTWrap`.

This is the one module that reads environment variables. Precedence, highest first: a keyword
argument given to ``ORTWrap``, the environment variable, the default below.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENV_VARS", "ORTMODULE_ENV_VARS", "Options", "env_flag", "env_log_level", "parse_log_level"]

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
EXPORTER_CHOICES = ("auto", "torchscript", "dynamo")
_ZERO3_GATHER = ("module", "submodule")
_RECOMPUTE = ("none", "cheap", "layers")  # grad.recompute.RECOMPUTE_MODES
_HALF_COMPUTE = ("auto", "float32", "native")
_GEMM = ("auto", "ort", "torch")
_ENGINES = ("auto", "training", "onnxruntime")  # engines.ENGINES and "auto"


def _opt(default: Any, env: str | None, help: str, aliases: tuple[str, ...] = ()) -> Any:
    return field(default=default, metadata={"env": env, "help": help, "aliases": aliases})


@dataclass(frozen=True)
class Options:
    """How ORTWrap exports, builds and runs a module.

    Each field names the environment variable that sets it when the keyword is not given.
    """

    engine: str = _opt(
        "auto",
        "ORTWRAP_ENGINE",
        f"What trains the module, one of {', '.join(_ENGINES)}. 'training': ONNX Runtime's training build "
        "(onnxruntime-training 1.19.2, ortwrap[cpu]/[cuda]; CPython 3.10-3.12): ORT builds the gradient graph. "
        "'onnxruntime': the maintained onnxruntime>=1.20 (ortwrap[ort]/[ort-gpu]): PyTorch's AOTAutograd gives the "
        "gradients and ORT runs the forward and backward graphs (docs/engines.md). 'auto': 'training' where the "
        "training build is installed, else 'onnxruntime'.",
    )
    fallback: bool = _opt(
        True,
        "ORTWRAP_FALLBACK",
        "When export, a graph pass, gradient building or session creation fails, run the module in "
        "PyTorch and warn once (True), or raise the ortwrap error (False).",
    )
    log_level: int | None = _opt(
        None,
        None,
        f"Deprecated: ortwrap's verbosity is one setting for the process, ortwrap.set_verbosity(level) or "
        f"ORTWRAP_LOG_LEVEL. Given, it calls set_verbosity (a logging level or one of {', '.join(_LOG_LEVELS)}) "
        "with a FutureWarning, and stays in effect for every wrapper until changed.",
    )
    debug_dir: str | None = _opt(
        None,
        "ORTWRAP_DEBUG_DIR",
        "Directory where every build saves its exported, pre-gradient and forward+backward ONNX models.",
    )
    opset: int = _opt(17, "ORTWRAP_OPSET", "ONNX opset the TorchScript exporter targets (ORT 1.19.2 takes <= 21).")
    exporter: str = _opt(
        "auto",
        "ORTWRAP_EXPORTER",
        f"Exporter, one of {', '.join(EXPORTER_CHOICES)}. 'auto' tries 'dynamo' (torch.export) first on every torch "
        "release where torch.onnx deprecates the TorchScript exporter (2.9 and later, so all supported releases), "
        "and the TorchScript exporter when the dynamo capture fails (a data-dependent branch in an autograd.Function, "
        "say), saying so once; before 2.9 it is 'torchscript'. Where the dynamo capture stops on a data-dependent "
        "guard and TorchScript fails too (a Python loop over routed experts), 'auto' and 'dynamo' run the call as a "
        "split capture: torch.compile keeps the Python code and trains each graph fragment on ONNX Runtime "
        "(ORTWrap.split_capture; docs/exporters.md).",
    )
    intra_op_threads: int = _opt(
        0,
        "ORTWRAP_INTRA_OP_THREADS",
        "ONNX Runtime intra-op threads; 0 means torch.get_num_threads() at session creation, or 1 for a CPU "
        "training graph of small kernels, where ORT's pool costs more than it saves (gemm_choice.decide_pool).",
    )
    inline_functions: tuple[str, ...] = _opt(
        (),
        "ORTWRAP_INLINE_FUNCTIONS",
        "Qualified names (module.QualName) of torch.autograd.Functions to inline: their forward's ops are "
        "exported and differentiated by ONNX Runtime instead of running the Function as a PythonOp. "
        "Environment: comma-separated.",
    )
    aten_ops: tuple[str, ...] = _opt(
        (),
        "ORTWRAP_ATEN_OPS",
        "Names of aten ops (e.g. 'gelu', 'embedding') to run with PyTorch's own kernels and gradients inside the "
        "ONNX Runtime graph (ATen nodes). Ops without an ONNX export always run that way. Environment: comma-separated.",
    )
    verify: bool = _opt(
        False,
        "ORTWRAP_VERIFY",
        "Check the first step of every new build against eager PyTorch (outputs, updated buffers, the gradients of "
        "every trainable parameter and input) and raise VerificationError on a mismatch. Costs one eager and one "
        "extra ORT forward+backward per build; skipped, with a warning, for graphs with random ops (dropout).",
    )
    allow_spinning: bool = _opt(
        False,
        "ORTWRAP_ALLOW_SPINNING",
        "Let ORT's idle threads spin. Off by default: spinning threads fight PyTorch's OpenMP threads "
        "between ORT runs and make training steps several times slower on small machines.",
    )
    native_kernels: bool = _opt(
        True,
        "ORTWRAP_NATIVE_KERNELS",
        "On CPU, train GELU (erf and tanh), LayerNorm, GroupNorm/InstanceNorm, softmax, cross-entropy, embedding lookups, hardtanh/relu6 and max pooling with ortwrap's own kernels (compiled for this "
        "machine on first use) instead of ONNX Runtime's much slower CPU kernels for them (docs/performance.md).",
    )
    fusions: bool = _opt(
        True,
        "ORTWRAP_FUSIONS",
        "Fuse GELU, LayerNorm and RMSNorm into single ops before ORT partitions the graph: the standard "
        "Gelu/LayerNormalization where the opset has them, ORT's contrib ops otherwise (docs/performance.md).",
    )
    fuse_initializers: bool = _opt(
        False,
        "ORTWRAP_FUSE_INITIALIZERS",
        "On CPU, feed frozen (requires_grad=False) bfloat16/float16 parameters and buffers to ORT as float32 copies "
        "made once and remade only when the tensor changes (its version counter), instead of a Cast on every step "
        "(ORT PR 24175's idea). Saves the per-step casts of e.g. a bf16 base model with fp32 adapters; costs the "
        "float32 copies' memory between steps (docs/performance.md).",
    )
    half_compute: str = _opt(
        "auto",
        "ORTWRAP_HALF_COMPUTE",
        f"On CPU, how the bfloat16 parts of a graph (torch.autocast, a model.to(torch.bfloat16)) compute, one of "
        f"{', '.join(_HALF_COMPUTE)}. 'float32': everything between eager's bf16 boundaries in float32 (ONNX "
        "Runtime has no bf16 CPU kernels). 'native': the bf16 MatMul/Gemm (Linear layers, attention matmuls) run "
        "as PyTorch's bf16 GEMMs inside the graph, saving bf16 copies of their inputs for the backward as eager autocast does (of the weights "
        "only with recompute='none'); the "
        "rest in float32. 'auto': per graph, whichever of PyTorch's bf16 GEMMs and MLAS's float32 ones is faster "
        "on the graph's own GEMM shapes, measured once per machine and cached (gemm_choice.py; 'float32' on a CPU "
        "without bf16 instructions and for graphs with few GEMM FLOPs; docs/performance.md). float16 always "
        "computes in float32.",
    )
    gemm: str = _opt(
        "auto",
        "ORTWRAP_GEMM",
        f"On CPU, which library runs the float32 MatMul/Gemm (Linear layers) and attention of a graph, one of "
        f"{', '.join(_GEMM)}. 'ort': ONNX Runtime's MLAS. 'torch': PyTorch's GEMMs and CPU flash attention inside "
        "the graph (ATen nodes with explicit backward ops; attention then keeps no T x T probabilities). 'auto' "
        "(the default): per graph, whichever of the two is faster on the graph's own GEMM shapes, measured once "
        "per machine and thread count and cached (gemm_choice.py; 'ort' for graphs with few GEMM FLOPs; "
        "docs/performance.md).",
    )
    cpu_region: bool = _opt(
        True,
        "ORTWRAP_CPU_REGION",
        "On CPU on Linux, while ONNX Runtime runs a graph in which PyTorch computes something (the native bf16 route, "
        "gemm='torch', Functions, ATen ops), PyTorch's, ORT's and ortwrap's kernels' blocks of 1 MiB or more come from "
        "one best-fit region whose freed blocks merge, instead of glibc's heap, where the libraries' blocks alternate "
        "and the small chunks glibc caches between them keep freed memory from merging (GPT-2 small under bf16 "
        "autocast: peak RSS ~10% lower, 0.93-0.95x eager; runtime/cpu_region.py, compiled on first use with the "
        "system C++ compiler against torch's headers; docs/performance.md). Same results either way.",
    )
    build_cache: bool = _opt(
        True,
        "ORTWRAP_BUILD_CACHE",
        "Keep built graphs in a cache directory that survives the process (ORTWRAP_BUILD_CACHE_DIR, default "
        "<ORTWRAP_CACHE_DIR>/builds, capped at ORTWRAP_BUILD_CACHE_MAX_MB), keyed by the captured graph with its "
        "constants, the input schema, the options and the versions: a second process captures the forward again "
        "and skips translation, passes and the gradient build. Entries are signed with a per-user secret "
        "(docs/user-guide.md, 'The build cache').",
    )
    recompute: str = _opt(
        "cheap",
        "ORTWRAP_RECOMPUTE",
        "Activation recompute, one of none, cheap, layers. 'cheap' (the default) recomputes in the backward the "
        "stashed activations that a few cheap forward nodes compute from values the backward keeps anyway: the "
        "attention probabilities (from the scaled q and k^T and the mask), the GELU and LayerNorm outputs; about "
        "1% more work, a transformer's activation memory down by ~40%; on the native bf16 route also the bf16 "
        "GELU, and the bf16 weight copies (the backward casts the weights again). 'layers' keeps only the residual stream "
        "between sublayers (checkpoints) from the forward to the backward and recomputes the rest of each segment "
        "in the backward: much less memory for activations, for about one more forward per step. 'none' keeps "
        "every activation the backward reads (docs/performance.md).",
    )
    aggressive_cpu_fallback: bool = _opt(
        False,
        "ORTWRAP_AGGRESSIVE_CPU_FALLBACK",
        "Move the nodes that compute shapes (Reshape's shape, Slice's starts, Range's inputs, ...) out of the graph "
        "into a host-side shape program run on the CPU before each step, so that kernels get them without a "
        "device round trip (docs/cpu-fallback.md). Also read from ORT_AGGRESSIVE_CPU_FALLBACK, upstream's name.",
        aliases=("ORT_AGGRESSIVE_CPU_FALLBACK",),
    )
    zero3_gather: str = _opt(
        "module",
        "ORTWRAP_ZERO3_GATHER",
        f"Under DeepSpeed ZeRO-3, one of {', '.join(_ZERO3_GATHER)}: 'module' gathers the whole wrapped module's "
        "parameters for each step; 'submodule' gathers each submodule's parameters inside the graph when ONNX "
        "Runtime reaches it, and again in the backward, as eager ZeRO-3 does (either exporter; "
        "docs/distributed.md).",
    )

    def __post_init__(self) -> None:
        if self.log_level is not None:
            try:
                object.__setattr__(self, "log_level", parse_log_level(self.log_level))
            except ValueError as e:
                raise ValueError(f"ORTWrap option log_level={self.log_level!r} is invalid: {e}") from None
        if self.exporter not in EXPORTER_CHOICES:
            raise ValueError(
                f"ORTWrap option exporter={self.exporter!r} is invalid; allowed: {', '.join(EXPORTER_CHOICES)}"
            )
        if self.engine not in _ENGINES:
            raise ValueError(f"ORTWrap option engine={self.engine!r} is invalid; allowed: {', '.join(_ENGINES)}")
        if self.zero3_gather not in _ZERO3_GATHER:
            raise ValueError(
                f"ORTWrap option zero3_gather={self.zero3_gather!r} is invalid; allowed: {', '.join(_ZERO3_GATHER)}"
            )

        if self.half_compute not in _HALF_COMPUTE:
            raise ValueError(
                f"ORTWrap option half_compute={self.half_compute!r} is invalid; allowed: {', '.join(_HALF_COMPUTE)}"
            )
        if self.gemm not in _GEMM:
            raise ValueError(f"ORTWrap option gemm={self.gemm!r} is invalid; allowed: {', '.join(_GEMM)}")
        if self.recompute not in _RECOMPUTE:
            raise ValueError(
                f"ORTWrap option recompute={self.recompute!r} is invalid; allowed: {', '.join(_RECOMPUTE)}"
            )
        if not 7 <= int(self.opset) <= 20:
            raise ValueError(f"ORTWrap option opset={self.opset!r} is invalid; the TorchScript exporter takes 7..20")
        for name in ("inline_functions", "aten_ops"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        if int(self.intra_op_threads) < 0:
            raise ValueError(f"ORTWrap option intra_op_threads={self.intra_op_threads!r} must be >= 0")

    @classmethod
    def resolve(cls, **overrides: Any) -> Options:
        """Options from keyword overrides, then environment variables, then defaults.

        Raises:
            TypeError: for an unknown keyword, listing the known ones.
            ValueError: for a bad value, from the keyword or the environment, naming its source.
        """
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise TypeError(f"ORTWrap got unknown option(s) {unknown}; known options: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, f in known.items():
            if name in overrides:
                values[name] = overrides[name]
                continue
            env = f.metadata.get("env")
            raw = os.environ.get(env) if env else None
            for alias in f.metadata.get("aliases", ()):
                if raw is None or raw == "":
                    env, raw = alias, os.environ.get(alias)
            if raw is None or raw == "":
                # (ORTMODULE_LOG_LEVEL is the process's verbosity, read at import: not a wrapper's option)
                value = _from_ortmodule(name) if name != "log_level" else None
                if value is not None:
                    values[name] = value
                continue
            try:
                values[name] = _parse(raw, f.default)
            except ValueError as e:
                raise ValueError(f"environment variable {env}={raw!r} is invalid: {e}") from e
        return cls(**values)

    @property
    def exporters(self) -> tuple[str, ...]:
        """The exporters to try, in order: the chosen one, or for ``"auto"`` the release's default
        first and the TorchScript exporter after it (while torch still ships it)."""
        if self.exporter != "auto":
            return (self.exporter,)
        from ._compat.torch import default_exporter

        first = default_exporter()
        return (first, "torchscript") if first != "torchscript" else (first,)

    @property
    def native_bf16(self) -> bool | None:
        """Whether bfloat16 GEMMs run in bfloat16 on CPU (``half_compute``); None for ``"auto"``,
        which each build decides by measurement (``gemm_choice.py``)."""
        return None if self.half_compute == "auto" else self.half_compute == "native"

    @property
    def torch_gemm(self) -> bool | None:
        """Whether float32 GEMMs and attention run as PyTorch's on CPU (``gemm``); None for ``"auto"``,
        which each build decides by measurement (``gemm_choice.py``)."""
        return None if self.gemm == "auto" else self.gemm == "torch"


def parse_log_level(level: int | str) -> int:
    """A ``logging`` level from an int (``logging.INFO``) or a level's name (``"info"``, ``"CRITICAL"``).

    Raises:
        ValueError: naming the allowed names.
    """
    if isinstance(level, bool):
        raise ValueError(f"expected a logging level (an int) or one of {', '.join(_LOG_LEVELS)}")
    if isinstance(level, int):
        return level
    name = str(level).strip().upper()
    name = {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(name, name)
    if name.isdigit():
        return int(name)
    if name not in _LOG_LEVELS:
        raise ValueError(f"allowed: {', '.join(_LOG_LEVELS)} or a logging level (an int)")
    return getattr(logging, name)


def env_log_level() -> int | None:
    """``ORTWRAP_LOG_LEVEL`` (else ORTModule's ``ORTMODULE_LOG_LEVEL``, with a warning): ortwrap's
    verbosity for the process, read once when ortwrap is imported; None when neither is set."""
    raw = os.environ.get("ORTWRAP_LOG_LEVEL")
    if raw:
        try:
            return parse_log_level(raw)
        except ValueError as e:
            raise ValueError(f"environment variable ORTWRAP_LOG_LEVEL={raw!r} is invalid: {e}") from None
    return _from_ortmodule("log_level")


# ------------------------------------------------------------------------------------ ORTModule's variables


def _ortmodule_log_level(raw: str) -> int:
    # ORTModule's LogLevel: VERBOSE, DEVINFO (for ORT's developers), INFO, WARNING, ERROR, FATAL.
    names = {"VERBOSE": logging.DEBUG, "DEVINFO": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
             "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}  # fmt: skip
    if raw.strip().upper() not in names:
        raise ValueError(f"expected one of {', '.join(names)}")
    return names[raw.strip().upper()]


def _ortmodule_fallback(raw: str) -> bool:
    # ORTModule's _FallbackPolicy names one policy; FALLBACK_DISABLE raises, every other falls back.
    if not raw.strip().upper().startswith("FALLBACK_"):
        raise ValueError("expected a _FallbackPolicy name such as FALLBACK_DISABLE")
    return raw.strip().upper() != "FALLBACK_DISABLE"


def _ortmodule_recompute(raw: str) -> str | None:
    # ORTModule's memory optimization level: 0 its own config file (no equivalent), 1 and 2 per-layer recompute.
    level = int(raw)
    return "layers" if level in (1, 2) else None


#: ORTModule's environment variables that have a direct ortwrap equivalent: variable -> (option,
#: ortwrap's own variable, the conversion of its value). Read when ortwrap's own variable is not
#: set, with a FutureWarning that names ortwrap's option; docs/user-guide.md maps the others.
ORTMODULE_ENV_VARS: dict[str, tuple[str, str, Any]] = {
    "ORTMODULE_LOG_LEVEL": ("log_level", "ORTWRAP_LOG_LEVEL", _ortmodule_log_level),
    "ORTMODULE_ONNX_OPSET_VERSION": ("opset", "ORTWRAP_OPSET", int),
    "ORTMODULE_FALLBACK_POLICY": ("fallback", "ORTWRAP_FALLBACK", _ortmodule_fallback),
    "ORTMODULE_MEMORY_OPT_LEVEL": ("recompute", "ORTWRAP_RECOMPUTE", _ortmodule_recompute),
}

_ortmodule_warned: set[tuple[str, str]] = set()


def _from_ortmodule(option: str) -> Any:
    """The value of ``option`` from ORTModule's variable for it, if one is set (else None), said
    once per variable and value."""
    import warnings

    for env, (name, own, convert) in ORTMODULE_ENV_VARS.items():
        raw = os.environ.get(env)
        if name != option or raw is None or raw.strip() == "":
            continue
        try:
            value = convert(raw)
        except ValueError as e:
            raise ValueError(f"environment variable {env}={raw!r} (ORTModule's) is invalid: {e}") from None
        if (env, raw) not in _ortmodule_warned:
            _ortmodule_warned.add((env, raw))
            setting = f"set_verbosity({logging.getLevelName(value)!r})" if name == "log_level" else f"{name}={value!r}"
            warnings.warn(
                f"{env}={raw} is ORTModule's variable; ortwrap reads it as "
                + (f"ortwrap.{setting}" if name == "log_level" else f"ORTWrap(..., {setting})")
                + (f". Set {own} instead" if value is not None else ", which has no ortwrap equivalent: ignored")
                + " (docs/user-guide.md, 'Coming from ORTModule').",
                FutureWarning,
                stacklevel=2,
            )
        return value
    return None


def _parse(raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected one of 1/0/true/false/yes/no/on/off")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, tuple):
        return tuple(x.strip() for x in raw.split(",") if x.strip())
    return raw


def env_flag(name: str, default: bool) -> bool:
    """A boolean environment variable that is not an ORTWrap option (read at import time).

    ``ORTWRAP_PRELOAD_CUDA`` (default 1): with the CUDA build, load the CUDA 11.8 / cuDNN 8
    libraries of the ``nvidia-*-cu11`` wheels before importing onnxruntime.
    """
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return _parse(raw, default)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is invalid: {e}") from e


def c_compiler_override() -> str | None:
    """``$CC``, if set: the compiler for ortwrap's native helpers."""
    return os.environ.get("CC") or None


def cxx_compiler_override() -> str | None:
    """``$CXX``, if set: the compiler for ortwrap's one C++ helper (``_compat/_cpu_region.cpp``)."""
    return os.environ.get("CXX") or None


def cache_dir() -> str:
    """Where ortwrap caches its compiled native helpers: ``$ORTWRAP_CACHE_DIR`` or ``~/.cache/ortwrap``."""
    return os.environ.get("ORTWRAP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ortwrap")


def build_cache_dir() -> str:
    """Where built graphs are cached: ``$ORTWRAP_BUILD_CACHE_DIR`` or ``<cache_dir()>/builds``."""
    return os.environ.get("ORTWRAP_BUILD_CACHE_DIR") or os.path.join(cache_dir(), "builds")


#: The build cache's default size cap, in MiB (``ORTWRAP_BUILD_CACHE_MAX_MB``).
BUILD_CACHE_MAX_MB = 1024


def build_cache_max_bytes() -> int:
    """The build cache's size cap: ``$ORTWRAP_BUILD_CACHE_MAX_MB`` MiB (default 1024); least
    recently used entries are deleted beyond it."""
    raw = os.environ.get("ORTWRAP_BUILD_CACHE_MAX_MB") or str(BUILD_CACHE_MAX_MB)
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(
            f"environment variable ORTWRAP_BUILD_CACHE_MAX_MB={raw!r} is invalid: expected a number"
        ) from None
    return int(max(mb, 0.0) * (1 << 20))


def build_cache_secret_path() -> tuple[str, bool]:
    """The file holding the secret build cache entries are signed with, and whether the user named
    it: ``$ORTWRAP_BUILD_CACHE_SECRET``, else ``~/.cache/ortwrap/build-cache.secret``, which is the
    user's own whatever ``ORTWRAP_CACHE_DIR`` says (a shared cache directory must not hold the key
    that makes its entries trusted; ``build/cache.py``)."""
    explicit = os.environ.get("ORTWRAP_BUILD_CACHE_SECRET")
    if explicit:
        return explicit, True
    return os.path.join(os.path.expanduser("~"), ".cache", "ortwrap", "build-cache.secret"), False


#: Environment variable -> (option name, help). Documented in docs/user-guide.md.
ENV_VARS: dict[str, tuple[str, str]] = {
    env: (f.name, f.metadata["help"])
    for f in dataclasses.fields(Options)
    if f.metadata.get("env")
    for env in (f.metadata["env"], *f.metadata.get("aliases", ()))
}
ENV_VARS["ORTWRAP_LOG_LEVEL"] = (
    "log_level",
    f"ortwrap's verbosity for the process (ortwrap.set_verbosity), read once at import: one of "
    f"{', '.join(_LOG_LEVELS)} or a logging level. INFO: a summary line per build, progress while a long build "
    "runs; DEBUG: also ONNX Runtime's C++ log.",
)
