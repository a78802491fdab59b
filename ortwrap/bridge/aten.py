"""ATen ops inside ORT graphs: PyTorch's own kernels run as ``org.pytorch.aten::ATen`` nodes.

An op the exporter cannot translate to ONNX (``operator_export_type=ONNX_ATEN_FALLBACK``), or one
listed in ``Options.aten_ops`` (ops ORT cannot differentiate, or differentiates slowly), becomes an
ATen node: attribute ``operator`` (and ``overload_name``), the op's arguments as inputs (non-tensor
arguments as constant tensors). ``_aten.c``, registered with ``register_aten_op_executor``, calls
:func:`_execute` for every such node, which runs ``torch.ops.aten.<operator>.<overload>``.

Gradients: for every ATen op in a graph that gets a backward, ortwrap registers a gradient
definition with one node, ``ATen(operator="ortwrap_vjp::<op>")`` taking the output gradients and
the forward inputs; the executor recomputes the op under autograd and returns PyTorch's own
vector-Jacobian product. Integer inputs (dims, flags) are stop-gradient edges.

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
import json

import numpy as np
import onnx
import torch

from .._compat import torch as compat
from .._ort import C
from . import state
from ._native import load

ATEN_DOMAIN = "org.pytorch.aten"
VJP_PREFIX = "ortwrap_vjp::"
#: ATen nodes whose operator starts with this run ortwrap's own CPU kernels (``ortwrap.kernels``).
NATIVE_PREFIX = "ortwrap_cpu::"
#: Operators ORT's gradient builder must not differentiate through (``detach``: every input is a
#: stop-gradient edge; ``passes/stop_gradient.py``).
NO_GRADIENT_OPS: frozenset[str] = frozenset({"detach"})
#: Operators whose gradient definition their owner registers (``register_gradient``): no vjp for them.
OWN_GRADIENT_OPS: set[str] = set()
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
    raise NotImplementedError(f"argument {arg.name!r} of type {arg.type} is not supported inside ONNX Runtime")


class _Plan:
    """How to call one ATen overload from the node's inputs."""

    __slots__ = ("fn", "kw", "n_args", "n_returns", "pos", "simple", "written")

    def __init__(self, fn) -> None:
        schema = compat.op_schema(fn)
        self.fn = fn
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
    overload = overload.partition(BOOL_MARK)[0]
    key = (op, overload)
    plan = _plans.get(key)
    if plan is None:
        ns, _, name = op.rpartition("::")
        if ns == "ortwrap_ops":
            from ..registry import define_ops

            define_ops()
        packet = getattr(getattr(torch.ops, ns or "aten"), name)
        plan = _plans[key] = _Plan(getattr(packet, overload or _default_overload(packet, op)))
    return plan


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
    """The bool inputs ``BOOL_MARK`` names, as bool again: ORT's DLPack hands bool tensors over as
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
    """(where the forward inputs start, the ``BOOL_MARK`` positions among them), parsed once per node kind."""
    positions = tuple(int(i) for i in overload.partition(BOOL_MARK)[2].split(",") if i)
    offset = 0
    if op.startswith(VJP_PREFIX):
        name = _split_used(op[len(VJP_PREFIX) :])[0]
        if name.startswith(OUTS_MARK):
            offset = int(name[len(OUTS_MARK) :].partition("|")[0])
        else:
            offset = resolve(name, overload).n_returns
    return offset, positions


def mark_bool_inputs(model: onnx.ModelProto) -> None:
    """Name the bool tensor inputs of each ATen node in its ``overload_name`` (``BOOL_MARK``), so the
    executor can give the op bool tensors again (see :func:`_restore_bools`). A node whose gradient
    is an explicit backward op, or ortwrap's own kernels, is left alone."""
    from ..registry import TORCH_OP_GRADIENTS

    elem = {}
    for v in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        if v.type.tensor_type.elem_type:
            elem[v.name] = v.type.tensor_type.elem_type
    for t in model.graph.initializer:
        elem[t.name] = t.data_type
    for node in model.graph.node:
        if node.op_type == "Constant" and not node.domain:
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    elem[node.output[0]] = a.t.data_type
    for node in model.graph.node:
        if node.domain != ATEN_DOMAIN or node.op_type != "ATen":
            continue
        attrs = {a.name: a for a in node.attribute}
        op = attrs["operator"].s.decode()
        if op.startswith((VJP_PREFIX, NATIVE_PREFIX)) or op in TORCH_OP_GRADIENTS or op in OWN_GRADIENT_OPS:
            continue
        bools = [str(i) for i, name in enumerate(node.input) if name and elem.get(name) == onnx.TensorProto.BOOL]
        if not bools:
            continue
        overload = attrs["overload_name"].s.decode() if "overload_name" in attrs else ""
        if BOOL_MARK in overload:
            continue
        marked = f"{overload}{BOOL_MARK}{','.join(bools)}"
        if "overload_name" in attrs:
            attrs["overload_name"].s = marked.encode()
        else:
            node.attribute.append(onnx.helper.make_attribute("overload_name", marked))


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
        res = plan.fn(*args, **kwargs)
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
        if BOOL_MARK in overload:
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
            mask = torch.tensor([c == "1" for c in used])  # its last argument, output_mask
            args, kwargs = plan.decode(op, [*tensors, mask])
            grads = plan.fn(*args, **kwargs)
            return _encode([g if used[i] == "1" else None for i, g in enumerate(grads)], n_out, op, tensors)
        plan = resolve(op, overload)
        args, kwargs = plan.decode(op, tensors)
        return _encode(plan.fn(*args, **kwargs), n_out, op, tensors)
    except BaseException as e:
        e.add_note(f"(while ONNX Runtime ran ATen op {op}.{overload or 'default'} through ortwrap)")
        state.park(e)
        return None


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


