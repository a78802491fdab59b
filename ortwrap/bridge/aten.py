"""ATen ops inside ORT graphs: PyTorch's own kernels run as ``org.pytorch.aten::ATen`` nodes.

An op the exporter cannot translate to ONNX (``operator_export_type=ONNX_ATEN_FALLBACK``), or one
listed in ``Options.aten_ops`` (ops ORT cannot differentiate, or differentiates slowly), becomes an
ATen node: attribute ``operator`` (and ``overload_name``), the op's arguments as inputs (non-tensor
arguments as constant tensors). ``_aten.c``, registered with ``register_aten_op_executor``, calls
:func:`_execute` for every such node, which runs ``torch.ops.aten.<operator>.<overload>``.

Gradients: for every ATen op in a graph that gets a backward, ortwrap registers a gradient
definition with one node, ``ATen(operator="ortwrap_vjp::<op>")`` taking the output gradients and
the forward inputs (``grad/aten.py``); the executor here recomputes the op under autograd and
returns PyTorch's own vector-Jacobian product. Integer inputs (dims, flags) are stop-gradient edges.
An op with a declared backward op (``ops.TORCH_OP_GRADIENTS``: ortwrap's own ops, and PyTorch
activations such as ``elu`` in ``ops.ATEN_GRADIENTS``) gets one node of that op instead, no recompute.
This module is the runner; the type inference through ATen nodes before the passes is
``export/type_inference.py``'s, the graph fix-ups around the gradient build and the registration of
gradient definitions are ``grad/aten.py``'s.

Complex values (the dynamo exporter's ATen nodes: FFTs, ``ops.ATEN_OPS``): ORT holds none, and torchlib
carries a complex tensor as a real one with a trailing dim of 2. An operator ``complex=0,2|op``
(``COMPLEX_MARK``) views inputs 0 and 2 as complex for ``op`` and returns every complex result as
its real view; its vjp recomputes through the same views (:func:`_complex_views`).

Argument encoding (ORT's DLPack bridge carries neither strings nor bool):

==========================================  ================================================
ATen argument                               ATen node input
==========================================  ================================================
Tensor / Tensor?                            the tensor, or an absent input
int, bool, float, Scalar                    0-d tensor (bool arrives as uint8)
int[], float[], bool[]                      1-D tensor
str                                         1-D uint8 tensor of UTF-8 bytes (ortwrap's own)
ScalarType                                  int64 tensor of torch's ScalarType code
==========================================  ================================================
"""

from __future__ import annotations

import ctypes
import functools

import onnx
import torch

from .._compat import torch as compat
from .._ort import C
from ..graph.names import (
    ATEN_BOOL_MARK,
    ATEN_DOMAIN,  # noqa: F401 (its importers read the ATen domain here)
    COMPLEX_MARK,
    NATIVE_PREFIX,
    OUTS_MARK,
    USED_MARK,
    VJP_PREFIX,
)
from . import state
from ._native import load

#: Operators ORT's gradient builder must not differentiate through (``detach``: every input is a
#: stop-gradient edge; ``passes/stop_gradient.py``).
NO_GRADIENT_OPS: frozenset[str] = frozenset({"detach"})
#: Arguments ops update in place although their schemas do not say so (no ``Tensor(a!)``): the
#: running statistics of ``instance_norm`` (TorchScript exports it with running stats as an ATen
#: node) and ``batch_norm``. Treated as written: the vjp recomputes on copies, or the statistics
#: would move twice per step.
_UNANNOTATED_WRITES: dict[str, set[int]] = {"aten::instance_norm": {3, 4}, "aten::batch_norm": {3, 4}}

# Public entry points until install() swaps in the C one (ortwrap/_compat/torch.py).
_from_dlpack = torch.utils.dlpack.from_dlpack
_to_dlpack = torch.utils.dlpack.to_dlpack

_SCALAR_TYPES = {
    0: torch.uint8,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.int64,
    5: torch.float16,
    6: torch.float32,
    7: torch.float64,
    11: torch.bool,
    15: torch.bfloat16,
}


