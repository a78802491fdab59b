"""A persistent build cache: a second process skips translation, passes and the gradient build.

NOTE: soundness. The cache must never return a program that differs from what a fresh build of the
same code and inputs gives. A key computed from the module before capture (its classes' source
files, its attributes) cannot promise that: the forward may call a helper in another file, read a
module-level constant, a closure variable, a monkeypatched method, a config field, a global flag.
So, as torch's FX graph cache does, the key is computed from what the program is built *from*, after
the capture (which always runs):

- the captured graph with its constants: for the dynamo exporter, every node of the
  ``torch.export`` graph (op, target, arguments, the dtype, symbolic shape and device of its value,
  its module path) and of its subgraphs, the graph signature, the range constraints and the bytes of
  every lifted constant tensor (a tensor attribute, a 0-d counter); for the TorchScript exporter,
  the ONNX model its trace wrote (constants included). Everything a Python edit can change and the
  build depends on is in there, or in the capture's output structure (its tree spec and constants,
  also keyed);
- the module's state table: names, shapes, dtypes, devices and ``requires_grad`` of its parameters
  and buffers (their values are graph inputs, fed each step, never built in);
- the input schema ortwrap keys its programs by (structure, constants, per tensor rank, dtype,
  device, ``requires_grad``; train/eval; backward or not; autocast) and the exporter;
- the options that shape the graph, the machine's CPU flags where the native kernels serve the
  build, and the versions of Python, torch, onnxruntime, onnx, onnxscript, onnx-ir, transformers
  and ortwrap (with a hash of ortwrap's own source, so an edited checkout never loads what an older
  one built).

Everything after the capture (translation, passes, gradient build) is a deterministic function of
those, so a hit is what a fresh build would give. The capture itself is the price: a cached
process still traces the forward once per input schema (docs/performance.md, "Build cache").

An entry holds the built graph (ORT's forward+backward model), its ``GraphInfo``, how flat inputs,
parameters, buffers and outputs map to the graph, the shape guards, and the exported and
pre-gradient models for ``last_artifacts``. Loading one costs a session creation.

Graphs that call ``torch.autograd.Function``s (PythonOps) are not cached: their nodes point at
Python objects of the process that built them. An output ORTWrap cannot take apart (kept as the
object the export built, such as transformers' ``DynamicCache`` in ``past_key_values``) is stored
when it pickles; one that does not (the dynamo capture leaves fake tensors in it) is stored as
``None``, and the process that loads the entry says so once (``portable_out_spec``).

NOTE: security. Entries are pickles, and unpickling runs code. Each entry is signed with
HMAC-SHA256 under a per-user secret (``options.build_cache_secret_path()``: 32 random bytes in
``~/.cache/ortwrap/build-cache.secret``, created 0600, never inside ``ORTWRAP_BUILD_CACHE_DIR``
or ``ORTWRAP_CACHE_DIR`` when those point elsewhere: a directory shared with others must not hold
the key that makes its files trusted). The signature is checked before anything is unpickled; a
file someone else dropped there (or an entry another user signed) is ignored with a warning and
rebuilt. Users who share a cache on purpose point ``ORTWRAP_BUILD_CACHE_SECRET`` at one secret
file that only they can read.

Entries are written atomically (a temporary file, then ``os.replace``): a crash mid-write leaves no
entry, never half of one. The directory is kept under a size cap (``ORTWRAP_BUILD_CACHE_MAX_MB``,
default 1024): after each store the least recently used entries (by modification time, which a
load refreshes) are deleted. ``python -m ortwrap cache info`` and ``... cache clear`` show and
empty it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import importlib.metadata
import io
import os
import pickle
import secrets
import stat
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._compat import torch as compat
from .._logging import logger
from ..options import build_cache_max_bytes, build_cache_secret_path

__all__ = [
    "BuildCacheWarning",
    "CacheEntry",
    "Uncacheable",
    "build_key",
    "clear",
    "entries_info",
    "evict",
    "load",
    "portable_out_spec",
    "store",
]

#: Bumped when the entry format changes: older entries are ignored.
FORMAT = 3
_MAGIC = b"ORTWRAP-BUILD\n"
_SIGNATURE = b"hmac-sha256:"
#: Lifted constant tensors larger than this make the build uncacheable (hashing them would cost
#: more than the cache saves).
_MAX_HASHED_TENSOR_BYTES = 64 << 20


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


def _dist_version(dist: str) -> str:
    """The installed version of distribution ``dist``, or ``"-"``."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