def tensor_from_proto(t: onnx.TensorProto) -> torch.Tensor:
    """An ONNX tensor as a torch tensor (bfloat16 included, which numpy cannot hold natively)."""
    array = onnx.numpy_helper.to_array(t)
    if t.data_type == onnx.TensorProto.BFLOAT16:
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _proto_constants(model: onnx.ModelProto) -> dict[str, torch.Tensor]:
    """Values of Constant nodes (strings as uint8 bytes, the executor's convention)."""
    out = {}
    for n in model.graph.node:
        if n.op_type != "Constant" or n.domain not in ("", "ai.onnx"):
            continue
        for a in n.attribute:
            if a.type == onnx.AttributeProto.STRING and a.name in ("value", "value_string"):
                out[n.output[0]] = torch.tensor(list(a.s), dtype=torch.uint8)
            elif a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                out[n.output[0]] = tensor_from_proto(a.t)
    return out


def _types(model: onnx.ModelProto) -> dict[str, tuple[int, list[int | None]]]:
    """name -> (ONNX element type, shape with None for symbolic dims) for every value whose type
    and rank are known."""
    known = {}
    for v in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        tt = v.type.tensor_type
        if tt.elem_type and tt.HasField("shape"):
            known[v.name] = (tt.elem_type, [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim])
    return known


#: Sizes that stand in for symbolic dims when an ATen node is evaluated on the meta device.
_STAND_INS = (2, 3)


def _meta_outputs(node: onnx.NodeProto, op: str, overload: str, known: dict, constants: dict, stand_in: int):
    """The node's results on the meta device, symbolic dims set to ``stand_in``; None if an input is unknown."""
    inputs = []
    for name in node.input:
        if not name:
            inputs.append(None)
        elif name in constants:
            inputs.append(constants[name])
        elif name in known:
            elem, shape = known[name]
            dtype = TORCH_DTYPES[elem]
            inputs.append(torch.empty([stand_in if d is None else d for d in shape], dtype=dtype, device="meta"))
        else:
            return None
    return meta_outputs(op, overload, inputs)


def meta_outputs(op: str, overload: str, inputs: list) -> tuple:
    """The results of ATen node ``op`` for ``inputs`` (tensors, constants encoded as the node's
    inputs, None for absent ones) evaluated on the meta device."""
    plan = resolve(op, overload)
    args, kwargs = plan.decode(op, inputs)
    meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
    result = plan.fn(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})
    return result if isinstance(result, (tuple, list)) else (result,)


