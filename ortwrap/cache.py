"""A persistent build cache: a second process skips export, passes and the gradient build.

A build's key is a hash of everything that decides the graph, computed without exporting:

- the module: every submodule's class, name and ``training`` flag; the names, shapes, dtypes and
  ``requires_grad`` of its parameters and buffers (not their values: they are graph inputs); its
  plain attributes (numbers, strings, containers of them, configs with ``to_dict()``, such as
  transformers' ``PretrainedConfig``), the plain values its classes hold (a class-level flag the
  forward reads, changed at run time), and the bytes of tensors it keeps outside parameters and
  buffers (the graph bakes those in);
- the code: the source file of every class in the module tree and its bases, or, for classes
  installed as a package (torch, transformers, ...), that package's version;
- the input schema ortwrap keys its programs by (structure, constants, per tensor rank, dtype,
  device, ``requires_grad``; train/eval; backward or not) and, for programs with static
  dimensions, the shape;
- the options that shape the graph, the machine's CPU kernel flags, and the versions of Python,
  torch, onnxruntime, onnx, onnxscript and ortwrap (with a hash of ortwrap's own source, so an
  edited checkout never loads what an older one built).

An entry holds the built graph (ORT's forward+backward model), its ``GraphInfo``, how flat inputs,
parameters, buffers and outputs map to the graph, the shape guards, and the exported and
pre-gradient models for ``last_artifacts``. Loading one costs a session creation.

NOTE: what the key cannot see: code outside the files of the module's classes that the forward
calls (a helper in another file of yours), and global state the forward reads. Edit such code with
``build_cache=False`` (``ORTWRAP_BUILD_CACHE=0``), or delete the cache directory.

Graphs that call ``torch.autograd.Function``s (PythonOps) are not cached: their nodes point at
Python objects of the process that built them. An output ORTWrap cannot take apart (kept as the
object the export built, such as transformers' ``DynamicCache`` in ``past_key_values``) is stored
when it pickles; one that does not (the dynamo capture leaves fake tensors in it) is stored as
``None``, and the process that loads the entry says so once (``portable_out_spec``).

Entries are written atomically (a temporary file, then ``os.replace``): a crash mid-write leaves no
entry, never half of one. Each entry carries a checksum; one that fails to load (corrupt, or written
by an incompatible ortwrap) is deleted and rebuilt, with a warning.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import io
import os
import pickle
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._compat import torch as compat
from ._logging import logger

__all__ = ["BuildCacheWarning", "CacheEntry", "build_key", "load", "portable_out_spec", "store"]

#: Bumped when the entry format changes: older entries are ignored.
FORMAT = 2
_MAGIC = b"ORTWRAP-BUILD\n"
#: Tensors kept as plain attributes up to this size are hashed by value; a larger one makes the
#: module uncacheable (hashing it would cost more than the cache saves).
_MAX_HASHED_TENSOR_BYTES = 16 << 20


class BuildCacheWarning(UserWarning):
    """A build cache entry could not be used (corrupt or unreadable): it was rebuilt."""


class Uncacheable(Exception):
    """This build cannot be cached (the message says why)."""


@dataclass
class CacheEntry:
    """What a build leaves for the next process (see the module docstring)."""

    model_bytes: bytes
    graph: Any  # grad.TrainingGraph
    exported: bytes  # the exported model, serialized
    pre_grad: bytes  # the pre-gradient model, serialized
    user_input_names: list
    output_names: list
    out_spec: tuple
    state_names: dict[str, str]  # graph input name -> the module's parameter or buffer name
    buffer_outputs: dict[str, str]  # graph output name -> the module's buffer name
    static_reasons: list[str]
    static_spatial: bool
    shape_guards: Any
    exporter: str
    exports: int
    pass_names: list[str] = field(default_factory=list)
    static_shape: tuple | None = None  # the non-batch dims a static_spatial graph was built for
    #: outputs kept as opaque objects that could not be stored (returned as None): "`path` (type)"
    dropped_outputs: list[str] = field(default_factory=list)


def portable_out_spec(spec: tuple, path: str = "output") -> tuple[tuple, list[str]]:
    """``spec`` (``_tree.flatten``'s) with every opaque output object that does not pickle replaced
    by None, and the list of those replaced ("`path` (module.Class)").

    An opaque output is the object the export built (``export/adapter.py``); one that holds fake
    tensors (a dynamo capture's ``DynamicCache``) cannot be pickled, and without this the whole
    entry was not stored: every process exported again.
    """
    kind = spec[0]
    if kind == "O":
        try:
            pickle.dumps(spec[1], protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            cls = type(spec[1])
            return ("O", None), [f"`{path}` ({cls.__module__}.{cls.__qualname__})"]
        return spec, []
    dropped: list[str] = []
    if kind == "S":
        children = []
        for i, child in enumerate(spec[2]):
            c, d = portable_out_spec(child, f"{path}[{i}]")
            children.append(c)
            dropped += d
        return (kind, spec[1], tuple(children)), dropped
    if kind in ("M", "D"):
        children = []
        for name, child in zip(spec[2], spec[3]):
            c, d = portable_out_spec(child, f"{path}[{name!r}]" if kind == "M" else f"{path}.{name}")
            children.append(c)
            dropped += d
        return (kind, spec[1], spec[2], tuple(children)), dropped
    return spec, []


# ------------------------------------------------------------------------------------------- the key


def _versions() -> tuple:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    from . import __version__ as ortwrap_version

    ortwrap_version = f"{ortwrap_version}+{_own_code()}"

    ort = "-"
    for dist in ("onnxruntime-training-cpu", "onnxruntime-training"):
        if version(dist) != "-":
            ort = f"{dist}=={version(dist)}"
    return (
        FORMAT,
        sys.version_info[:3],
        torch.__version__,
        ort,
        version("onnx"),
        version("onnxscript"),
        version("onnx-ir"),
        ortwrap_version,
    )


_own_code_hash: list[str] = []


def _own_code() -> str:
    """A hash of ortwrap's own source (Python and C): an edited ortwrap (a development checkout, a
    patched install) never loads graphs an older one built."""
    if not _own_code_hash:
        root = os.path.dirname(os.path.abspath(__file__))
        h = hashlib.sha256()
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith((".py", ".c")):
                    with open(os.path.join(dirpath, name), "rb") as f:
                        h.update(name.encode() + b"\0" + f.read())
        _own_code_hash.append(h.hexdigest()[:16])
    return _own_code_hash[0]


_file_hashes: dict[str, str] = {}


def _class_code(cls: type) -> str:
    """What identifies the code of ``cls``: its package's version if installed as a distribution,
    else the hash of its source file."""
    module_name = getattr(cls, "__module__", "") or ""
    top = module_name.split(".")[0]
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        path = None
    if path is None:
        return f"{module_name}:?"
    if "site-packages" in path or "dist-packages" in path:
        try:
            return f"{top}=={importlib.metadata.version(top)}"
        except importlib.metadata.PackageNotFoundError:
            pass
    digest = _file_hashes.get(path)
    if digest is None:
        try:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            digest = "?"
        _file_hashes[path] = digest
    return f"{path}:{digest}"


def _plain(value: Any, depth: int = 0) -> Any:
    """A hashable description of an attribute value, or raise Uncacheable."""
    if depth > 6:
        return "..."
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return (type(value).__name__, repr(value))
    if isinstance(value, torch.Tensor):
        if value.numel() * value.element_size() > _MAX_HASHED_TENSOR_BYTES:
            raise Uncacheable(f"a {tuple(value.shape)} tensor kept as a plain attribute")
        data = value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if value.numel() else b""
        return ("tensor", str(value.dtype), tuple(value.shape), hashlib.sha256(data).hexdigest())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_plain(v, depth + 1) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), _plain(v, depth + 1)) for k, v in value.items())))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(v) for v in value)))
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):  # transformers' configs
        try:
            return (type(value).__qualname__, _plain(to_dict(), depth + 1))
        except Exception:
            pass
    if isinstance(value, nn.Module):
        return ("module", type(value).__qualname__)
    if callable(value):
        return _callable(value, depth)
    return ("object", type(value).__module__, type(value).__qualname__)


def _code(code: Any, depth: int) -> tuple:
    consts = tuple(_code(c, depth + 1) if inspect.iscode(c) else repr(c) for c in code.co_consts)
    return (code.co_name, code.co_code, consts, code.co_names)


def _callable(fn: Any, depth: int) -> tuple:
    """What a callable attribute computes: a function's bytecode, constants, defaults and closure
    values (two lambdas differ even though both are named ``<lambda>``); a partial's function and
    arguments; a bound method's function and owner class; else its type."""
    import functools
    import types

    if isinstance(fn, functools.partial):
        return ("partial", _callable(fn.func, depth + 1), _plain(fn.args, depth + 1), _plain(fn.keywords, depth + 1))
    if isinstance(fn, types.MethodType):
        return ("method", type(fn.__self__).__qualname__, _callable(fn.__func__, depth + 1))
    if isinstance(fn, types.FunctionType):
        cells = tuple(_plain(c.cell_contents, depth + 1) for c in fn.__closure__ or () if _cell_set(c))
        return (
            "function",
            fn.__module__,
            fn.__qualname__,
            _code(fn.__code__, depth),
            _plain(fn.__defaults__, depth + 1),
            cells,
        )
    return ("callable", type(fn).__module__, getattr(fn, "__qualname__", type(fn).__qualname__))


def _cell_set(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


#: Class attributes whose values enter the key (methods, properties and descriptors are code).
_CLASS_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset, torch.dtype)


def _module_fingerprint(module: nn.Module) -> tuple:
    parts: list = []
    classes: set[type] = set()
    skip = compat.module_internal_attributes()
    for name, sub in module.named_modules(remove_duplicate=False):
        classes.update(c for c in type(sub).__mro__ if c not in (object, nn.Module))
        attrs = []
        for key, value in vars(sub).items():
            if key in skip:
                continue
            attrs.append((key, _plain(value)))
        params = tuple(
            (n, tuple(p.shape), str(p.dtype), bool(p.requires_grad), p.device.type)
            for n, p in compat.parameter_table(sub).items()
            if p is not None
        )
        buffers = tuple(
            (n, tuple(b.shape), str(b.dtype), n in compat.non_persistent_buffers(sub), b.device.type)
            for n, b in compat.buffer_table(sub).items()
            if b is not None
        )
        parts.append((name, type(sub).__module__, type(sub).__qualname__, sub.training, params, buffers, tuple(attrs)))
    code = tuple(sorted(_class_code(c) for c in classes))
    # Class-level settings a forward reads (``factor = 1.0`` on the class, changed at run time by a
    # config or a test): the source file does not change, so the values themselves are keyed.
    class_values = tuple(
        sorted(
            (c.__module__, c.__qualname__, name, repr(_plain(value)))
            for c in classes
            for name, value in vars(c).items()
            if not name.startswith("__") and isinstance(value, _CLASS_VALUE_TYPES)
        )
    )
    # A class defined inside a function can close over that function's variables (a test's
    # parametrized equation, say): its methods' closure values are part of its code.
    closures = tuple(
        sorted(
            (
                c.__qualname__,
                name,
                repr(_plain(fn.__closure__ and tuple(x.cell_contents for x in fn.__closure__ if _cell_set(x)))),
            )
            for c in classes
            if "<locals>" in c.__qualname__
            for name, fn in vars(c).items()
            if inspect.isfunction(fn) and fn.__closure__
        )
    )
    return tuple(parts), code, class_values, closures


def build_key(module: nn.Module, schema: Any, shape: Any, options: Any, native: bool) -> str:
    """The cache key of a build (see the module docstring).

    Raises:
        Uncacheable: the module holds something the key cannot describe.
    """
    h = hashlib.sha256()
    graph_options = (
        options.exporters,
        options.opset,
        options.inline_functions,
        options.aten_ops,
        options.aggressive_cpu_fallback,
        options.native_kernels,
        options.recompute,
        options.fusions,
        options.fuse_initializers,
        options.zero3_gather,
    )
    cpu = _cpu_flags() if native else ()
    for part in (_versions(), _module_fingerprint(module), repr(schema), repr(shape), graph_options, native, cpu):
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def _cpu_flags() -> tuple:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    return tuple(sorted(flags))


# ------------------------------------------------------------------------------------------- storage


def _path(directory: str, key: str) -> str:
    return os.path.join(directory, f"{key}.build")


def store(directory: str, key: str, entries: list[CacheEntry]) -> str | None:
    """Write the entries of ``key`` (one per shape-specialization) atomically; return the path (None
    if they could not be written)."""
    try:
        buf = io.BytesIO()
        pickle.dump(entries, buf, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # an output structure whose classes cannot be pickled, ...
        logger.info("build cache: not storing %s (%s: %s)", key, type(e).__name__, e)
        return None
    payload = buf.getvalue()
    digest = hashlib.sha256(payload).hexdigest().encode()
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + digest + b"\n" + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, _path(directory, key))
    except OSError as e:
        logger.info("build cache: could not write %s: %s", key, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return None
    return _path(directory, key)


def load(directory: str, key: str) -> list[CacheEntry] | None:
    """The entries stored under ``key``, or None. A corrupt file is deleted, with a warning."""
    path = _path(directory, key)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.info("build cache: could not read %s: %s", path, e)
        return None
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("not an ortwrap build cache entry")
        header, _, payload = data[len(_MAGIC) :].partition(b"\n")
        if hashlib.sha256(payload).hexdigest().encode() != header:
            raise ValueError("checksum mismatch")
        entries = pickle.loads(payload)
        if not isinstance(entries, list) or not all(isinstance(e, CacheEntry) for e in entries):
            raise ValueError(f"unexpected content {type(entries).__name__}")
        return entries
    except Exception as e:
        warnings.warn(
            f"ortwrap: the build cache entry {path} is unusable ({type(e).__name__}: {e}); it was deleted and the "
            "graph is rebuilt",
            BuildCacheWarning,
            stacklevel=2,
        )
        try:
            os.unlink(path)
        except OSError:
            pass
        return None
