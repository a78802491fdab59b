"""The registries of ortwrap's extension points: the one place to add a kernel or a gradient.

**Kernels** (:data:`KERNELS`). Each of ortwrap's own CPU kernels (``kernels/_cpu.c``) is declared
once, as a :class:`Kernel`: its name, its typed inputs and outputs (a signature string), its
gradient (the backward kernel and how the gradient node is wired), and the ONNX op types where the
rewrite that introduces it starts (``passes/native_cpu_kernels.py``). Everything else is derived
from, or checked against, these declarations:

* ``_cpu.c``'s ``kOps`` table carries the same signature strings; ``kernels.install`` compares them
  with the declarations when the library loads and raises :class:`KernelTableError` naming each
  mismatch. The C runner checks each node's input and output counts against the signature.
* ``kernels.install`` registers the gradient definitions from the declarations;
* ``NativeCPUKernelsPass`` dispatches on :attr:`Kernel.replaces`, counts per declared kernel, and
  types the outputs from the signature.

Signature characters: ``f`` float32 tensor, ``h`` bfloat16 tensor, ``i`` int64 tensor, ``F`` float32 scalar (0-d),
``I`` int64 scalar (0-d); ``?`` after a character makes that input optional (it may be absent);
inputs and outputs are separated by ``>``.

**Gradients ORT lacks** (:data:`GRADIENTS`). One mechanism: the op runs as an ATen node calling a
PyTorch op (``bridge/aten.py``), and its gradient is PyTorch's autograd of that op (the ATen
bridge's vjp). An :class:`OnnxViaTorch` entry names an ONNX op of the exported graph, the PyTorch op
that computes the same function and ``args``, which maps the node's inputs and attributes to that
op's arguments (or returns None to leave the node to ORT, or raises :class:`~ortwrap.errors.PassError`
saying what is not supported). ``passes/torch_gradients.py`` applies them to training graphs.
Where no PyTorch op has the ONNX op's semantics, ortwrap defines a composite op of its own in the
``ortwrap_ops`` namespace (:func:`define_ops`, ``torch.library``; autograd comes from the
composite's decomposition).

**ATen ops whose ONNX form is wrong** (:data:`ATEN_OPS`): an :class:`AtenViaTorch` entry makes the
exporters it names (TorchScript: ``export/symbolics.py``; dynamo: ``export/aten_fallback.py``) write
the op as an ATen node, with the same gradient mechanism.

**Any other ONNX op ORT cannot differentiate** (no gradient builder: ``Acosh``, ``Cosh``, ...): the
general rule of ``passes/torch_gradients.py`` asks ORT (a probe of the node alone) and, where its
gradient build fails, runs the PyTorch op of the same name and tensor arguments instead.

Each registry op costs a Python call per node per step (forward, and one for its gradient), and
runs where ORT's ATen kernel runs; the CPU entries are tested, CUDA is not.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ATEN_OPS",
    "DOUBLE_PRECISION",
    "DTYPE_ARGUMENT_OPS",
    "GRADIENTS",
    "KERNELS",
    "TORCH_OP_GRADIENTS",
    "AtenViaTorch",
    "Kernel",
    "KernelGradient",
    "KernelTableError",
    "OnnxViaTorch",
    "define_ops",
    "kernel",
]


class KernelTableError(RuntimeError):
    """The compiled kernel table (``_cpu.c`` ``kOps``) disagrees with :data:`KERNELS`."""


# ------------------------------------------------------------------------------------------ kernels
#: the namespace of ortwrap's PyTorch ops (``torch.ops.ortwrap_ops``; :func:`define_ops`)
OPS_NAMESPACE = "ortwrap_ops"
_TENSOR_CHARS = {"f": "float32", "h": "bfloat16", "i": "int64", "F": "float32 scalar", "I": "int64 scalar"}


def parse_signature(signature: str) -> tuple[list[tuple[str, bool]], list[str]]:
    """``"fff?FI>fff"`` -> ([(char, optional), ...] per input, [char per output])."""
    ins, sep, outs = signature.partition(">")
    if not sep:
        raise ValueError(f"signature {signature!r} has no '>'")
    inputs: list[tuple[str, bool]] = []
    for ch in ins:
        if ch == "?":
            if not inputs:
                raise ValueError(f"signature {signature!r}: '?' before any input")
            inputs[-1] = (inputs[-1][0], True)
        elif ch in _TENSOR_CHARS:
            inputs.append((ch, False))
        else:
            raise ValueError(f"signature {signature!r}: unknown character {ch!r}")
    for ch in outs:
        if ch not in _TENSOR_CHARS:
            raise ValueError(f"signature {signature!r}: unknown output character {ch!r}")
    return inputs, list(outs)


@dataclass(frozen=True)
class KernelGradient:
    """The gradient of a forward kernel: one node of ``backward`` reading ``inputs`` (``GO(j)``,
    ``I(i)``, ``O(k)``) and writing ``outputs`` (``GI(i)``); ``stop``: forward inputs that get no
    gradient (integer inputs, statistics)."""

    backward: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    stop: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Kernel:
    """One of ortwrap's CPU kernels (``ortwrap_cpu::<name>``).

    Attributes:
        name: the kernel's name in ``kOps``.
        signature: typed inputs and outputs (module docstring).
        doc: what it computes, one line.
        gradient: its gradient, or None for a backward kernel.
        replaces: ONNX op types where ``NativeCPUKernelsPass``'s rewrite for this kernel starts.
        rewrite: the pass's method that performs that rewrite.
        variant_of: for a variant with other dtypes (or layouts), the kernel whose nodes it replaces
            (in another pass: ``passes/half_values.py``, ``passes/native_attention.py``) instead of a
            rewrite of its own.
        replaces_ops: for a kernel that takes the place of some of ortwrap's PyTorch ops (ATen nodes
            of ``ortwrap_ops``), those ops (``passes/native_attention.py`` rewrites them).
    """

    name: str
    signature: str
    doc: str
    gradient: KernelGradient | None = None
    replaces: tuple[str, ...] = ()
    rewrite: str | None = None
    variant_of: str | None = None
    replaces_ops: tuple[str, ...] = ()

    @property
    def inputs(self) -> list[tuple[str, bool]]:
        return parse_signature(self.signature)[0]

    @property
    def outputs(self) -> list[str]:
        return parse_signature(self.signature)[1]

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The float dtypes it reads or writes (it computes in float32; ``h``: bfloat16 tensors)."""
        return ("float32", "bfloat16") if "h" in self.signature else ("float32",)


def _grad(backward: str, inputs: Sequence[str], outputs: Sequence[str], stop: Sequence[int] = ()) -> KernelGradient:
    return KernelGradient(backward, tuple(inputs), tuple(outputs), frozenset(stop))


#: Every kernel in ``kernels/_cpu.c``, forward kernels with their gradients, then backward kernels.
KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "gelu",
        "f>f",
        "y = x * Phi(x) (erf GELU)",
        _grad("gelu_backward", ["GO(0)", "I(0)"], ["GI(0)"]),
        replaces=("Erf",),
        rewrite="_gelu",
    ),
    Kernel("gelu_backward", "ff>f", "dx from dy, x"),
    Kernel(
        "gelu_tanh",
        "f>f",
        "0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))",
        _grad("gelu_tanh_backward", ["GO(0)", "I(0)"], ["GI(0)"]),
        replaces=("Tanh",),
        rewrite="_gelu_tanh",
    ),
    Kernel("gelu_tanh_backward", "ff>f", "dx from dy, x"),
    Kernel(
        "layer_norm",
        "fff?FI>fff",
        "x, weight, bias, eps, axis -> y, mean, rstd (shape[:axis] + 1s)",
        _grad(
            "layer_norm_backward",
            ["GO(0)", "I(0)", "I(1)", "O(1)", "O(2)", "I(4)"],
            ["GI(0)", "GI(1)", "GI(2)"],
            stop=[3, 4],
        ),
        replaces=("LayerNormalization",),
        rewrite="_layer_norm",
    ),
    Kernel("layer_norm_backward", "fffffI>fff", "dy, x, weight, mean, rstd, axis -> dx, dweight, dbias"),
    Kernel(
        "layer_norm_bf16",
        "fff?FI>hff",
        "layer_norm with y rounded to bfloat16 (read only by bf16 GEMMs, which round it anyway)",
        _grad(
            "layer_norm_bf16_backward",
            ["GO(0)", "I(0)", "I(1)", "O(1)", "O(2)", "I(4)"],
            ["GI(0)", "GI(1)", "GI(2)"],
            stop=[3, 4],
        ),
        variant_of="layer_norm",
    ),
    Kernel("layer_norm_bf16_backward", "hffffI>fff", "layer_norm_backward with dy in bfloat16"),
    Kernel(
        "embedding",
        "fi>f",
        "weight, indices -> weight[indices]",
        _grad("embedding_backward", ["GO(0)", "I(1)", "I(0)"], ["GI(0)"], stop=[1]),
        replaces=("Gather",),
        rewrite="_embedding",
    ),
    Kernel("embedding_backward", "fif>f", "dy, indices, weight -> dweight"),
    Kernel(
        "softmax",
        "f>f",
        "softmax over the last dimension",
        _grad("softmax_backward", ["GO(0)", "O(0)"], ["GI(0)"]),
        replaces=("Softmax",),
        rewrite="_softmax",
    ),
    Kernel("softmax_backward", "ff>f", "dy, y -> dx"),
    Kernel(
        "cross_entropy",
        "fiII>ff",
        "scores [n, c], labels, ignore_index, reduction (none, mean, sum) -> loss, log_prob",
        _grad("cross_entropy_backward", ["GO(0)", "O(1)", "I(1)", "I(2)", "I(3)"], ["GI(0)"], stop=[1, 2, 3]),
        replaces=("SoftmaxCrossEntropyLoss",),
        rewrite="_cross_entropy",
    ),
    Kernel("cross_entropy_backward", "ffiII>f", "dloss, log_prob, labels, ignore_index, reduction -> dscores"),
    Kernel(
        "attention_bf16",
        "hhhf?F>hf",
        "softmax attention of bf16 q [..., T, D], k^T [..., D, S], v [..., S, E], additive mask, scale -> out, lse",
        _grad(
            "attention_bf16_backward",
            ["GO(0)", "I(0)", "I(1)", "I(2)", "O(0)", "O(1)", "I(3)", "I(4)"],
            ["GI(0)", "GI(1)", "GI(2)"],
            stop=[3, 4],
        ),
        replaces_ops=(f"{OPS_NAMESPACE}::attention_keep_inputs", f"{OPS_NAMESPACE}::attention"),
    ),
    Kernel("attention_bf16_backward", "hhhhhff?F>hhh", "dout, q, kt, v, out, lse, mask, scale -> dq, dkt, dv"),
    Kernel(
        "attention_bthd_bf16",
        "hhhf?F>hf",
        "attention_bf16 on q [B, T, H, D], k [B, S, H, D], v [B, S, H, E] -> out [B, T, H, E], lse [B, H, T]",
        _grad(
            "attention_bthd_bf16_backward",
            ["GO(0)", "I(0)", "I(1)", "I(2)", "O(0)", "O(1)", "I(3)", "I(4)"],
            ["GI(0)", "GI(1)", "GI(2)"],
            stop=[3, 4],
        ),
        variant_of="attention_bf16",
    ),
    Kernel("attention_bthd_bf16_backward", "hhhhhff?F>hhh", "dout, q, k, v, out, lse, mask, scale -> dq, dk, dv"),
)