def infer_types(model: onnx.ModelProto, max_rounds: int = 64, strict: bool = True) -> onnx.ModelProto:
    """ONNX shape inference, extended through ATen nodes.

    ONNX cannot infer the outputs of ``org.pytorch.aten::ATen``, so inference stops at the first
    one. Each round infers what ONNX can, then evaluates every ATen node whose inputs are now known
    on PyTorch's ``meta`` device, static dims at their sizes (ops such as ``rms_norm`` check them
    against their weights), symbolic dims set to 2 and then to 3, constants at their values. It
    records each output's dtype and shape: a dim that is the same in both evaluations is static,
    the others symbolic. Until nothing changes.

    Value infos without a type (the TorchScript exporter writes them for custom-domain outputs,
    ``ortwrap::StopGradient``) are dropped first: ONNX inference does not fill an empty entry, and
    everything downstream of it would keep no shape.
    """
    untyped = [v for v in model.graph.value_info if not v.type.HasField("tensor_type")]
    for v in untyped:
        model.graph.value_info.remove(v)
    refined: set[tuple] = set()
    changed = False
    for _ in range(max_rounds):
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
        known = _types(model)
        constants = _proto_constants(model)
        # Progress only if the refined Slice shapes are new: ONNX re-infers the same unknown dims
        # each round, and counting their re-refinement as progress ran all max_rounds rounds
        # (seconds on HF GPT-2).
        changed, signature = _refine_slices(model, constants), _slice_signature(model)
        progress = changed and signature not in refined
        refined.add(signature)
        for node in model.graph.node:
            if node.domain != ATEN_DOMAIN or node.op_type != "ATen" or all(o in known for o in node.output):
                continue
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            op, overload = attrs["operator"].decode(), attrs.get("overload_name", b"").decode()
            if op.startswith((VJP_PREFIX, NATIVE_PREFIX)):
                continue
            try:
                first = _meta_outputs(node, op, overload, known, constants, _STAND_INS[0])
            except Exception:
                if strict:
                    raise
                continue  # best effort (strict=False): its outputs stay unknown
            if first is None:
                continue
            symbolic = any(name in known and None in known[name][1] for name in node.input if name not in constants)
            # Without a symbolic input dim the second evaluation could only repeat the first.
            runs = [first, _meta_outputs(node, op, overload, known, constants, _STAND_INS[1]) if symbolic else first]
            for i, (name, r) in enumerate(zip(node.output, runs[0])):
                if isinstance(r, torch.Tensor) and name not in known:
                    other = runs[1][i] if runs[1] is not None and i < len(runs[1]) else None
                    same = isinstance(other, torch.Tensor) and other.dim() == r.dim()
                    dims = [a if same and a == b else None for a, b in zip(r.shape, other.shape if same else r.shape)]
                    elem = ONNX_TYPES[r.dtype]
                    model.graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem, dims))
                    progress = True
        if not progress:
            break
    # NOTE: the last refinement dropped the unk__ dims ONNX had invented downstream of its Slices
    # (for the next round to re-infer): infer them once more, or those values reach the gradient
    # builder without a type (a Pad whose pads are computed: ORT cannot type the ATen node).
    return onnx.shape_inference.infer_shapes(model, data_prop=True) if changed else model