def _decoder(arg):
    t = arg.type
    kind = t.kind()
    if kind == "OptionalType":
        t = t.getElementType()
        kind = t.kind()
    if kind == "ListType":
        elem = t.getElementType().kind()
        if elem == "TensorType":
            raise NotImplementedError(f"Tensor[] argument {arg.name!r} is not supported inside ONNX Runtime")
        if elem == "BoolType":
            return lambda x: [bool(v) for v in x.tolist()]
        return lambda x: x.tolist()
    if kind == "TensorType":
        return lambda x: x
    if kind in ("IntType", "SymIntType"):
        return lambda x: int(x.item())
    if kind == "FloatType":
        return lambda x: float(x.item())
    if kind == "BoolType":
        return lambda x: bool(x.item())
    if kind == "NumberType":
        return lambda x: x.item()
    if kind == "StringType":
        return lambda x: bytes(x.tolist()).decode("utf-8")
    if str(t) == "ScalarType":
        return lambda x: _SCALAR_TYPES[int(x.item())]
    if kind == "GeneratorType":  # Generator? (random ops): only absent, PyTorch's default generator

        def generator(x):
            raise NotImplementedError(f"argument {arg.name!r}: a torch.Generator cannot be passed into ONNX Runtime")

        return generator
    raise NotImplementedError(f"argument {arg.name!r} of type {arg.type} is not supported inside ONNX Runtime")