@functools.cache
def _versions() -> tuple:
    """Python's and every library's version that decides what a build produces (read once per
    process: ``_versions.cache_clear()`` reads them again)."""
    from .._version import __version__ as ortwrap_version

    ort = "-"
    for dist in ("onnxruntime-training-cpu", "onnxruntime-training", "onnxruntime"):
        if _dist_version(dist) != "-":
            ort = f"{dist}=={_dist_version(dist)}"
            break
    return (
        ("format", FORMAT),
        ("python", sys.version_info[:3]),
        ("torch", torch.__version__, _dist_version("torch")),
        ("onnxruntime", ort),
        ("onnx", _dist_version("onnx")),
        ("onnxscript", _dist_version("onnxscript")),
        ("onnx-ir", _dist_version("onnx-ir")),
        # its models' code, config classes and cache layers shape the graphs of HF models
        ("transformers", _dist_version("transformers")),
        ("ortwrap", f"{ortwrap_version}+{_own_code()}"),
    )


_own_code_hash: list[str] = []


def _own_code() -> str:
    """A hash of ortwrap's own source (Python and C): an edited ortwrap (a development checkout, a
    patched install) never loads graphs an older one built."""
    if not _own_code_hash:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package
        h = hashlib.sha256()
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith((".py", ".c")):
                    with open(os.path.join(dirpath, name), "rb") as f:
                        h.update(name.encode() + b"\0" + f.read())
        _own_code_hash.append(h.hexdigest()[:16])
    return _own_code_hash[0]


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (0-d tensors included: ``view(torch.uint8)``
    refuses a 0-d tensor of a wider dtype, so the bytes are read from a 1-d view).

    Raises:
        Uncacheable: the tensor is too large to hash, or has no bytes to read (a fake or meta tensor).
    """
    nbytes = t.numel() * t.element_size()
    if nbytes > _MAX_HASHED_TENSOR_BYTES:
        raise Uncacheable(f"a {tuple(t.shape)} constant tensor ({nbytes >> 20} MiB) is built into the graph")
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        try:
            flat = t.detach().cpu().contiguous().reshape(-1)
            h.update(flat.view(torch.uint8).numpy().tobytes())
        except Exception as e:  # a fake tensor, a tensor subclass without storage
            raise Uncacheable(f"a constant tensor's bytes cannot be read ({type(e).__name__}: {e})") from None
    return h.hexdigest()


def _state_table(module: nn.Module) -> tuple:
    """Names, shapes, dtypes, devices and ``requires_grad`` of every parameter and buffer: what the
    graph's state inputs and the gradient build's trainable set are made from (not the values)."""
    rows = []
    for name, sub in module.named_modules(remove_duplicate=False):
        for n, p in compat.parameter_table(sub).items():
            if p is not None:
                rows.append(("P", name, n, tuple(p.shape), str(p.dtype), bool(p.requires_grad), p.device.type))
        persistent_not = compat.non_persistent_buffers(sub)
        for n, b in compat.buffer_table(sub).items():
            if b is not None:
                rows.append(("B", name, n, tuple(b.shape), str(b.dtype), n in persistent_not, b.device.type))
    return tuple(rows)


def _name(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return f"{module}.{getattr(obj, '__qualname__', None) or getattr(obj, '__name__', None) or type(obj).__qualname__}"


def _fx_value(v: Any) -> Any:
    """A node's ``meta['val']`` as dtype, symbolic shape and device (what translation reads)."""
    if isinstance(v, torch.Tensor):
        return ("T", str(v.dtype), tuple(str(s) for s in v.shape), v.device.type, bool(v.requires_grad))
    if isinstance(v, (list, tuple)):
        return tuple(_fx_value(x) for x in v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    return (type(v).__name__, str(v))  # SymInt, SymFloat, SymBool


def _fx_arg(a: Any) -> Any:
    """A node argument, described without object addresses.

    Raises:
        Uncacheable: an argument of a kind the key cannot describe.
    """
    if isinstance(a, torch.fx.Node):
        return ("%", a.name)
    if a is None or a is Ellipsis or isinstance(a, (bool, int, float, complex, str)):
        return repr(a)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_fx_arg(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((repr(k), _fx_arg(v)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice", _fx_arg(a.start), _fx_arg(a.stop), _fx_arg(a.step))
    if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(a)
    if isinstance(a, torch.Tensor):
        return ("tensor", tensor_digest(a))
    if compat.is_op_overload(a):
        return ("op", str(a))
    if callable(a):
        return ("fn", _name(a))
    raise Uncacheable(f"the captured graph holds a {type(a).__module__}.{type(a).__qualname__} argument")


def _fx_graph(gm: torch.fx.GraphModule, out: list, prefix: str = "") -> None:
    """Every node of ``gm`` and of its subgraphs (higher-order ops' bodies), appended to ``out``."""
    for node in gm.graph.nodes:
        target = node.target
        target_name = (
            target if isinstance(target, str) else str(target) if compat.is_op_overload(target) else _name(target)
        )
        stack = node.meta.get("nn_module_stack") or {}
        out.append(
            (
                prefix,
                node.op,
                node.name,
                target_name,
                _fx_arg(node.args),
                _fx_arg(node.kwargs),
                _fx_value(node.meta.get("val")),
                tuple((str(path), t if isinstance(t, str) else _name(t)) for path, t in stack.values()),
            )
        )
        if node.op == "get_attr":
            attr: Any = gm
            for part in str(target).split("."):
                attr = getattr(attr, part)
            if isinstance(attr, torch.fx.GraphModule):
                _fx_graph(attr, out, f"{prefix}{target}/")
            elif isinstance(attr, torch.Tensor):
                out.append((prefix, "attr", str(target), tensor_digest(attr)))
            else:
                raise Uncacheable(f"the captured graph reads a {type(attr).__qualname__} attribute {target!r}")


def _dynamo_capture(capture: Any) -> tuple:
    """What a ``torch.export`` capture (``export.dynamo.DynamoCapture``) holds that its translation reads."""
    if getattr(capture.bridge, "calls", None):
        raise Uncacheable("the graph calls autograd Functions (PythonOps)")
    program = capture.program
    nodes: list = []
    _fx_graph(program.graph_module, nodes)
    signature = program.graph_signature
    fed = {s.target for s in signature.input_specs if s.kind.name in ("PARAMETER", "BUFFER")}
    constants = []
    for name, value in sorted(program.constants.items()):
        if isinstance(value, torch.Tensor):
            # a non-persistent buffer is a graph input fed each step; any other constant (a tensor
            # attribute, a counter) is built into the graph: its bytes are keyed
            constants.append((name, "fed" if name in fed else tensor_digest(value)))
        else:
            raise Uncacheable(f"the captured program holds a {type(value).__qualname__} constant {name!r}")
    return (
        "dynamo",
        tuple(nodes),
        str(signature),
        tuple(sorted((str(k), str(v)) for k, v in program.range_constraints.items())),
        tuple(constants),
        capture.aten_ops,
        capture.opset,
    )


def _torchscript_capture(capture: Any) -> tuple:
    """What a TorchScript capture (``export.torchscript.TorchScriptCapture``) holds: the ONNX model
    its trace wrote, constants included."""
    if getattr(capture.bridge, "functions", None):
        raise Uncacheable("the graph calls autograd Functions (PythonOps)")
    data = capture.model.SerializeToString(deterministic=True)
    return ("torchscript", hashlib.sha256(data).hexdigest())


def _capture_digest(exporter: str, capture: Any) -> tuple:
    graph = _dynamo_capture(capture) if exporter == "dynamo" else _torchscript_capture(capture)
    adapter = capture.adapter
    out_spec, _ = portable_out_spec(adapter.out_spec)
    try:
        # the output's structure and constants (what the program's outputs are rebuilt into)
        spec = hashlib.sha256(pickle.dumps(out_spec, protocol=4)).hexdigest()
    except Exception as e:
        raise Uncacheable(f"the output structure cannot be stored ({type(e).__name__}: {e})") from None
    return (
        graph,
        spec,
        tuple(str(d) for d in adapter._traced.out_dtypes),
        tuple(adapter.buffer_names),
        tuple(capture.input_names),
        bool(capture.static_spatial),
        tuple(capture.static_reasons),
    )


def build_key(module: nn.Module, schema: Any, options: Any, native: bool, *, exporter: str, capture: Any) -> str:
    """The cache key of a build, from its capture (see the module docstring).

    Args:
        module: the user's module (its state table is keyed, not its code: the capture has that).
        schema: the input schema ortwrap keys its programs by (``cache._schema``).
        options: the resolved :class:`~ortwrap.options.Options`.
        native: whether ortwrap's CPU kernels serve this build (then the CPU's flags are keyed).
        exporter: ``"dynamo"`` or ``"torchscript"``.
        capture: the exporter's capture stage's result.

    Raises:
        Uncacheable: the capture holds something the key cannot describe.
    """
    h = hashlib.sha256()
    graph_options = (
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
    parts = (
        _versions(),
        exporter,
        _capture_digest(exporter, capture),
        _state_table(module),
        repr(schema),
        graph_options,
        native,
        cpu,
    )
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def fx_graph_key(kind: str, gm: torch.fx.GraphModule, *parts: Any) -> str:
    """The cache key of a build made from the FX graph ``gm`` alone (every node, value and constant
    tensor, as a capture's key reads them), ``parts`` and the versions: the onnxruntime engine's
    translated AOTAutograd graphs. Raises Uncacheable as :func:`build_key`."""
    nodes: list = []
    _fx_graph(gm, nodes)
    h = hashlib.sha256()
    for part in (_versions(), kind, nodes, parts):
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


# ------------------------------------------------------------------------------------------- signing


_secret: list[bytes] = []


def _user_secret() -> bytes:
    """The per-user key entries are signed with (see the module docstring), created on first use.

    NOTE: created with ``O_EXCL`` and mode 0600, so two processes starting at once agree on one
    secret (the loser reads the winner's file). The default file must be the user's own and closed to
    others; a secret others can read signs nothing they could not forge.

    Raises:
        OSError: the secret cannot be created or read, or the default file is open to others.
    """
    if _secret:
        return _secret[0]
    path, explicit = build_cache_secret_path()
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    for _ in range(50):  # another process may have created it an instant ago, still empty
        st = os.stat(path)
        if st.st_size >= 32:
            break
        time.sleep(0.01)
    owner = getattr(os, "getuid", lambda: st.st_uid)()  # (no uids on Windows)
    if not explicit and (st.st_uid != owner or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO)):
        raise OSError(f"{path} is not the user's own 0600 file")
    with open(path, "rb") as f:
        key = f.read()
    if len(key) < 32:
        raise OSError(f"{path} holds {len(key)} bytes, expected at least 32")
    _secret.append(key)
    return key


def _sign(payload: bytes) -> bytes:
    return hmac.new(_user_secret(), payload, hashlib.sha256).hexdigest().encode()


# ------------------------------------------------------------------------------------------- storage


_SUFFIX = ".build"


def _path(directory: str, key: str) -> str:
    return os.path.join(directory, f"{key}{_SUFFIX}")


def store(directory: str, key: str, entries: list[CacheEntry]) -> str | None:
    """Write the entries of ``key`` (one per shape-specialization) atomically, signed; keep the
    directory under its size cap; return the path (None if they could not be written)."""
    try:
        buf = io.BytesIO()
        pickle.dump(entries, buf, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # an output structure whose classes cannot be pickled, ...
        logger.info("build cache: not storing %s (%s: %s)", key, type(e).__name__, e)
        return None
    payload = buf.getvalue()
    try:
        signature = _sign(payload)
    except OSError as e:
        logger.warning(
            "build cache: not storing %s: no signing secret (%s); point ORTWRAP_BUILD_CACHE_SECRET at a file of "
            "your own, or turn the cache off (build_cache=False)",
            key,
            e,
        )
        return None
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + _SIGNATURE + signature + b"\n" + payload)
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
    evict(directory, keep=key)
    return _path(directory, key)


def load(directory: str, key: str, *, warn: bool = True) -> list[CacheEntry] | None:
    """The entries stored under ``key``, or None.

    The signature is checked before anything is unpickled. An entry that fails it (corrupt, written
    by another user or by someone else altogether, or by an older ortwrap) is ignored, with a
    warning, and rebuilt; it is deleted when it is ours to delete (an unreadable payload under a
    good signature), else left to be replaced by the rebuilt one.
    """
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
        if not header.startswith(_SIGNATURE):
            raise ValueError("unsigned (written by an older ortwrap, or not by ortwrap)")
        try:
            expected = _sign(payload)
        except OSError as e:
            logger.info("build cache: not loading %s: no signing secret (%s)", path, e)
            return None
        if not hmac.compare_digest(header[len(_SIGNATURE) :], expected):
            raise ValueError("bad signature: corrupt, or not written by this user's ortwrap; it was not unpickled")
    except ValueError as e:
        if warn:
            _unusable(path, e, delete=False)
        return None
    try:
        entries = pickle.loads(payload)
        if not isinstance(entries, list) or not all(isinstance(e, CacheEntry) for e in entries):
            raise ValueError(f"unexpected content {type(entries).__name__}")
    except Exception as e:
        _unusable(path, e, delete=True, warn=warn)
        return None
    try:
        os.utime(path)  # least recently used goes first (atime is often not kept)
    except OSError:
        pass
    return entries


def _unusable(path: str, e: BaseException, *, delete: bool, warn: bool = True) -> None:
    if warn:
        warnings.warn(
            f"ortwrap: the build cache entry {path} is unusable ({type(e).__name__}: {e}); "
            f"{'it was deleted and ' if delete else ''}the graph is rebuilt",
            BuildCacheWarning,
            stacklevel=3,
        )
    if delete:
        try:
            os.unlink(path)
        except OSError:
            pass


# ------------------------------------------------------------------------------------------- size cap


def entries_info(directory: str) -> list[tuple[str, int, float]]:
    """(path, size in bytes, last use) of every entry in ``directory``, most recently used first."""
    rows = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if not name.endswith(_SUFFIX):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        rows.append((path, st.st_size, max(st.st_mtime, st.st_atime)))
    rows.sort(key=lambda r: r[2], reverse=True)
    return rows


def evict(directory: str, keep: str | None = None, max_bytes: int | None = None) -> list[str]:
    """Delete the least recently used entries until the directory holds at most ``max_bytes``
    (``ORTWRAP_BUILD_CACHE_MAX_MB``); never the entry ``keep`` just written. Return what was deleted."""
    limit = build_cache_max_bytes() if max_bytes is None else max_bytes
    rows = entries_info(directory)
    total = sum(size for _, size, _ in rows)
    removed = []
    for path, size, _ in reversed(rows):
        if total <= limit:
            break
        if keep is not None and os.path.basename(path) == f"{keep}{_SUFFIX}":
            continue
        try:
            os.unlink(path)
        except OSError:
            continue
        total -= size
        removed.append(path)
    if removed:
        logger.info("build cache: evicted %d entries to stay under %d MiB", len(removed), limit >> 20)
    return removed


def clear(directory: str) -> int:
    """Delete every entry (and leftover temporary file) in ``directory``; return how many entries."""
    count = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if name.endswith(_SUFFIX) or (name.startswith(".") and name.endswith(".tmp")):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                continue
            count += name.endswith(_SUFFIX)
    return count