def _refine_slices(model: onnx.ModelProto, constants: dict[str, torch.Tensor]) -> bool:
    """Give each Slice output the input's sizes on the axes it does not cut; True if any changed.

    ONNX's Slice inference drops every dim when one bound is computed: ``position_ids[:, :T]`` of
    a (1, max_len) buffer reads as (unk, unk), and ORT's gradient builder then takes that unk for
    the batch and does not reduce the broadcast gradient (BERT's position embeddings). Dims ONNX
    invented downstream (``unk__*`` of standard ops) are dropped so the next round re-infers them.
    """
    graph = model.graph
    infos = {v.name: v for v in (*graph.input, *graph.value_info)}
    producers = {o: n for n in graph.node for o in n.output}

    def values(name: str) -> list[int] | None:
        # A constant, or one seen through ops that keep its values (the exporters' Unsqueeze).
        while name not in constants:
            node = producers.get(name)
            if node is None or node.op_type not in ("Unsqueeze", "Squeeze", "Reshape", "Cast", "Identity"):
                return None
            name = node.input[0]
        return [int(v) for v in constants[name].reshape(-1).tolist()]

    changed = False
    for node in graph.node:
        if node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.input) < 3:
            continue
        src, out = infos.get(node.input[0]), infos.get(node.output[0])
        if src is None or not src.type.tensor_type.HasField("shape"):
            continue
        in_dims = src.type.tensor_type.shape.dim
        if len(node.input) > 3 and node.input[3]:
            axes = values(node.input[3])
            if axes is None:
                continue
            axes = [a % len(in_dims) for a in axes]
        else:
            starts = values(node.input[1])
            if starts is None:
                continue
            axes = list(range(len(starts)))
        if out is None:
            out = onnx.helper.make_tensor_value_info(node.output[0], src.type.tensor_type.elem_type, None)
            graph.value_info.append(out)
            out = graph.value_info[-1]
            infos[out.name] = out
        tt = out.type.tensor_type
        if not tt.HasField("shape") or len(tt.shape.dim) != len(in_dims):
            tt.ClearField("shape")
            tt.shape.dim.extend(onnx.TensorShapeProto.Dimension() for _ in in_dims)
        for i, d in enumerate(in_dims):
            if i in axes or not (d.HasField("dim_value") or d.HasField("dim_param")):
                continue
            o = tt.shape.dim[i]
            if o.HasField("dim_value") or (d.HasField("dim_param") and o.dim_param == d.dim_param):
                continue
            o.CopyFrom(d)
            changed = True
    if changed:
        standard = {o for n in graph.node if n.domain in ("", "ai.onnx") and n.op_type != "Slice" for o in n.output}
        stale = [
            v
            for v in graph.value_info
            if v.name in standard and any(d.dim_param.startswith("unk__") for d in v.type.tensor_type.shape.dim)
        ]
        if stale:  # one rebuild: removing entries one by one is quadratic in protobuf
            drop = {v.name for v in stale}
            keep = [
                onnx.ValueInfoProto.FromString(v.SerializeToString()) for v in graph.value_info if v.name not in drop
            ]
            del graph.value_info[:]
            graph.value_info.extend(keep)
    return changed


def _slice_signature(model: onnx.ModelProto) -> tuple:
    """The shapes of every Slice output, as value infos record them."""
    slices = {o for n in model.graph.node if n.op_type == "Slice" for o in n.output}
    return tuple(
        sorted(
            (v.name, tuple((d.dim_value, d.dim_param) for d in v.type.tensor_type.shape.dim))
            for v in model.graph.value_info
            if v.name in slices
        )
    )


USED_MARK = "used="
#: suffix of an ATen node's ``overload_name`` listing its bool tensor inputs (``mark_bool_inputs``)
BOOL_MARK = "@bool="
#: ``ortwrap_vjp::outs=N|op``: the forward node has N outputs, fewer than ``op`` returns.
OUTS_MARK = "outs="