class _Plan:
    """How to call one ATen overload from the node's inputs."""

    __slots__ = ("fn", "kw", "n_args", "n_returns", "pos", "run", "simple", "written")

    def __init__(self, fn) -> None:
        schema = compat.op_schema(fn)
        self.fn = fn  # the OpOverload (its schema and tags)
        self.run = fn  # what runs it: ``fn``, or ``fn`` between complex views (:func:`_complex_views`)
        #: argument positions the op writes to (``Tensor(a!)``: BatchNorm's running statistics)
        self.written = {i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
        self.written |= _UNANNOTATED_WRITES.get(schema.name, set())
        self.pos: list = []  # (decoder, has_default, default)
        self.kw: list = []  # (name, decoder)
        self.simple = True  # every argument a plain Tensor: no decoding
        for a in schema.arguments:
            dec = _decoder(a)
            has_default = a.default_value is not None or a.type.kind() == "OptionalType"
            if a.type.kind() != "TensorType" or a.kwarg_only:
                self.simple = False
            if a.kwarg_only:
                self.kw.append((a.name, dec))
            else:
                self.pos.append((dec, has_default, a.default_value))
        self.n_args = len(schema.arguments)
        self.n_returns = len(schema.returns)

    def decode(self, op: str, tensors: list) -> tuple[list, dict]:
        if self.simple:
            return tensors, {}
        if len(tensors) > self.n_args:
            raise RuntimeError(f"{op} takes {self.n_args} arguments, the ATen node has {len(tensors)} inputs")
        args, kwargs, i = [], {}, 0
        for dec, has_default, default in self.pos:
            t = tensors[i] if i < len(tensors) else None
            i += 1
            if t is None:
                if not has_default:
                    raise RuntimeError(f"required argument {i - 1} of {op} is missing")
                args.append(default)
            else:
                args.append(dec(t))
        for name, dec in self.kw:
            t = tensors[i] if i < len(tensors) else None
            i += 1
            if t is not None:
                kwargs[name] = dec(t)
        return args, kwargs


_plans: dict[tuple[str, str], _Plan] = {}


def resolve(op: str, overload: str) -> _Plan:
    """The plan for ``op`` (``name`` = ``aten::name``, or ``ns::name``) and its overload."""
    overload = overload.partition(ATEN_BOOL_MARK)[0]
    key = (op, overload)
    plan = _plans.get(key)
    if plan is None and op.startswith(COMPLEX_MARK):
        plan = _plans[key] = _Plan(resolve(op.partition("|")[2], overload).fn)
        plan.run = _complex_views(plan.fn, _complex_positions(op))
    if plan is None:
        ns, _, name = op.rpartition("::")
        if ns == "ortwrap_ops":
            from ..ops import define_ops

            define_ops()
        packet = getattr(getattr(torch.ops, ns or "aten"), name)
        plan = _plans[key] = _Plan(getattr(packet, overload or _default_overload(packet, op)))
    return plan


def _as_complex(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(t if t.stride(-1) == 1 and t.storage_offset() % 2 == 0 else t.contiguous())


def _complex_views(fn, positions: tuple[int, ...]):
    """``fn`` on complex values carried in torchlib's real ``[..., 2]`` form (``COMPLEX_MARK``): the
    positional arguments at ``positions`` viewed as complex, every complex result viewed as real.

    NOTE: both views are differentiable, so a vjp that recomputes through this takes the gradient of
    the real form directly: PyTorch's complex gradient ``dL/dRe + i dL/dIm`` is exactly ``view_as_real``'s
    backward, the convention torchlib's complex translations (and ``_tree``'s complex outputs) use."""

    def run(*args, **kwargs):
        args = [_as_complex(a) if i in positions and isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
        result = fn(*args, **kwargs)
        real = lambda r: torch.view_as_real(r.resolve_conj()) if _is_complex(r) else r  # noqa: E731 (a lazy conjugate: ifft of a real tensor)
        return type(result)(map(real, result)) if isinstance(result, (tuple, list)) else real(result)

    return run


def _default_overload(packet, op: str) -> str:
    """The overload an ATen node without an overload name means: ``default``, else ``Tensor`` (the
    node's arguments are all tensors: the TorchScript exporter writes ``ctc_loss`` so, whose
    overloads are ``IntList`` and ``Tensor``), else the only one."""
    names = packet.overloads()
    for name in ("default", "Tensor"):
        if name in names:
            return name
    if len(names) == 1:
        return names[0]
    raise RuntimeError(f"ATen node {op!r} names no overload and the op has several: {', '.join(names)}")


def _encode(result, n_out: int, op: str, inputs: list | None = None) -> tuple:
    if not isinstance(result, (tuple, list)):
        result = (result,)
    # NOTE: a result that shares an input's memory (a view: diagonal, a transpose, an in-place op's
    # result; a vjp's gradient that is a view of its output gradient: reshape, unsqueeze,
    # squeeze_ones, clone) is copied: ORT owns the input's buffer and may reuse or free it while the
    # result lives (a vjp's view was overwritten before the next node read it: wrong gradients).
    shared = {t.untyped_storage().data_ptr() for t in inputs or () if isinstance(t, torch.Tensor) and t.numel()}
    if len(result) < n_out:
        raise RuntimeError(f"{op} returned {len(result)} values, the ATen node has {n_out} outputs")
    out = []
    for r in result[:n_out]:
        if r is None:
            out.append(None)
            continue
        if not isinstance(r, torch.Tensor):
            r = torch.tensor(r)
        if shared and r.numel() and r.untyped_storage().data_ptr() in shared:
            r = r.clone(memory_format=torch.contiguous_format)
        if r.dtype is torch.bool:
            r = r.view(torch.uint8)
        out.append(_to_dlpack(_dense(r)))
    return tuple(out)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides exactly (ORT's DLPack import checks every stride, those of
    size-1 dims included, which ``is_contiguous`` ignores)."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= size
    if t.stride() == tuple(reversed(expected)):
        return t
    return t.clone(memory_format=torch.contiguous_format) if t.is_contiguous() else t.contiguous()


def _restore_bools(op: str, overload: str, tensors: list, n_out: int) -> list:
    """The bool inputs ``ATEN_BOOL_MARK`` names, as bool again: ORT's DLPack hands bool tensors over as
    uint8, which ops that take masks (``masked_select``, ``masked_fill``, ``where``) refuse. In a vjp
    node the forward inputs come after the output gradients."""
    offset, positions = _bool_positions(op, overload)
    tensors = list(tensors)
    for i in positions:
        t = tensors[offset + i] if offset + i < len(tensors) else None
        if t is not None and t.dtype is torch.uint8:
            tensors[offset + i] = t.view(torch.bool)
    return tensors


@functools.cache
def _bool_positions(op: str, overload: str) -> tuple[int, tuple[int, ...]]:
    """(where the forward inputs start, the ``ATEN_BOOL_MARK`` positions among them), parsed once per node kind."""
    positions = tuple(int(i) for i in overload.partition(ATEN_BOOL_MARK)[2].split(",") if i)
    offset = 0
    if op.startswith(VJP_PREFIX):
        name = _split_used(op[len(VJP_PREFIX) :])[0]
        if name.startswith(OUTS_MARK):
            offset = int(name[len(OUTS_MARK) :].partition("|")[0])
        else:
            offset = resolve(name, overload).n_returns
    return offset, positions


def _copy_form(self, src, non_blocking=False):
    return self.clone().copy_(src, non_blocking)


#: Ops PyTorch's autograd has no formula for, recomputed in a vjp as an op that has one with the
#: same result: the functional ``copy`` (TorchScript writes ``state.copy_(activation)``, Jamba's and
#: LFM2's cache fill, so) as ``copy_`` into a clone.
_DIFFERENTIABLE_FORMS = {"copy": _copy_form, "aten::copy": _copy_form}


def _vjp(op: str, overload: str, tensors: list, n_out: int, used: str | None = None) -> list:
    """PyTorch's backward of ``op``: inputs are the output gradients (one per output of the forward
    node: ``outs=N|op`` when it has fewer than the op returns), then the forward inputs."""
    outs = None
    if op.startswith(OUTS_MARK):
        count, _, op = op[len(OUTS_MARK) :].partition("|")
        outs = int(count)
    plan = resolve(op, overload)
    n_grads = plan.n_returns if outs is None else outs
    grads_out, inputs = tensors[:n_grads], list(tensors[n_grads:])
    leaves = []
    for i, t in enumerate(inputs):
        if t is not None and i in plan.written:
            # NOTE: recomputed on a copy: the forward node already updated the original (running
            # statistics must not move twice), and autograd takes no gradient for it.
            inputs[i] = t.detach().clone()
        elif t is not None and (t.is_floating_point() or t.is_complex()):
            if used is not None and (i >= len(used) or used[i] != "1"):
                continue  # a gradient the graph does not take (a buffer, a frozen weight): not a leaf
            inputs[i] = t.detach().requires_grad_()
            leaves.append(i)
    with torch.enable_grad():
        args, kwargs = plan.decode(op, inputs)
        res = _DIFFERENTIABLE_FORMS.get(op, plan.run)(*args, **kwargs)
        res = res if isinstance(res, (tuple, list)) else (res,)
        # NOTE: ORT's gradients of 0-d values can come as [1] (its gradient builders broadcast
        # them against [1] constants): same elements, the output's shape.
        pairs = [
            (r, g if g.shape == r.shape or g.numel() != r.numel() else g.reshape(r.shape))
            for r, g in zip(res, grads_out)
            if g is not None and isinstance(r, torch.Tensor) and r.requires_grad
        ]
        want = [inputs[i] for i in leaves]
        got = (
            torch.autograd.grad([r for r, _ in pairs], want, [g for _, g in pairs], allow_unused=True)
            if pairs and want
            else [None] * len(want)
        )
    result: list = [None] * len(inputs)
    for i, g in zip(leaves, got):
        result[i] = torch.zeros_like(inputs[i]) if g is None else g
    return result[:n_out] + [None] * (n_out - len(result))


def _execute(op: str, overload: str, capsules: tuple, n_out: int):
    """Called from C for every ATen node. Never raises: parks the exception and returns None."""
    try:
        if op.startswith(NATIVE_PREFIX):
            raise RuntimeError(f"{op}: ortwrap's CPU kernels are not loaded in this process")
        tensors = [None if c is None else _from_dlpack(c) for c in capsules]
        if ATEN_BOOL_MARK in overload:
            tensors = _restore_bools(op, overload, tensors, n_out)
        if op.startswith(VJP_PREFIX):
            name, used = _split_used(op[len(VJP_PREFIX) :])
            grads = _vjp(name, overload, tensors, n_out, used)
            if used is not None:  # gradients the graph does not take (see mark_used_outputs)
                grads = [g if i < len(used) and used[i] == "1" else None for i, g in enumerate(grads)]
            return _encode(grads, n_out, op, tensors)
        if overload.startswith(USED_MARK):  # a backward op with an output mask (mark_used_outputs)
            used = overload[len(USED_MARK) :]
            plan = resolve(op, "")
            mask = _output_mask(used)  # its last argument
            args, kwargs = plan.decode(op, [*tensors, mask])
            grads = plan.run(*args, **kwargs)
            return _encode([g if used[i] == "1" else None for i, g in enumerate(grads)], n_out, op, tensors)
        plan = resolve(op, overload)
        args, kwargs = plan.decode(op, tensors)
        return _encode(plan.run(*args, **kwargs), n_out, op, tensors)
    except BaseException as e:
        e.add_note(f"(while ONNX Runtime ran ATen op {op}.{overload or 'default'} through ortwrap)")
        state.park(e)
        return None


@functools.cache
def _output_mask(used: str) -> torch.Tensor:
    """A backward op's ``output_mask`` argument for the ``used=`` flags, made once per flags (~2 us a
    call saved; the decoder only reads it)."""
    return torch.tensor([c == "1" for c in used])


def _is_tensor(op: str, overload: str, index: int, is_input: bool) -> bool:
    if op.startswith(NATIVE_PREFIX):
        return True
    try:
        name = _split_used(op.removeprefix(VJP_PREFIX))[0]
        if name.startswith(OUTS_MARK):
            name = name.partition("|")[2]
        plan = resolve(name, "" if overload.startswith(USED_MARK) else overload)
        schema = compat.op_schema(plan.fn)
        t = (schema.arguments if is_input else schema.returns)[index].type
        if t.kind() == "OptionalType":
            t = t.getElementType()
        return t.kind() == "TensorType"
    except Exception:
        return True


@functools.cache
def install() -> None:
    """Build (first time only), load and register the ATen executor with ORT. Once per process."""
    global _from_dlpack
    _from_dlpack = compat.from_dlpack()
    lib = load("_aten")
    lib.ortwrap_aten_init.argtypes = [ctypes.py_object, ctypes.py_object]
    lib.ortwrap_aten_init.restype = ctypes.c_int
    if lib.ortwrap_aten_init(_execute, _is_tensor) != 0:
        raise RuntimeError("ortwrap: initializing the ATen executor failed")
    is_tensor = ctypes.cast(lib.ortwrap_is_tensor_argument, ctypes.c_void_p).value
    execute = ctypes.cast(lib.ortwrap_execute, ctypes.c_void_p).value
    C.register_aten_op_executor(str(is_tensor), str(execute))  # decimal strings


def _native_error(op: str, message: str) -> None:
    kind = IndexError if "out of range" in message else RuntimeError  # as eager PyTorch raises
    state.park(kind(f"{message} (ONNX Runtime ran {op} through ortwrap's CPU kernels)"))


def set_native(run_address: int) -> None:
    """Route ``ortwrap_cpu::*`` ATen nodes to the native entry point at ``run_address`` (kernels/_cpu.c)."""
    install()
    lib = load("_aten")
    lib.ortwrap_aten_set_native.argtypes = [ctypes.c_void_p, ctypes.py_object]
    lib.ortwrap_aten_set_native.restype = ctypes.c_int
    if lib.ortwrap_aten_set_native(run_address, _native_error) != 0:
        raise RuntimeError("ortwrap: connecting the CPU kernels to the ATen executor failed")


#: ONNX element type -> torch dtype, and back (no numpy: it has no bfloat16).
TORCH_DTYPES: dict[int, torch.dtype] = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.BOOL: torch.bool,
}
ONNX_TYPES: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPES.items()}


def _complex_positions(op: str) -> tuple[int, ...]:
    """The input positions a ``COMPLEX_MARK`` operator views as complex; () for other operators."""
    if not op.startswith(COMPLEX_MARK):
        return ()
    return tuple(int(i) for i in op[len(COMPLEX_MARK) :].partition("|")[0].split(",") if i)


def _is_complex(r) -> bool:
    return isinstance(r, torch.Tensor) and r.is_complex()


def _split_used(op: str) -> tuple[str, str | None]:
    """``used=101|name`` -> (``name``, ``"101"``); other names unchanged, with None."""
    if op.startswith(USED_MARK):
        flags, _, name = op[len(USED_MARK) :].partition("|")
        return name, flags
    return op, None