@functools.cache
def kernel(name: str) -> Kernel:
    """The declaration of kernel ``name``."""
    for k in KERNELS:
        if k.name == name:
            return k
    raise KeyError(f"no ortwrap CPU kernel named {name!r}")


def check_kernel_table(compiled: dict[str, str]) -> None:
    """Compare the compiled table (name -> signature, from ``_cpu.c``) with :data:`KERNELS`.

    Raises:
        KernelTableError: naming every kernel that is missing on either side or whose signature differs.
    """
    problems = []
    declared = {k.name: k.signature for k in KERNELS}
    for name, sig in declared.items():
        if name not in compiled:
            problems.append(f"{name}: declared in ortwrap/registry.py but not in _cpu.c's kOps")
        elif compiled[name] != sig:
            problems.append(f"{name}: _cpu.c says {compiled[name]!r}, ortwrap/registry.py says {sig!r}")
    problems += [
        f"{n}: in _cpu.c's kOps but not declared in ortwrap/registry.py" for n in compiled if n not in declared
    ]
    for k in KERNELS:
        if k.gradient is not None and k.gradient.backward not in declared:
            problems.append(f"{k.name}: its backward kernel {k.gradient.backward!r} is not declared")
    if problems:
        raise KernelTableError("ortwrap's kernel table has drifted from its declarations: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------- gradients
#: An argument for the PyTorch op: a graph value (tensor input, None if absent) or a constant.
Arg = Any


@dataclass(frozen=True)
class OnnxViaTorch:
    """An ONNX op that ORT 1.19.2 cannot differentiate (or not on some devices), run as PyTorch's op.

    Attributes:
        onnx: the ONNX op type (default domain).
        torch_op: ``"name"`` or ``"name.overload"`` in ``torch.ops.aten``, or ``"ortwrap_ops::name"``.
        args: ``args(node, value, b)`` -> the op's arguments, all of them in schema order: graph
            values (``value(i)`` is the node's input ``i``, None if absent; ``b``, a
            ``passes._build.NodeBuilder``, adds nodes that compute others) or Python constants (int,
            float, bool, list of ints or floats, None for an absent optional). None: leave the node to ORT.
        devices: device types (``torch.device.type``) where the rewrite applies.
        why: what ORT lacks.
    """

    onnx: str
    torch_op: str
    args: Callable[[Any, Callable[[int], Any], Any], list[Arg] | None]
    devices: tuple[str, ...] = ("cpu", "cuda")
    why: str = "no gradient in ORT 1.19.2"
    #: the ONNX op's domain ("" is ai.onnx)
    domain: str = ""


def _attr(node: Any, name: str, default: Any) -> Any:
    a = node.attributes.get(name)
    if a is None:
        return default
    v = a.value
    return list(v) if isinstance(v, (list, tuple)) else v


def _unary(torch_args: Callable[[Any], list] | None = None) -> Callable:
    def args(node: Any, value: Callable[[int], Any], b: Any = None) -> list:
        return [value(0), *(torch_args(node) if torch_args else [])]

    return args


def _hard_sigmoid(node: Any, value: Callable[[int], Any], b: Any = None) -> list:
    return [value(0), float(_attr(node, "alpha", 0.2)), float(_attr(node, "beta", 0.5))]


def _reduce(name: str) -> Callable:
    def args(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
        from ..passes._build import constant_value

        keepdims = bool(_attr(node, "keepdims", 1))
        if len(node.inputs) > 1 and node.inputs[1] is not None:  # opset 18: axes as an input
            axes = constant_value(node.inputs[1])
            if axes is None:
                return None
            axes = [int(a) for a in axes.reshape(-1)]
        else:
            axes = _attr(node, "axes", [])
        if not axes and _attr(node, "noop_with_empty_axes", 0):
            return None
        return [value(0), list(axes), keepdims]

    return args


def _symmetric_pads(node: Any, rank: int, what: str, refused: tuple[str, ...] = ()) -> list[int]:
    """The per-axis padding of a pooling/convolution ``node`` whose pads are explicit and symmetric.

    PyTorch's ops take one pad per spatial axis; ONNX's begin/end pads and ``auto_pad`` have no such form,
    so those (and the ``refused`` attributes, when set) raise a PassError naming the node and ``what`` it is."""
    from ..errors import PassError

    set_attrs = [a for a in refused if _attr(node, a, 0)]
    if _attr(node, "auto_pad", "NOTSET") != "NOTSET":
        set_attrs.insert(0, "auto_pad")
    if set_attrs:
        raise PassError(
            f"node {node.name!r}: {what} with {' or '.join(set_attrs)} cannot be trained here; "
            "export it with explicit padding (torch.nn's modules do)"
        )
    pads = list(_attr(node, "pads", [0] * (2 * rank)))
    if pads[:rank] != pads[rank:]:
        raise PassError(f"node {node.name!r}: {what} with asymmetric pads {pads} cannot be trained here")
    return pads[:rank]


def _conv_transpose(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:

    x = node.inputs[0]
    rank = len(x.shape) - 2 if x.shape is not None else None
    if rank is None:
        return None
    pads = _symmetric_pads(node, rank, "ConvTranspose", refused=("output_shape",))
    return [
        value(0),
        value(1),
        value(2) if len(node.inputs) > 2 else None,
        list(_attr(node, "strides", [1] * rank)),
        pads,
        list(_attr(node, "dilations", [1] * rank)),
        True,
        list(_attr(node, "output_padding", [0] * rank)),
        int(_attr(node, "group", 1)),
    ]


_RESIZE_LINEAR = {1: "upsample_linear1d.vec", 2: "upsample_bilinear2d.vec", 3: "upsample_trilinear3d.vec"}


def _resize_op(node: Any) -> tuple[str, bool | None]:
    """The PyTorch op computing this Resize (``.vec`` overload) and its align_corners (None: none)."""
    from ..errors import PassError

    x = node.inputs[0]
    rank = len(x.shape) - 2 if x.shape is not None else None
    mode = _attr(node, "mode", "nearest")
    ctm = _attr(node, "coordinate_transformation_mode", "half_pixel")
    where = f"node {node.name!r}: Resize(mode={mode}, coordinate_transformation_mode={ctm}"
    if rank not in (1, 2, 3):
        raise PassError(f"{where}) on a rank-{rank} input cannot be trained: 3-D, 4-D and 5-D inputs can")
    if _attr(node, "antialias", 0) or _attr(node, "exclude_outside", 0) or node.attributes.get("axes"):
        raise PassError(f"{where}) with antialias, exclude_outside or axes cannot be trained")
    if mode == "nearest":
        nearest = _attr(node, "nearest_mode", "round_prefer_floor")
        if ctm == "asymmetric" and nearest == "floor":
            return f"upsample_nearest{rank}d.vec", None
        if ctm in ("half_pixel", "pytorch_half_pixel") and nearest == "round_prefer_ceil":
            return f"_upsample_nearest_exact{rank}d.vec", None
    elif mode == "linear" and ctm in ("align_corners", "half_pixel", "pytorch_half_pixel"):
        return _RESIZE_LINEAR[rank], ctm == "align_corners"
    elif (
        mode == "cubic"
        and rank == 2
        and ctm in ("align_corners", "half_pixel", "pytorch_half_pixel")
        and abs(float(_attr(node, "cubic_coeff_a", -0.75)) + 0.75) < 1e-6
    ):
        return "upsample_bicubic2d.vec", ctm == "align_corners"
    raise PassError(f"{where}) has no PyTorch equivalent to train it with (F.interpolate's modes do)")


def _resize(node: Any, value: Callable[[int], Any], b: Any) -> list | None:
    """``Resize`` -> ``upsample_*.vec(x, output_size, [align_corners,] scale_factors)``: constant
    scales as scale factors (PyTorch then maps coordinates with them, as ONNX does), sizes (constant or
    read at run time) as the output size."""
    import numpy as np_

    from ..errors import PassError
    from ..passes._build import constant_value

    _, align = _resize_op(node)
    x = node.inputs[0]
    rank = len(x.shape) - 2
    scales = constant_value(value(2)) if value(2) is not None else None
    sizes = value(3)
    if scales is not None and scales.size == rank + 2:
        if list(scales[:2]) != [1, 1]:
            raise PassError(f"node {node.name!r}: Resize over the batch or channel dimension cannot be trained")
        size, factors = None, [float(v) for v in scales[2:]]
    elif sizes is not None:
        known = constant_value(sizes)
        if known is not None:
            size = [int(v) for v in known[2:]]
        else:
            size = b.op("Slice", sizes, b.const(np_.array([2], np_.int64)), b.const(np_.array([rank + 2], np_.int64)))
        factors = None
    else:
        raise PassError(f"node {node.name!r}: Resize with scales computed at run time cannot be trained")
    return [x, size, factors] if align is None else [x, size, align, factors]


_GRID_MODES = {"bilinear": 0, "linear": 0, "nearest": 1, "bicubic": 2, "cubic": 2}
_GRID_PADDING = {"zeros": 0, "border": 1, "reflection": 2}


def _grid_sample(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """GridSample (opset 16's and 20's mode names) -> ``grid_sampler(x, grid, mode, padding, align)``."""
    mode = _GRID_MODES.get(
        str(_attr(node, "mode", "bilinear" if node.version is None or node.version < 20 else "linear"))
    )
    padding = _GRID_PADDING.get(str(_attr(node, "padding_mode", "zeros")))
    if mode is None or padding is None:
        return None
    return [value(0), value(1), mode, padding, bool(_attr(node, "align_corners", 0))]


def _col2im(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """Col2Im (block shape constant) -> ``col2im(x, output_size, kernel_size, dilation, padding, stride)``."""
    from ..passes._build import constant_value

    image, block = constant_value(node.inputs[1]), constant_value(node.inputs[2])
    if block is None:
        return None
    nd = int(block.size)
    pads = _symmetric_pads(node, nd, "Col2Im")
    return [
        value(0),
        # the image size may be read at run time (F.fold to a computed size): the ATen node takes it as a tensor
        value(1) if image is None else [int(v) for v in image.reshape(-1)],
        [int(v) for v in block.reshape(-1)],
        list(_attr(node, "dilations", [1] * nd)),
        pads,
        list(_attr(node, "strides", [1] * nd)),
    ]


def _avg_pool(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    from ..errors import PassError

    k = list(_attr(node, "kernel_shape", []))
    nd = len(k)
    pads = _symmetric_pads(node, nd, "AveragePool")
    if any(d != 1 for d in _attr(node, "dilations", [1] * nd)):
        raise PassError(f"node {node.name!r}: AveragePool with dilations is not supported")
    args = [
        value(0),
        k,
        list(_attr(node, "strides", [1] * nd)),
        pads,
        bool(_attr(node, "ceil_mode", 0)),
        bool(_attr(node, "count_include_pad", 0)),
    ]
    return args if nd == 1 else [*args, None]


def _axes_input(node: Any, index: int) -> list[int] | None:
    """Constant axes from input ``index`` (opset 18 reductions) or the ``axes`` attribute; None if
    they are computed at run time."""
    from ..passes._build import constant_value

    if len(node.inputs) > index and node.inputs[index] is not None:
        axes = constant_value(node.inputs[index])
        return None if axes is None else [int(a) for a in axes.reshape(-1)]
    return list(_attr(node, "axes", []))


def _reduce_to(kind: str) -> Callable:
    """ReduceProd/ReduceL1/ReduceL2/ReduceSumSquare/ReduceLogSum -> ``ortwrap_ops::reduce(x, kind, dims, keepdim)``."""

    def args(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
        axes = _axes_input(node, 1)
        if axes is None or (not axes and _attr(node, "noop_with_empty_axes", 0)):
            return None
        return [value(0), kind, axes, bool(_attr(node, "keepdims", 1))]

    return args


def _cumsum(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    from ..passes._build import constant_value

    axis = constant_value(value(1))
    if axis is None:
        return None
    return [value(0), int(axis.reshape(-1)[0]), bool(_attr(node, "exclusive", 0)), bool(_attr(node, "reverse", 0))]


def _pad(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """Pad(mode=reflect|edge|wrap) -> ``ortwrap_ops::pad`` (ORT's Pad gradient handles the constant
    mode only); the pads may be computed at run time."""
    from ..errors import PassError

    mode = _attr(node, "mode", "constant")
    if mode == "constant":
        return None
    if len(node.inputs) > 3 and node.inputs[3] is not None:
        raise PassError(f"node {node.name!r}: Pad(mode={mode}) with axes cannot be trained")
    return [value(0), value(1), {"reflect": "reflect", "edge": "replicate", "wrap": "circular"}[mode]]


def _depth_to_space(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    from ..errors import PassError

    if _attr(node, "mode", "DCR") != "CRD":
        raise PassError(f"node {node.name!r}: DepthToSpace(mode=DCR) cannot be trained (pixel_shuffle's is CRD)")
    return [value(0), int(_attr(node, "blocksize", 1))]


def _mod(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    x = node.inputs[0]
    if not _attr(node, "fmod", 0) or x.dtype is None or not x.dtype.is_floating_point():
        return None  # integer Mod: nothing to differentiate
    return [value(0), value(1)]


def _pow(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """Pow of an exponent computed by the graph: ORT 1.19.2 differentiates the base only ("not
    implemented for Pow's input exponent"). Its probe of a lone Pow with a constant base passes,
    so the general rule (``passes/torch_gradients.py``) does not see it."""
    from ..passes._build import constant_value

    base, exponent = node.inputs[0], node.inputs[1]
    if constant_value(exponent) is not None or exponent.dtype is None or not exponent.dtype.is_floating_point():
        return None
    if base.dtype is not None and exponent.dtype != base.dtype:
        exponent = b.op("Cast", exponent, to=int(base.dtype))  # ONNX Pow keeps the base's type
    return [value(0), exponent]


#: ScatterElements' reduction -> scatter_reduce's
_SCATTER_REDUCTIONS = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _scatter_reduce(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """ScatterElements with a reduction (``scatter_add``, ``scatter_reduce``): ORT 1.19.2's gradient
    ignores the reduction, treating it as a plain scatter (the gradient of ``data`` zeroed where an
    update lands; eager's is the identity for ``add``)."""
    from ..errors import PassError

    reduction = _attr(node, "reduction", "none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction == "none":
        return None  # ORT's gradient is right for a plain scatter
    if reduction not in _SCATTER_REDUCTIONS:
        raise PassError(f"node {node.name!r}: ScatterElements(reduction={reduction!r}) cannot be trained")
    index = node.inputs[1]
    if index.dtype is not None and index.dtype.name != "INT64":
        index = b.op("Cast", index, to=7)
    return [value(0), int(_attr(node, "axis", 0)), index, value(2), _SCATTER_REDUCTIONS[reduction], True]


def _slice(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """Slice with a negative step (``flip``): ORT 1.19.2's SliceGrad fails on it (narrowing_error)."""
    import numpy as np_

    from ..passes._build import constant_value

    x = node.inputs[0]
    if len(node.inputs) < 5 or node.inputs[4] is None or x.dtype is None or not x.dtype.is_floating_point():
        return None  # integer slices (shape arithmetic) have nothing to differentiate
    steps = constant_value(node.inputs[4])
    if steps is None or not (steps < 0).any():
        return None
    rank = len(node.inputs[0].shape) if node.inputs[0].shape is not None else None
    axes = value(3) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    if axes is None:
        if rank is None:
            return None
        axes = list(range(len(steps.reshape(-1))))
    return [value(0), value(1), value(2), axes, [int(v) for v in np_.asarray(steps).reshape(-1)]]


def _scatter_nd(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """ScatterND(reduction="add") (``index_put(accumulate=True)``, ``_unsafe_masked_index_put_accumulate``
    under dynamo): ORT 1.19.2's gradient is a plain scatter's, which zeroes the gradient of ``data``
    where an update lands (eager's is the identity)."""
    from ..errors import PassError

    reduction = _attr(node, "reduction", "none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction == "none":
        return None
    if reduction != "add":
        raise PassError(f"node {node.name!r}: ScatterND(reduction={reduction!r}) cannot be trained")
    return [value(0), value(1), value(2)]


#: ONNX ops ORT 1.19.2 cannot differentiate, run as PyTorch ops (``passes/torch_gradients.py``).
GRADIENTS: dict[str, OnnxViaTorch] = {
    g.onnx: g
    for g in (
        OnnxViaTorch("HardSwish", "hardswish", _unary()),
        OnnxViaTorch("HardSigmoid", "ortwrap_ops::hard_sigmoid", _hard_sigmoid),
        OnnxViaTorch("Mish", "mish", _unary()),
        OnnxViaTorch("Elu", "elu", _unary(lambda n: [float(_attr(n, "alpha", 1.0)), 1.0, 1.0])),
        OnnxViaTorch(
            "Selu",
            "elu",
            _unary(
                lambda n: [
                    float(_attr(n, "alpha", 1.67326319217681884765625)),
                    float(_attr(n, "gamma", 1.05070102214813232421875)),
                    1.0,
                ]
            ),
        ),
        OnnxViaTorch(
            "Celu", "elu", _unary(lambda n: [float(_attr(n, "alpha", 1.0)), 1.0, 1.0 / float(_attr(n, "alpha", 1.0))])
        ),
        # ONNX Softplus has no threshold: softplus(x, 1, inf) is log(1 + exp(x)) everywhere.
        OnnxViaTorch("Softplus", "softplus", _unary(lambda n: [1.0, math.inf])),
        OnnxViaTorch("PRelu", "ortwrap_ops::prelu", lambda n, v, b: [v(0), v(1)]),
        OnnxViaTorch(
            "Shrink",
            "ortwrap_ops::shrink",
            lambda n, v, b: [v(0), float(_attr(n, "lambd", 0.5)), float(_attr(n, "bias", 0.0))],
        ),
        # Sign's derivative is zero where it exists (eager's too): dynamo's softshrink has a Sign.
        OnnxViaTorch("Sign", "sign", _unary()),
        # Zero derivative where defined, as in eager.
        OnnxViaTorch("Floor", "floor", _unary()),
        OnnxViaTorch("Ceil", "ceil", _unary()),
        OnnxViaTorch("Round", "round", _unary()),
        OnnxViaTorch("Asin", "asin", _unary()),
        OnnxViaTorch("Acos", "acos", _unary()),
        OnnxViaTorch("Atan", "atan", _unary()),
        OnnxViaTorch("Tan", "tan", _unary()),
        OnnxViaTorch("CumSum", "ortwrap_ops::cumsum", _cumsum),
        OnnxViaTorch("ReduceProd", "ortwrap_ops::reduce", _reduce_to("prod")),
        OnnxViaTorch("ReduceL1", "ortwrap_ops::reduce", _reduce_to("l1")),
        OnnxViaTorch("ReduceSumSquare", "ortwrap_ops::reduce", _reduce_to("sum_square")),
        OnnxViaTorch("ReduceLogSum", "ortwrap_ops::reduce", _reduce_to("log_sum")),
        # ORT 1.19.2's ReduceL2 gradient builds an invalid graph (a one-input Unsqueeze) at opset >= 13.
        OnnxViaTorch("ReduceL2", "ortwrap_ops::reduce", _reduce_to("l2")),
        OnnxViaTorch("Mod", "fmod.Tensor", _mod),
        OnnxViaTorch(
            "ScatterND",
            "ortwrap_ops::scatter_nd_add",
            _scatter_nd,
            why="ORT's ScatterND gradient ignores the reduction",
        ),
        OnnxViaTorch("Pow", "pow.Tensor_Tensor", _pow, why="ORT 1.19.2's Pow gradient leaves out the exponent"),
        OnnxViaTorch(
            "ScatterElements",
            "scatter_reduce.two",
            _scatter_reduce,
            why="ORT's ScatterElements gradient ignores the reduction",
        ),
        OnnxViaTorch("Pad", "ortwrap_ops::pad", _pad, why="ORT's Pad gradient handles the constant mode only"),
        OnnxViaTorch("DepthToSpace", "pixel_shuffle", _depth_to_space),
        OnnxViaTorch("Slice", "ortwrap_ops::slice", _slice, why="SliceGrad fails on negative steps"),
        OnnxViaTorch("ReduceMax", "amax", _reduce("amax")),
        OnnxViaTorch("ReduceMin", "amin", _reduce("amin")),
        OnnxViaTorch(
            "ConvTranspose",
            "convolution",
            _conv_transpose,
            devices=("cpu",),
            why="no ConvTransposeGrad kernel on CPU in ORT 1.19.2",
        ),
        # After ResizeToMatMulPass (4-D, static H and W, constant scales or sizes: a faster form).
        OnnxViaTorch("Resize", "upsample", _resize, devices=("cpu",), why="no ResizeGrad kernel on CPU in ORT 1.19.2"),
        OnnxViaTorch("GridSample", "grid_sampler", _grid_sample),
        OnnxViaTorch("Col2Im", "col2im", _col2im),  # F.fold under dynamo
        # After AveragePoolToConvPass (what it leaves: ceil_mode, a channel count not static).
        OnnxViaTorch(
            "AveragePool",
            "avg_pool",
            _avg_pool,
            why="AveragePoolGrad sizes its result from static shapes (a dynamic batch gives a wrong gradient)",
        ),
    )
}


def written(value: float) -> float:
    """A float attribute as its author wrote it: ONNX stores float attributes in float32, so
    ``epsilon=1e-5`` reads back as 9.99999974e-06; a float64 computation wants the decimal the
    float32 came from (the shortest one that rounds to it), which is the Python float eager used."""
    return float(str(np.float32(value)))


def _softmax(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """Softmax/LogSoftmax over one axis (opset 13 and later; before, they flatten from ``axis`` on)."""
    return [value(0), int(_attr(node, "axis", -1)), False]


def _layer_norm(node: Any, value: Callable[[int], Any], b: Any) -> list | None:
    """``LayerNormalization`` -> ``layer_norm(x, x.shape[axis:], scale, bias, eps)``, or with its
    statistics read, ``native_layer_norm``: the same three outputs (mean and inverse standard
    deviation keep the reduced axes as 1s)."""
    axis = int(_attr(node, "axis", -1))
    shape = b.op("Shape", value(0), start=axis)
    args = [value(0), shape, value(1), value(2), written(float(_attr(node, "epsilon", 1e-5)))]
    return args if len(node.outputs) > 1 else [*args, True]  # layer_norm's cudnn_enable


def _conv(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:

    x = node.inputs[0]
    rank = len(x.shape) - 2 if x.shape is not None else None
    if rank is None:
        return None
    pads = _symmetric_pads(node, rank, "a float64 Conv")
    return [
        value(0),
        value(1),
        value(2) if len(node.inputs) > 2 else None,
        list(_attr(node, "strides", [1] * rank)),
        pads,
        list(_attr(node, "dilations", [1] * rank)),
        False,
        [0] * rank,
        int(_attr(node, "group", 1)),
    ]


def _max_pool(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    from ..errors import PassError

    k = list(_attr(node, "kernel_shape", []))
    nd = len(k)
    if len(node.outputs) > 1 and node.outputs[1].uses():
        raise PassError(f"node {node.name!r}: a float64 MaxPool whose indices are read cannot be trained")
    pads = _symmetric_pads(node, nd, "a float64 MaxPool", refused=("storage_order",))
    return [
        value(0),
        k,
        list(_attr(node, "strides", [1] * nd)),
        pads,
        list(_attr(node, "dilations", [1] * nd)),
        bool(_attr(node, "ceil_mode", 0)),
    ]


def _global_pool(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    x = node.inputs[0]
    if x.shape is None:
        return None
    dims = list(range(2, len(x.shape)))
    return [value(0), dims, True] + ([None] if node.op_type == "GlobalAveragePool" else [])


def _gelu(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    return [value(0), _attr(node, "approximate", "none")]


def _fast_gelu(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """com.microsoft ``FastGelu`` (the fused tanh GELU of inference graphs), without its bias."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        return None
    return [value(0), "tanh"]


def _instance_norm(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """``InstanceNormalization`` -> ``instance_norm`` with the input's statistics."""
    return [value(0), value(1), value(2), None, None, True, 0.1, written(float(_attr(node, "epsilon", 1e-5))), False]


#: Ops that ORT 1.19.2's CPU provider cannot run or differentiate in float64 (its probe says which,
#: ``grad/probe.py``), run as PyTorch ops (``passes/double_precision.py``).
#: Keyed by (domain, op type).
DOUBLE_PRECISION: dict[tuple[str, str], OnnxViaTorch] = {
    (g.domain, g.onnx): g
    for g in (
        OnnxViaTorch("Relu", "relu", _unary(), devices=("cpu",), why="no float64 ReluGrad"),
        OnnxViaTorch(
            "LeakyRelu",
            "leaky_relu",
            _unary(lambda n: [written(float(_attr(n, "alpha", 0.01)))]),
            devices=("cpu",),
            why="no float64 LeakyReluGrad",
        ),
        OnnxViaTorch("Erf", "erf", _unary(), devices=("cpu",), why="no float64 Erf"),
        OnnxViaTorch("Sin", "sin", _unary(), devices=("cpu",), why="no float64 Cos"),
        OnnxViaTorch("Cos", "cos", _unary(), devices=("cpu",), why="no float64 Cos"),
        OnnxViaTorch("Softmax", "_softmax", _softmax, devices=("cpu",), why="no float64 SoftmaxGrad_13"),
        OnnxViaTorch("LogSoftmax", "_log_softmax", _softmax, devices=("cpu",), why="no float64 LogSoftmaxGrad_13"),
        OnnxViaTorch(
            "LayerNormalization",
            "layer_norm",
            _layer_norm,
            devices=("cpu",),
            why="the float64 LayerNormalizationGrad function body is invalid at opset 18",
        ),
        OnnxViaTorch("Gelu", "gelu", _gelu, devices=("cpu",), why="no float64 Erf", domain="com.microsoft"),
        OnnxViaTorch("Gelu", "gelu", _gelu, devices=("cpu",), why="no float64 Erf"),  # opset 20
        OnnxViaTorch("FastGelu", "gelu", _fast_gelu, devices=("cpu",), why="no float64 kernel", domain="com.microsoft"),
        OnnxViaTorch(
            "InstanceNormalization", "instance_norm", _instance_norm, devices=("cpu",), why="no float64 kernel"
        ),
        OnnxViaTorch("Conv", "convolution", _conv, devices=("cpu",), why="no float64 Conv"),
        OnnxViaTorch(
            "MatMul", "matmul", lambda n, v, b: [v(0), v(1)], devices=("cpu",), why="no float64 FusedMatMul (batched)"
        ),
        OnnxViaTorch("MaxPool", "max_pool", _max_pool, devices=("cpu",), why="no float64 MaxPoolGrad"),
        OnnxViaTorch("AveragePool", "avg_pool", _avg_pool, devices=("cpu",), why="no float64 AveragePool"),
        OnnxViaTorch("GlobalAveragePool", "mean.dim", _global_pool, devices=("cpu",), why="no float64 kernel"),
        OnnxViaTorch("GlobalMaxPool", "amax", _global_pool, devices=("cpu",), why="no float64 kernel"),
    )
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _var_needs_aten(c: list[Any]) -> bool:
    """``var``/``std`` (and their ``_mean`` forms) as TorchScript calls them, ``(self, dim, correction
    or unbiased, keepdim)``: a fractional correction, or ``keepdim`` with no dims (a full reduction)."""
    if len(c) != 4:
        return False
    fractional = _is_number(c[2]) and float(c[2]) != int(c[2])
    return fractional or (c[1] in (None, [], ()) and bool(c[3]))


@dataclass(frozen=True)
class AtenViaTorch:
    """An ATen op whose ONNX form loses what training needs: exported as an ATen node instead, so
    PyTorch's kernel runs it and PyTorch's autograd differentiates it.

    Attributes:
        aten: the op's name (``torch.ops.aten.<aten>``).
        exporters: the exporters whose ONNX form is wrong (``"torchscript"``, ``"dynamo"``).
        when: ``when(constants)`` -> whether this call needs the ATen node; ``constants`` holds the
            call's constant non-tensor arguments by position (None where not constant). None: always.
        why: what the ONNX form gets wrong.
    """

    aten: str
    exporters: tuple[str, ...]
    why: str
    when: Callable[[list[Any]], bool] | None = None


#: ATen ops exported as ATen nodes (``export/symbolics.py`` for TorchScript, ``export/aten_fallback.py``
#: for dynamo), where their ``when`` says so.
ATEN_OPS: tuple[AtenViaTorch, ...] = (
    AtenViaTorch(
        "softplus",
        ("torchscript",),
        "torch's symbolic drops the threshold (values above it differ)",
        when=lambda c: not (c[1] in (1, 1.0) and c[2] in (20, 20.0)),
    ),
    AtenViaTorch("threshold", ("torchscript",), "torch writes an org.pytorch.aten::threshold op ORT cannot load"),
    AtenViaTorch("diagonal", ("torchscript",), "torch's symbolic writes an If node, which ORT cannot differentiate"),
    AtenViaTorch(
        "cdist",
        ("torchscript",),
        "torch's symbolic is Sqrt of summed squares: its gradient is NaN at a zero distance (eager's is 0)",
    ),
    *(
        AtenViaTorch(
            pool,
            ("torchscript", "dynamo"),
            "ONNX AveragePool has no divisor: divisor_override was dropped (the sums divided by the window size)",
            when=lambda c: len(c) > 6 and _is_number(c[6]),
        )
        for pool in ("avg_pool2d", "avg_pool3d")
    ),
    *(
        AtenViaTorch(
            norm,
            ("torchscript", "dynamo"),
            "the ONNX form of a p-norm (p not 1, 2 or inf) is Pow(ReduceSum(Pow(|x|, p)), 1/p): its gradient "
            "is NaN or inf where the norm is 0 (eager's is 0)",
            when=lambda c: len(c) > 1 and _is_number(c[1]) and float(c[1]) not in (1.0, 2.0, math.inf, -math.inf),
        )
        for norm in ("linalg_vector_norm", "linalg_norm")
    ),
    AtenViaTorch(
        "index_fill",
        ("torchscript", "dynamo"),
        "the fill value's gradient through the ONNX Expand/ScatterElements form is wrong",
        when=lambda c: len(c) > 3 and c[3] is None,  # a tensor fill value (its gradient is needed)
    ),
    AtenViaTorch(
        "pairwise_distance",
        ("torchscript",),
        "torch's symbolic raises to 1/(p+eps) and drops the absolute value (wrong for any p but 2 and for odd p)",
    ),
    AtenViaTorch(
        "cosine_similarity",
        ("torchscript",),
        "torch's symbolic does not broadcast the norms and clamps their product, not each norm, with eps",
    ),
    *(
        AtenViaTorch(
            reduction,
            ("torchscript",),
            "torch's symbolic reads the correction as an int (1.3 becomes 1) and drops keepdim on a full reduction",
            when=_var_needs_aten,
        )
        for reduction in ("var", "std", "var_mean", "std_mean")
    ),
    AtenViaTorch("lerp", ("torchscript",), "the gradient of a broadcast weight through torch's Where form is wrong"),
    AtenViaTorch(
        "index_put",
        ("torchscript",),
        "torch's symbolic of accumulate=True adds to a gathered copy and scatters it back: a repeated index keeps one "
        "update (eager sums them)",
        when=lambda c: len(c) > 3 and c[3] is not None and bool(c[3]),  # (a constant True reads as 1.0)
    ),
    AtenViaTorch(
        "pad",
        ("torchscript",),
        "torch's circular padding is built from slices that assume non-negative pads",
        when=lambda c: len(c) > 2 and c[2] == "circular",
    ),
)


# ------------------------------------------------------------------------------ ortwrap's own ops
def _prelu(x, slope):
    import torch

    return torch.where(x > 0, x, x * slope)


def _hard_sigmoid_impl(x, alpha: float, beta: float):
    import torch.nn.functional as F

    if abs(alpha - 1 / 6) < 1e-7 and beta == 0.5:
        return F.hardsigmoid(x)
    return (x * alpha + beta).clamp(0.0, 1.0)


def _shrink(x, lambd: float, bias: float):
    import torch

    zero = torch.zeros((), dtype=x.dtype)
    return torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, zero))


def _reduce_impl(x, kind: str, dims: list[int], keepdim: bool):
    import torch

    dims = list(dims) or list(range(x.dim()))
    if kind == "prod":
        for d in sorted((d % x.dim() for d in dims), reverse=True):
            x = x.prod(d, keepdim=True)
        return x if keepdim else x.squeeze(dims) if dims else x
    if kind == "l1":
        return torch.linalg.vector_norm(x, 1, dims, keepdim)
    if kind == "l2":
        return torch.linalg.vector_norm(x, 2, dims, keepdim)
    if kind == "sum_square":
        return (x * x).sum(dims, keepdim)
    if kind == "log_sum":
        return x.sum(dims, keepdim).log()
    raise ValueError(f"ortwrap_ops::reduce: unknown kind {kind!r}")


def _cumsum_impl(x, axis: int, exclusive: bool, reverse: bool):
    y = x.flip(axis) if reverse else x
    # NOTE: dtype=x.dtype: torch's cumsum of an integer tensor is int64, and an ATen node's output
    # must have the type the graph declares for it (ORT reads the buffer as that type).
    y = y.cumsum(axis, dtype=x.dtype)
    if exclusive:
        y = y - (x.flip(axis) if reverse else x)
    return y.flip(axis) if reverse else y


def _pad_impl(x, pads: list[int], mode: str):
    """ONNX pads ([begin per dim, end per dim]) in ``F.pad``'s order (last dim first)."""
    import torch.nn.functional as F

    rank = x.dim()
    begin, end = pads[:rank], pads[rank:]
    first = next((i for i in range(rank) if begin[i] or end[i]), rank)
    torch_pad: list[int] = []
    for d in range(rank - 1, first - 1, -1):
        torch_pad += [begin[d], end[d]]
    return F.pad(x, torch_pad, mode=mode) if torch_pad else x.clone()


def _slice_impl(x, starts: list[int], ends: list[int], axes: list[int], steps: list[int]):
    """ONNX Slice (negative steps included) from ``flip`` and ``aten::slice``."""
    import torch

    for s, e, a, st in zip(starts, ends, axes, steps):
        a = a % x.dim()
        dim = x.shape[a]
        if st > 0:
            x = torch.ops.aten.slice.Tensor(x, a, s, e, st)
            continue
        s = s + dim if s < 0 else s
        e = e + dim if e < 0 else e
        s, e = min(max(s, 0), dim - 1), min(max(e, -1), dim - 1)
        x = torch.ops.aten.slice.Tensor(x.flip(a), a, dim - 1 - s, max(dim - 1 - e, dim - 1 - s), -st)
    return x  # a view of the input is copied by the ATen bridge


def _scatter_nd_add(data, indices, updates):
    """ONNX ``ScatterND(reduction="add")``: ``indices[..., k]`` index the first dims of ``data``."""
    return data.index_put(tuple(indices[..., i] for i in range(indices.shape[-1])), updates, accumulate=True)


def _cat2(a, b, dim: int):
    import torch

    return torch.cat([a, b], dim)


def _squeeze_ones(x, dims: list[int]):
    """``x.squeeze(dims)`` where the export traced every ``dims`` size as 1: a size that is not 1 at
    run time is an error (the graph after it was traced for the squeezed rank)."""
    dims = [d % x.dim() for d in dims]
    if x.device.type == "meta":  # type inference (symbolic dims stand in as 2): the squeezed rank
        return x.new_empty([s for i, s in enumerate(x.shape) if i not in dims])
    for d in dims:
        if x.shape[d] != 1:
            raise RuntimeError(
                f"squeeze({d}) was exported for a size-1 dimension; this input has size {x.shape[d]} "
                f"(shape {tuple(x.shape)}): the graph after it assumes the squeezed rank"
            )
    return x.squeeze(dims)


#: torch's ScalarType codes of the float dtypes (``bridge/aten.py`` ``_SCALAR_TYPES``)
_FLOAT_CODES = {5: "float16", 6: "float32", 7: "float64", 15: "bfloat16"}


def _dtypes(codes) -> list:
    """The torch dtypes named by a ``dtypes`` argument (torch's ScalarType codes)."""
    import torch

    return [getattr(torch, _FLOAT_CODES[int(c)]) for c in codes]


#: A last ``dtypes`` code of the bf16 GEMM ops (``linear``, ``matmul`` and their variants): return
#: an empty tensor in place of the weight's bf16 copy, whose backward casts the weight itself again
#: (``grad.recompute._recast_weight_copies``).
NO_WEIGHT_COPY = -1


def _weight_copy(wc, dtypes, n_inputs: int):
    """``wc`` (the weight's copy in the compute dtype), or an empty tensor where ``dtypes`` (of an op
    with ``n_inputs`` float inputs) ends with :data:`NO_WEIGHT_COPY`."""
    if len(dtypes) > 2 + n_inputs and int(dtypes[-1]) == NO_WEIGHT_COPY:
        return wc.new_empty(0)
    return wc


def _saved(x, dtype):
    """``x`` in ``dtype`` for the backward. A tensor already in it is returned as it is: the ATen
    bridge copies a result that shares an input's memory (ORT owns the input)."""
    return x.to(dtype)


def _linear(x, w, b, dtypes: list[int]):
    """``F.linear`` computed in ``dtypes[0]`` (a bf16 GEMM): the result, rounded to that dtype and
    returned in ``dtypes[1]``, then the copies of x and w in the compute dtype (what the backward
    reads). ``dtypes``: torch's ScalarType codes of [compute, result, x, w, b]; the backward returns
    each input's gradient in its dtype (``passes/half_values.py`` keeps some of them bf16)."""
    import torch.nn.functional as F

    compute, result = _dtypes(dtypes[:2])
    xc, wc = _saved(x, compute), _saved(w, compute)
    return F.linear(xc, wc, None if b is None else b.to(compute)).to(result), xc, _weight_copy(wc, dtypes, 3)


def _matmul(a, b, dtypes: list[int]):
    """``torch.matmul`` computed in ``dtypes[0]``: the result in ``dtypes[1]``, then the copies of a
    and b. ``dtypes``: [compute, result, a, b] (torch's codes)."""
    import torch

    compute, result = _dtypes(dtypes[:2])
    ac, bc = _saved(a, compute), _saved(b, compute)
    return torch.matmul(ac, bc).to(result), ac, _weight_copy(bc, dtypes, 2)


def _attention(q, kt, v, mask, scale: float, dtypes: list[int]):
    """Softmax attention (PyTorch's CPU flash attention) computed in ``dtypes[0]`` from q, k^T and
    v: the output in ``dtypes[1]``, then what the backward reads with it: the operands in the
    compute dtype (k, not k^T) and the log-sum-exp. ``dtypes``: [compute, result, q, kt, v]."""
    from .._compat.torch import flash_attention_cpu

    compute, result = _dtypes(dtypes[:2])
    qc, kc, vc = _saved(q, compute), kt.to(compute).transpose(-1, -2).contiguous(), _saved(v, compute)
    out, lse = flash_attention_cpu()[0](qc, kc, vc, 0.0, False, attn_mask=mask, scale=scale)
    return out.to(result), qc, kc, vc, lse


def _linear_keep_input(x, w, b, dtypes: list[int]):
    """:func:`_linear` of an ``x`` already in the compute dtype (``passes/half_values.py``): the
    result and w's copy; the backward reads x itself (a returned x would be copied: see ``_saved``)."""
    y, _, wc = _linear(x, w, b, dtypes)
    return y, wc


def _linear_keep_input_half(x, w, b, dtypes: list[int]):
    """:func:`_linear_keep_input` whose result is also read in the compute dtype (a float32 result
    that the graph also narrows: an LM head's logits, float32 for the loss and bf16 for the caller,
    as eager autocast returns them): the result, w's copy, then the result in the compute dtype (the
    GEMM's own output, bf16-exact) in place of ORT's ``Cast`` of the float32 one."""
    import torch.nn.functional as F

    compute, result = _dtypes(dtypes[:2])
    wc = _saved(w, compute)
    y = F.linear(x, wc, None if b is None else b.to(compute))
    return y.to(result), _weight_copy(wc, dtypes, 3), y


def _attention_keep_inputs(q, kt, v, mask, scale: float, dtypes: list[int]):
    """:func:`_attention` of q, k^T and v already in the compute dtype: the result, k (contiguous)
    and the log-sum-exp; the backward reads q and v themselves."""
    out, _, kc, _, lse = _attention(q, kt, v, mask, scale, dtypes)
    return out, kc, lse


def _attention_bf16_backward(
    grad, qc, kc, vc, out, lse, mask, scale: float, dtypes: list[int], output_mask: list[bool]
):
    """dq, d(k^T), dv of :func:`_attention` (PyTorch's flash attention backward) in the inputs'
    dtypes; ``out`` is the forward's result (in the compute dtype exactly, whatever its dtype)."""
    import torch

    from .._compat.torch import flash_attention_cpu

    types = _dtypes(dtypes[2:5])
    dq, dk, dv = flash_attention_cpu()[1](
        grad.to(qc.dtype), qc, kc, vc, out.to(qc.dtype), lse, 0.0, False, attn_mask=mask, scale=scale
    )
    return (
        dq.to(types[0]) if output_mask[0] else torch.empty(0, dtype=types[0]),
        dk.transpose(-1, -2).to(types[1]).contiguous() if output_mask[1] else torch.empty(0, dtype=types[1]),
        dv.to(types[2]) if output_mask[2] else torch.empty(0, dtype=types[2]),
    )


def _attention_backward(grad, qc, kc, vc, out, lse, mask, scale: float, output_mask: list[bool], causal=False):
    """dq, d(k^T), dv of :func:`_attention` (PyTorch's flash attention backward), in grad's dtype."""
    import torch

    from .._compat.torch import flash_attention_cpu

    dq, dk, dv = flash_attention_cpu()[1](
        grad.to(qc.dtype), qc, kc, vc, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )
    empty = torch.empty(0, dtype=grad.dtype)
    return (
        dq.to(grad.dtype) if output_mask[0] else empty,
        dk.transpose(-1, -2).to(grad.dtype).contiguous() if output_mask[1] else empty,
        dv.to(grad.dtype) if output_mask[2] else empty,
    )


def _gelu(x, approximate: int):
    """``F.gelu`` in x's dtype (PyTorch's bf16 kernel for the bf16 values of ``passes/half_values.py``)."""
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh" if approximate else "none")


def _gelu_backward(grad, x, approximate: int, output_mask: list[bool]):
    """dx of :func:`_gelu` (PyTorch's ``gelu_backward``), in x's dtype."""
    import torch

    return [torch.ops.aten.gelu_backward(grad.to(x.dtype), x, approximate="tanh" if approximate else "none")]


def _linear_f32(x, w, b):
    """``F.linear`` in the inputs' dtype (float32): its backward reads the inputs themselves."""
    import torch.nn.functional as F

    return F.linear(x, w, b)


def _matmul_f32(a, b):
    """``torch.matmul`` in the inputs' dtype (float32)."""
    import torch

    return torch.matmul(a, b)


def _attention_f32(q, kt, v, mask, scale: float):
    """:func:`_attention` in the inputs' dtype (float32): the output, then k (contiguous, not k^T) and
    the log-sum-exp, which the backward reads with q, v and the output (no T x T probabilities)."""
    from .._compat.torch import flash_attention_cpu

    k = kt.transpose(-1, -2).contiguous()
    out, lse = flash_attention_cpu()[0](q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    return out, k, lse


def _attention_causal_f32(q, kt, v, scale: float):
    """:func:`_attention_f32` with flash attention's causal mask (top-left aligned) instead of a mask
    tensor: the blocks above the diagonal are skipped, not computed and masked."""
    from .._compat.torch import flash_attention_cpu

    k = kt.transpose(-1, -2).contiguous()
    out, lse = flash_attention_cpu()[0](q, k, v, 0.0, True, attn_mask=None, scale=scale)
    return out, k, lse


def _attention_causal_backward(grad, q, k, v, out, lse, scale: float, output_mask: list[bool]):
    """dq, d(k^T), dv of :func:`_attention_causal_f32`."""
    return _attention_backward(grad, q, k, v, out, lse, None, scale, output_mask, causal=True)


def _attention_bthd_f32(q, k, v, mask, scale: float, causal: bool):
    """Flash attention on q, k, v in the projections' [B, T, H, D] layout (the kernel reads the
    [B, H, T, D] views, strided; nothing copied): the output in [B, T, H, D] (flash attention writes
    it so) and the log-sum-exp, which the backward reads with q, k, v and the output."""
    from .._compat.torch import flash_attention_cpu

    out, lse = flash_attention_cpu()[0](
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2).contiguous(), lse


def _attention_bthd_backward(grad, q, k, v, out, lse, mask, scale: float, causal: bool, output_mask: list[bool]):
    """dq, dk, dv of :func:`_attention_bthd_f32`, in [B, T, H, D]."""
    import torch

    from .._compat.torch import flash_attention_cpu

    t = [x.transpose(1, 2) for x in (grad, q, k, v, out)]
    grads = flash_attention_cpu()[1](*t, lse, 0.0, causal, attn_mask=mask, scale=scale)
    empty = torch.empty(0, dtype=grad.dtype)
    return tuple(d.transpose(1, 2).contiguous() if m else empty for d, m in zip(grads, output_mask))


def _sum_to(t, shape):
    """``t`` summed over the dims it was broadcast along to reach its shape from ``shape``."""
    lead = t.dim() - len(shape)
    if lead:
        t = t.sum(list(range(lead)))
    dims = [i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1]
    return t.sum(dims, keepdim=True) if dims else t


def _linear_backward(grad, xc, wc, output_mask: list[bool]):
    """dx = dy W, dW = dy^T x, db = sum(dy) from the forward's copies ``xc``, ``wc`` (in the
    compute dtype), as eager autocast computes them: GEMMs in that dtype (the output gradient
    rounded to it first), results in the output gradient's dtype; nothing recomputed."""
    import torch

    empty = torch.empty(0, dtype=grad.dtype)
    g = grad.to(wc.dtype)
    g2 = g.reshape(-1, g.shape[-1])
    dx = torch.matmul(g, wc).to(grad.dtype) if output_mask[0] else empty
    dw = g2.t().mm(xc.reshape(-1, xc.shape[-1])).to(grad.dtype) if output_mask[1] else empty
    db = g2.sum(0).to(grad.dtype) if output_mask[2] else empty
    return dx, dw, db


def _matmul_backward(grad, ac, bc, output_mask: list[bool]):
    """da = dy b^T, db = a^T dy from the forward's copies (rank >= 2), summed over broadcast dims."""
    import torch

    empty = torch.empty(0, dtype=grad.dtype)
    g = grad.to(ac.dtype)
    da = _sum_to(torch.matmul(g, bc.transpose(-1, -2)), ac.shape).to(grad.dtype) if output_mask[0] else empty
    if not output_mask[1]:
        db = empty
    elif bc.dim() == 2:  # a weight: one GEMM over all rows
        db = ac.reshape(-1, ac.shape[-1]).t().mm(g.reshape(-1, g.shape[-1])).to(grad.dtype)
    else:
        db = _sum_to(torch.matmul(ac.transpose(-1, -2), g), bc.shape).to(grad.dtype)
    return da, db


def _weight_grad(a, b):
    """``a^T b`` of two row-major [rows, n] operands in a half dtype (a weight's gradient, the rows
    reduced). NOTE: where ``a`` is no wider than ``b``, ``a^T`` is made contiguous first: PyTorch's
    bf16 GEMM (oneDNN, AMX) reads a transposed left operand slowly, and copying the narrower operand
    costs less than that (GPT-2's 3072 -> 768 layer: 5.4 -> 3.8 ms CPU with the copy). A wider
    ``a`` is read transposed: its transposing copy (PyTorch's is slow, and cold in a training step)
    cost more than it saved. The products are summed in float32 either way; only the order of the
    sums differs (rare last-bit differences from eager, which reads ``a`` transposed)."""
    return (a.t().contiguous() if a.shape[1] <= b.shape[1] else a.t()).mm(b)


def _linear_bf16_backward(grad, xc, wc, dtypes: list[int], output_mask: list[bool]):
    """:func:`_linear_backward` of :func:`_linear` with each gradient cast once, from the compute
    dtype to its input's dtype (``dtypes`` [compute, result, x, w, b]): a bf16 dx of a float32
    output gradient is not widened to float32 and narrowed again."""
    compute = _dtypes(dtypes[:1])[0]
    return _linear_grads(grad.to(compute), xc, wc.to(compute), _dtypes(dtypes[2:5]), output_mask)


def _linear_bf16_backward_half(grad, grad_half, xc, wc, dtypes: list[int], output_mask: list[bool]):
    """:func:`_linear_bf16_backward` of :func:`_linear_keep_input_half`: the result's two gradients
    summed as eager autocast sums them (the float32 one rounded to the compute dtype first, then
    added in it: eager's bf16 result had both readers). Either may be absent (no gradient reaches
    that result: ``OPTIONAL_GRADIENT_OPS``)."""
    compute = _dtypes(dtypes[:1])[0]
    g = None if grad is None else grad.to(compute)
    if grad_half is not None:
        g = grad_half.to(compute) if g is None else g + grad_half.to(compute)
    return _linear_grads(g, xc, wc.to(compute), _dtypes(dtypes[2:5]), output_mask)


def _linear_grads(g, xc, wc, types: list, output_mask: list[bool]):
    """dx, dW, db of a linear from its output gradient ``g`` in the compute dtype, each in ``types``."""
    import torch

    g2 = g.reshape(-1, g.shape[-1])
    dx = torch.matmul(g, wc).to(types[0]) if output_mask[0] else torch.empty(0, dtype=types[0])
    if output_mask[1]:
        dw = _weight_grad(g2, xc.reshape(-1, xc.shape[-1])).to(types[1])
    else:
        dw = torch.empty(0, dtype=types[1])
    db = g2.sum(0).to(types[2]) if output_mask[2] else torch.empty(0, dtype=types[2])
    return dx, dw, db


def _matmul_bf16_backward(grad, ac, bc, dtypes: list[int], output_mask: list[bool]):
    """:func:`_matmul_backward` of :func:`_matmul`, each gradient cast once to its input's dtype."""
    import torch

    types = _dtypes(dtypes[2:4])
    bc = bc.to(ac.dtype)  # the weight itself where the backward reads it (grad/recompute.py)
    g = grad.to(ac.dtype)
    if not output_mask[0]:
        da = torch.empty(0, dtype=types[0])
    else:
        da = _sum_to(torch.matmul(g, bc.transpose(-1, -2)), ac.shape).to(types[0])
    if not output_mask[1]:
        db = torch.empty(0, dtype=types[1])
    elif bc.dim() == 2:  # a weight: one GEMM over all rows
        db = _weight_grad(ac.reshape(-1, ac.shape[-1]), g.reshape(-1, g.shape[-1])).to(types[1])
    else:
        db = _sum_to(torch.matmul(ac.transpose(-1, -2), g), bc.shape).to(types[1])
    return da, db


_OPS = {
    "cat2": ("cat2(Tensor a, Tensor b, int dim) -> Tensor", _cat2),
    "scatter_nd_add": ("scatter_nd_add(Tensor data, Tensor indices, Tensor updates) -> Tensor", _scatter_nd_add),
    "squeeze_ones": ("squeeze_ones(Tensor x, int[] dims) -> Tensor", _squeeze_ones),
    "linear": ("linear(Tensor x, Tensor w, Tensor? b, int[] dtypes) -> (Tensor, Tensor, Tensor)", _linear),
    "matmul": ("matmul(Tensor a, Tensor b, int[] dtypes) -> (Tensor, Tensor, Tensor)", _matmul),
    "attention": (
        "attention(Tensor q, Tensor kt, Tensor v, Tensor? mask, float scale, int[] dtypes) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        _attention,
    ),
    "linear_keep_input": (
        "linear_keep_input(Tensor x, Tensor w, Tensor? b, int[] dtypes) -> (Tensor, Tensor)",
        _linear_keep_input,
    ),
    "linear_keep_input_half": (
        "linear_keep_input_half(Tensor x, Tensor w, Tensor? b, int[] dtypes) -> (Tensor, Tensor, Tensor)",
        _linear_keep_input_half,
    ),
    "attention_keep_inputs": (
        "attention_keep_inputs(Tensor q, Tensor kt, Tensor v, Tensor? mask, float scale, int[] dtypes) "
        "-> (Tensor, Tensor, Tensor)",
        _attention_keep_inputs,
    ),
    "attention_bf16_backward": (
        "attention_bf16_backward(Tensor grad, Tensor qc, Tensor kc, Tensor vc, Tensor out, Tensor lse, Tensor? mask, "
        "float scale, int[] dtypes, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _attention_bf16_backward,
    ),
    "linear_bf16_backward": (
        "linear_bf16_backward(Tensor grad, Tensor xc, Tensor wc, int[] dtypes, bool[3] output_mask) "
        "-> (Tensor, Tensor, Tensor)",
        _linear_bf16_backward,
    ),
    "linear_bf16_backward_half": (
        "linear_bf16_backward_half(Tensor? grad, Tensor? grad_half, Tensor xc, Tensor wc, int[] dtypes, "
        "bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _linear_bf16_backward_half,
    ),
    "matmul_bf16_backward": (
        "matmul_bf16_backward(Tensor grad, Tensor ac, Tensor bc, int[] dtypes, bool[2] output_mask) -> (Tensor, Tensor)",
        _matmul_bf16_backward,
    ),
    "gelu": ("gelu(Tensor x, int approximate) -> Tensor", _gelu),
    "gelu_backward": (
        "gelu_backward(Tensor grad, Tensor x, int approximate, bool[1] output_mask) -> Tensor[]",
        _gelu_backward,
    ),
    "attention_backward": (
        "attention_backward(Tensor grad, Tensor qc, Tensor kc, Tensor vc, Tensor out, Tensor lse, Tensor? mask, "
        "float scale, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _attention_backward,
    ),
    "linear_backward": (
        "linear_backward(Tensor grad, Tensor xc, Tensor wc, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _linear_backward,
    ),
    "matmul_backward": (
        "matmul_backward(Tensor grad, Tensor ac, Tensor bc, bool[2] output_mask) -> (Tensor, Tensor)",
        _matmul_backward,
    ),
    "linear_f32": ("linear_f32(Tensor x, Tensor w, Tensor? b) -> Tensor", _linear_f32),
    "matmul_f32": ("matmul_f32(Tensor a, Tensor b) -> Tensor", _matmul_f32),
    "attention_f32": (
        "attention_f32(Tensor q, Tensor kt, Tensor v, Tensor? mask, float scale) -> (Tensor, Tensor, Tensor)",
        _attention_f32,
    ),
    "attention_causal_f32": (
        "attention_causal_f32(Tensor q, Tensor kt, Tensor v, float scale) -> (Tensor, Tensor, Tensor)",
        _attention_causal_f32,
    ),
    "attention_causal_backward": (
        "attention_causal_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, "
        "bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _attention_causal_backward,
    ),
    "attention_bthd_f32": (
        "attention_bthd_f32(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal) -> (Tensor, Tensor)",
        _attention_bthd_f32,
    ),
    "attention_bthd_backward": (
        "attention_bthd_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? mask, "
        "float scale, bool causal, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        _attention_bthd_backward,
    ),
    "slice": ("slice(Tensor x, int[] starts, int[] ends, int[] axes, int[] steps) -> Tensor", _slice_impl),
    "pad": ("pad(Tensor x, int[] pads, str mode) -> Tensor", _pad_impl),
    "reduce": ("reduce(Tensor x, str kind, int[] dims, bool keepdim) -> Tensor", _reduce_impl),
    "cumsum": ("cumsum(Tensor x, int axis, bool exclusive, bool reverse) -> Tensor", _cumsum_impl),
    "prelu": ("prelu(Tensor x, Tensor slope) -> Tensor", _prelu),
    "hard_sigmoid": ("hard_sigmoid(Tensor x, float alpha, float beta) -> Tensor", _hard_sigmoid_impl),
    "shrink": ("shrink(Tensor x, float lambd, float bias) -> Tensor", _shrink),
}
_library: list = []

#: ortwrap ops that compute in the dtype their last argument, ``dtypes``, names first (torch's
#: ScalarType codes: [compute, result, each float input]), on inputs of any float dtype: their first
#: output has the result dtype, the others are what the backward reads (the inputs' copies in the
#: compute dtype), and the backward returns each input's gradient in that input's dtype.
DTYPE_ARGUMENT_OPS = frozenset(
    f"{OPS_NAMESPACE}::{op}"
    for op in ("linear", "matmul", "attention", "linear_keep_input", "linear_keep_input_half", "attention_keep_inputs")
)
#: ortwrap ops whose gradient is one explicit backward op, not the ATen bridge's vjp (which
#: recomputes the forward under autograd: a third more GEMM work for a matmul). The backward op's
#: last argument, ``output_mask``, is filled from the gradients the graph uses
#: (``bridge.aten.mark_used_outputs``). ``passes/half_matmul.py`` writes these ops; their backward
#: reads the copies of the inputs in the compute dtype that the forward returns (``O(1)``, ``O(2)``)
#: and the forward's ``dtypes``; ``passes/half_values.py`` writes ``ortwrap_ops::gelu`` (bf16);
#: that of the ``*_f32`` ops (float32, ``Options.gemm``) reads the forward's inputs (``I(0)``, ``I(1)``).
TORCH_OP_GRADIENTS: dict[str, KernelGradient] = {
    f"{OPS_NAMESPACE}::linear": _grad(
        f"{OPS_NAMESPACE}::linear_bf16_backward",
        ["GO(0)", "O(1)", "O(2)", "I(3)"],
        ["GI(0)", "GI(1)", "GI(2)"],
        stop=[3],
    ),
    f"{OPS_NAMESPACE}::linear_keep_input": _grad(
        f"{OPS_NAMESPACE}::linear_bf16_backward",
        ["GO(0)", "I(0)", "O(1)", "I(3)"],
        ["GI(0)", "GI(1)", "GI(2)"],
        stop=[3],
    ),
    f"{OPS_NAMESPACE}::linear_keep_input_half": _grad(
        f"{OPS_NAMESPACE}::linear_bf16_backward_half",
        ["GO(0)", "GO(2)", "I(0)", "O(1)", "I(3)"],
        ["GI(0)", "GI(1)", "GI(2)"],
        stop=[3],
    ),
    f"{OPS_NAMESPACE}::attention_keep_inputs": _grad(
        f"{OPS_NAMESPACE}::attention_bf16_backward",
        ["GO(0)", "I(0)", "O(1)", "I(2)", "O(0)", "O(2)", "I(3)", "I(4)", "I(5)"],
        ["GI(0)", "GI(1)", "GI(2)"],
        stop=[3, 4, 5],
    ),
    f"{OPS_NAMESPACE}::matmul": _grad(
        f"{OPS_NAMESPACE}::matmul_bf16_backward", ["GO(0)", "O(1)", "O(2)", "I(2)"], ["GI(0)", "GI(1)"], stop=[2]
    ),
    f"{OPS_NAMESPACE}::attention": _grad(
        f"{OPS_NAMESPACE}::attention_bf16_backward",
        ["GO(0)", "O(1)", "O(2)", "O(3)", "O(0)", "O(4)", "I(3)", "I(4)", "I(5)"],
        ["GI(0)", "GI(1)", "GI(2)"],
        stop=[3, 4, 5],
    ),
    f"{OPS_NAMESPACE}::gelu": _grad(f"{OPS_NAMESPACE}::gelu_backward", ["GO(0)", "I(0)", "I(1)"], ["GI(0)"], stop=[1]),
    f"{OPS_NAMESPACE}::linear_f32": _grad(
        f"{OPS_NAMESPACE}::linear_backward", ["GO(0)", "I(0)", "I(1)"], ["GI(0)", "GI(1)", "GI(2)"], stop=[]
    ),
    f"{OPS_NAMESPACE}::matmul_f32": _grad(
        f"{OPS_NAMESPACE}::matmul_backward", ["GO(0)", "I(0)", "I(1)"], ["GI(0)", "GI(1)"], stop=[]
    ),
    f"{OPS_NAMESPACE}::attention_f32": _grad(
        f"{OPS_NAMESPACE}::attention_backward",
        ["GO(0)", "I(0)", "O(1)", "I(2)", "O(0)", "O(2)", "I(3)", "I(4)"],
        ["GI(0)", "GI(1)", "GI(2)"],
        stop=[3, 4],
    ),
    f"{OPS_NAMESPACE}::attention_causal_f32": _grad(
        f"{OPS_NAMESPACE}::attention_causal_backward",
        ["GO(0)", "I(0)", "O(1)", "I(2)", "O(0)", "O(2)", "I(3)"],
        ["GI(0)", "GI(1)", "GI(2)"],
        stop=[3],
    ),
    f"{OPS_NAMESPACE}::attention_bthd_f32": _grad(
        f"{OPS_NAMESPACE}::attention_bthd_backward",
        ["GO(0)", "I(0)", "I(1)", "I(2)", "O(0)", "O(1)", "I(3)", "I(4)", "I(5)"],
        ["GI(0)", "GI(1)", "GI(2)"],
        stop=[3, 4, 5],
    ),
}


#: backward ops (of ``TORCH_OP_GRADIENTS``) that read two output gradients of which the graph may
#: produce only one: ORT's gradient builder names a missing one anyway (a value nothing produces,
#: which the session rejects); ``bridge.aten.drop_missing_gradients`` makes it an absent input.
OPTIONAL_GRADIENT_OPS = frozenset({f"{OPS_NAMESPACE}::linear_bf16_backward_half"})


def define_ops() -> None:
    """Define ortwrap's composite ops (``torch.ops.ortwrap_ops.*``) in this process, once.

    Each has ONNX semantics where no PyTorch op does (``PRelu``'s broadcast slope, ``HardSigmoid``'s
    alpha and beta, ``Shrink``'s bias); its autograd is that of its decomposition."""
    if _library:
        return
    import torch

    lib = torch.library.Library(OPS_NAMESPACE, "DEF")
    for name, (schema, fn) in _OPS.items():
        lib.define(schema)
        lib.impl(name, fn, "CompositeImplicitAutograd")
    _library.append(lib)


def constant_array(value: Any) -> np.ndarray:
    """The ATen bridge's encoding of a constant argument (``bridge/aten.py``)."""
    if isinstance(value, str):
        return np.frombuffer(value.encode("utf-8"), dtype=np.uint8).copy()
    if isinstance(value, bool):
        return np.array(value, dtype=np.bool_)
    if isinstance(value, int):
        return np.array(value, dtype=np.int64)
    if isinstance(value, float):
        return np.array(value, dtype=np.float64)
    if isinstance(value, (list, tuple)) and all(isinstance(v, bool) for v in value) and value:
        return np.array(value, dtype=np.bool_)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return np.array(value, dtype=np.int64).reshape(len(value))
    if isinstance(value, (list, tuple)):
        return np.array(value, dtype=np.float64).reshape(len(value))
    raise TypeError(f"{value!r} cannot be an ATen node argument")