def mark_used_outputs(model: onnx.ModelProto) -> bool:
    """Tell each ATen node of a built graph which of its outputs the graph uses; True if any changed.

    The gradient builder leaves the gradients nobody needs (a frozen weight, an input it does not
    differentiate) as unnamed outputs, and ORT's ATen kernel fails ("invalid index -1") when the
    executor hands it a value for one. The flags, ``used=`` and a 1 or 0 per output, go where the
    executor reads them: the ``overload_name`` of ortwrap's CPU kernels and of the backward ops of
    ``registry.TORCH_OP_GRADIENTS`` (whose ``output_mask`` argument they fill; neither has
    overloads), and into the operator of a vjp node (``ortwrap_vjp::used=101|<op>``). Outputs
    marked 0 are returned as nothing.
    """
    from ..registry import TORCH_OP_GRADIENTS

    masked = {g.backward for g in TORCH_OP_GRADIENTS.values()}
    changed = False
    for node in model.graph.node:
        if node.op_type != "ATen" or node.domain != ATEN_DOMAIN:
            continue
        attrs = {a.name: a for a in node.attribute}
        if "operator" not in attrs:
            continue
        op = attrs["operator"].s.decode()
        if all(node.output) and op not in masked:  # (a masked op always gets its flags)
            continue
        used = USED_MARK + "".join("1" if o else "0" for o in node.output)
        if op.startswith(NATIVE_PREFIX) or op in masked:
            if "overload_name" in attrs:
                attrs["overload_name"].s = used.encode()
            else:
                node.attribute.append(onnx.helper.make_attribute("overload_name", used))
        elif op.startswith(VJP_PREFIX):
            attrs["operator"].s = f"{VJP_PREFIX}{used}|{op[len(VJP_PREFIX) :]}".encode()
        else:
            continue
        changed = True
    return changed


def drop_missing_gradients(model: onnx.ModelProto) -> bool:
    """Make absent the inputs of ``registry.OPTIONAL_GRADIENT_OPS`` nodes and of vjp nodes that nothing
    produces (an output gradient the built graph lacks: no gradient reaches that output, as for the U
    and Vh of ``_linalg_svd`` under ``svdvals``; ``_vjp`` skips an absent one); True if any changed."""
    from ..registry import OPTIONAL_GRADIENT_OPS

    graph = model.graph
    nodes = [
        n
        for n in graph.node
        if n.domain == ATEN_DOMAIN
        and n.op_type == "ATen"
        and any(
            a.name == "operator" and (a.s.decode() in OPTIONAL_GRADIENT_OPS or a.s.decode().startswith(VJP_PREFIX))
            for a in n.attribute
        )
    ]
    if not nodes:
        return False
    known = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    known |= {o for n in graph.node for o in n.output}
    changed = False
    for node in nodes:
        for i, name in enumerate(node.input):
            if name and name not in known:
                node.input[i] = ""
                changed = True
    return changed


def _split_used(op: str) -> tuple[str, str | None]:
    """``used=101|name`` -> (``name``, ``"101"``); other names unchanged, with None."""
    if op.startswith(USED_MARK):
        flags, _, name = op[len(USED_MARK) :].partition("|")
        return name, flags
    return op, None


def declare_output_types(model: onnx.ModelProto) -> None:
    """Copy the types of graph outputs produced by ATen nodes into ``value_info``.

    The gradient builder turns graph outputs into inputs of its ``YieldOp``; an ATen output then
    loses the type that ``graph.output`` declared, and ORT has no type inference for ATen.
    """
    produced = {o for n in model.graph.node if n.domain == ATEN_DOMAIN for o in n.output}
    known = {v.name for v in model.graph.value_info}
    for out in model.graph.output:
        if out.name in produced and out.name not in known:
            model.graph.value_info.append(out)


# ------------------------------------------------------------------------------------- gradients
#: key -> (inputs, outputs, output gradients) of the definition registered for it
_gradient_arity: dict[str, tuple[int, int, tuple[str, ...]]] = {}
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def _gradient_attribute(name: str, value: str):
    """A string attribute of a node in an ORT gradient definition."""
    a = C.GradientNodeAttributeDefinition()
    a.name = name
    a.value_json = json.dumps(value)
    a.dtype = "string"
    a.is_tensor = False
    return a


def register_gradient(
    forward: str, overload: str, inputs: list[str], outputs: list[str], backward: str, stop: set[int]
) -> str:
    """Register with ORT that the gradient of ``ATen(operator=forward, overload_name=overload)`` is one
    ``ATen(operator=backward, overload_name=overload)`` node reading ``inputs`` (``GO(j)``, ``I(i)``,
    ``O(k)``) and writing ``outputs`` (``GI(i)``); ``stop``: forward inputs that get no gradient.
    Returns ORT's key of the definition."""
    key = f"{ATEN_DOMAIN}::ATen::{forward}::{overload}"
    d = C.GradientNodeDefinition()
    d.op_type, d.domain = "ATen", ATEN_DOMAIN
    d.inputs, d.outputs = inputs, outputs
    d.attributes = [_gradient_attribute("operator", backward), _gradient_attribute("overload_name", overload)]
    C.register_gradient_definition(key, [d])
    if stop:
        C.register_custom_stop_gradient_edges(key, stop)
    return key


def register_gradients(model: onnx.ModelProto) -> list[str]:
    """Register the vjp gradient definition of every ATen op in ``model``; return their keys.

    ORT keys a gradient definition by ``(operator, overload)`` and reads inputs ``I(i)`` by
    position, so all nodes of one op must have the same number of inputs.
    """
    from ..registry import TORCH_OP_GRADIENTS

    keys = []
    types = _types(model)
    for node in model.graph.node:
        if node.domain != ATEN_DOMAIN or node.op_type != "ATen":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        op = attrs["operator"].decode()
        overload = attrs.get("overload_name", b"").decode()
        if op.startswith((VJP_PREFIX, NATIVE_PREFIX)) or op in OWN_GRADIENT_OPS:  # they register their own
            continue
        grad = TORCH_OP_GRADIENTS.get(op)
        if grad is not None:  # one explicit backward op (no recompute)
            keys.append(
                register_gradient(op, overload, list(grad.inputs), list(grad.outputs), grad.backward, set(grad.stop))
            )
            continue
        key = f"{ATEN_DOMAIN}::ATen::{op}::{overload}"
        plan = resolve(op, overload)
        if len(node.input) < plan.n_args:
            # NOTE: every node of an op gets the schema's full argument list (absent trailing
            # arguments take their defaults): ORT keeps one gradient definition per op and
            # overload per process, and the exporters differ in which trailing defaults they
            # write (dynamo drops softmax's dtype=None, TorchScript writes it as an empty input).
            node.input.extend([""] * (plan.n_args - len(node.input)))
        n_in, n_out = len(node.input), len(node.output)
        # An integer output (indices) has no gradient for any node to compute: an absent input.
        grads_out = [
            "" if types.get(o, (onnx.TensorProto.FLOAT,))[0] not in _FLOAT_TYPES else f"GO({j})"
            for j, o in enumerate(node.output)
        ]
        known = _gradient_arity.get(key)
        if known is not None and known[:2] != (n_in, n_out):
            raise RuntimeError(
                f"ATen op {op} appears with {known[0]} inputs and {known[1]} outputs, and with {n_in} and {n_out}; "
                "ORT allows one gradient definition per op"
            )
        if known is not None and known[2] != tuple(grads_out):
            # NOTE: the definition registered first stays for the process: one that leaves out an
            # output's gradient (it was an integer there) would make every later float node's
            # gradient zero, silently.
            raise RuntimeError(
                f"ATen op {op} has float outputs {_float_flags(known[2])} in one graph and {_float_flags(grads_out)} "
                "in another; ORT allows one gradient definition per op (run the integer one as an ONNX op)"
            )
        if known is None:
            schema_args = compat.op_schema(plan.fn).arguments
            stop = {i for i in range(n_in) if i >= len(schema_args) or schema_args[i].type.kind() != "TensorType"}
            # An ``out=`` overload (``div.out``: spectral_norm's power iteration, run under no_grad in
            # eager, which refuses out= with inputs that need grad): no gradient flows through it.
            if op in NO_GRADIENT_OPS or any(
                a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in schema_args
            ):
                stop = set(range(n_in))
            register_gradient(
                op,
                overload,
                grads_out + [f"I({i})" for i in range(n_in)],
                [f"GI({i})" for i in range(n_in)],
                VJP_PREFIX + (op if n_out == plan.n_returns else f"{OUTS_MARK}{n_out}|{op}"),
                stop,
            )
            _gradient_arity[key] = (n_in, n_out, tuple(grads_out))
        keys.append(key)
    return keys


def _float_flags(grads_out) -> str:
    return "".join("1" if g else "0" for g in grads_out)
