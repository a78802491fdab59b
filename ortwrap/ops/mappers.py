"""ONNX ops and ATen ops that ortwrap runs as PyTorch ops, and how each one's arguments map.

**Gradients ORT lacks** (:data:`GRADIENTS`). One mechanism: the op runs as an ATen node calling a
PyTorch op (``bridge/aten.py``), and its gradient is PyTorch's autograd of that op (the ATen
bridge's vjp). An :class:`OnnxViaTorch` entry names an ONNX op of the exported graph, the PyTorch op
that computes the same function and ``args``, which maps the node's inputs and attributes to that
op's arguments (or returns None to leave the node to ORT, or raises :class:`~ortwrap.errors.PassError`
saying what is not supported). ``passes/torch_gradients.py`` applies them to training graphs.
Where no PyTorch op has the ONNX op's semantics, ortwrap defines a composite op of its own in the
``ortwrap_ops`` namespace (``ops/torch_ops.py``; autograd comes from the composite's decomposition).

**float64 on CPU** (:data:`DOUBLE_PRECISION`): the same kind of entry for the ops ORT's CPU provider
cannot run or differentiate in float64 (``passes/double_precision.py``).

**ATen ops whose ONNX form is wrong** (:data:`ATEN_OPS`): an :class:`AtenViaTorch` entry makes the
exporters it names (TorchScript: ``export/symbolics.py``; dynamo: ``export/aten_fallback.py``) write
the op as an ATen node, with the same gradient mechanism.

**Any other ONNX op ORT cannot differentiate** (no gradient builder: ``Acosh``, ``Cosh``, ...): the
general rule of ``passes/torch_gradients.py`` asks ORT (a probe of the node alone) and, where its
gradient build fails, runs the PyTorch op of the same name and tensor arguments instead.

Each entry costs a Python call per node per step (forward, and one for its gradient), and runs
where ORT's ATen kernel runs; the CPU entries are tested, CUDA is not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .values import constant_value, written

__all__ = ["ATEN_OPS", "DOUBLE_PRECISION", "GRADIENTS", "AtenViaTorch", "OnnxViaTorch"]

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
            ``passes/_build.py``'s ``NodeBuilder``, adds nodes that compute others) or Python constants (int,
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


def _max_pool(node: Any, value: Callable[[int], Any], b: Any = None, what: str = "a float64 MaxPool") -> list | None:
    from ..errors import PassError

    k = list(_attr(node, "kernel_shape", []))
    nd = len(k)
    if len(node.outputs) > 1 and node.outputs[1].uses():
        raise PassError(f"node {node.name!r}: {what} whose indices are read cannot be trained")
    pads = _symmetric_pads(node, nd, what, refused=("storage_order",))
    return [
        value(0),
        k,
        list(_attr(node, "strides", [1] * nd)),
        pads,
        list(_attr(node, "dilations", [1] * nd)),
        bool(_attr(node, "ceil_mode", 0)),
    ]


def _max_pool_unsized(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    """A MaxPool that ortwrap's kernel left to ORT (ceil mode, indices read, 3-D, not float32) whose input has a
    dimension after the batch that shape inference left unknown (a TorchScript-exported reshape to computed
    sizes): ORT 1.19.2's MaxPoolGrad sizes its result from the inferred shape and would write past it."""
    x = node.inputs[0] if node.inputs else None
    if x is None or x.shape is None or all(isinstance(d, int) for d in list(x.shape)[1:]):
        return None  # ORT's, where it is sized (x's rank unknown: ORT's gradient build says what it lacks)
    return _max_pool(node, value, b, what="a MaxPool of an input whose sizes after the batch are not known statically")


def _axes_input(node: Any, index: int) -> list[int] | None:
    """Constant axes from input ``index`` (opset 18 reductions) or the ``axes`` attribute; None if
    they are computed at run time."""
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
        OnnxViaTorch("HardSwish", "ortwrap_ops::hardswish", _unary()),
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
            "ortwrap_ops::conv_transpose",
            _conv_transpose,
            devices=("cpu",),
            why="no ConvTransposeGrad kernel on CPU in ORT 1.19.2",
        ),
        # After ResizeToMatMulPass (4-D, static H and W, constant scales or sizes: a faster form).
        OnnxViaTorch("Resize", "upsample", _resize, devices=("cpu",), why="no ResizeGrad kernel on CPU in ORT 1.19.2"),
        OnnxViaTorch("GridSample", "grid_sampler", _grid_sample),
        OnnxViaTorch("Col2Im", "col2im", _col2im),  # F.fold under dynamo
        # After ortwrap's max_pool kernel (passes/native_cpu_kernels.py): what it leaves, where sizes are unknown.
        OnnxViaTorch(
            "MaxPool",
            "max_pool",
            _max_pool_unsized,
            devices=("cpu",),
            why="MaxPoolGrad sizes its result from static shapes (an unknown H or W writes past it)",
        ),
        # After AveragePoolToConvPass (what it leaves: ceil_mode, a channel count not static).
        OnnxViaTorch(
            "AveragePool",
            "avg_pool",
            _avg_pool,
            why="AveragePoolGrad sizes its result from static shapes (a dynamic batch gives a wrong gradient)",
        ),
    )
}


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


def _global_pool(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    x = node.inputs[0]
    if x.shape is None:
        return None
    dims = list(range(2, len(x.shape)))
    return [value(0), dims, True] + ([None] if node.op_type == "GlobalAveragePool" else [])


def _gelu_args(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
    return [value(0), _attr(node, "approximate", "none")]


def _fast_gelu_args(node: Any, value: Callable[[int], Any], b: Any = None) -> list | None:
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
        OnnxViaTorch("Gelu", "gelu", _gelu_args, devices=("cpu",), why="no float64 Erf", domain="com.microsoft"),
        OnnxViaTorch("Gelu", "gelu", _gelu_args, devices=("cpu",), why="no float64 Erf"),  # opset 20
        OnnxViaTorch(
            "FastGelu", "gelu", _fast_gelu_args, devices=("cpu",), why="no float64 kernel", domain="com.microsoft"
        ),
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


def _clamp_needs_aten(c: list[Any]) -> bool:
    """``clamp``/``clip``/``clamp_min``/``clamp_max`` (``(self, min[, max])``) whose ONNX form's ORT
    gradient differs from the installed torch's where ``x`` equals a bound. Number bounds become
    ``Clip``, whose ORT gradient passes the gradient there (torch 2.13's clamp; 2.14's gives 0; dynamo
    keeps number bounds numbers through its type promotion, float64/bf16 too:
    ``export/dynamo_translate._number_clamp_bounds``); tensor bounds (no
    constant bound) become ``Max``/``Min``, whose ORT gradient splits it half and half (2.14's; 2.13
    gives it all to ``x``)."""
    from .torch_ops import clamp_passes_gradient_at_bounds

    number_bounds = any(b is not None for b in c[1:3])
    return number_bounds != clamp_passes_gradient_at_bounds()


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
        floating_only: only where the first argument is floating (what the ONNX form gets wrong is a
            gradient: an integer ``clamp`` keeps its ONNX form, which shape inference sees through).
            TorchScript per call; dynamo by op (an integer call becomes an ATen node too where a
            floating call of the same op needs one).
    """

    aten: str
    exporters: tuple[str, ...]
    why: str
    when: Callable[[list[Any]], bool] | None = None
    floating_only: bool = False


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
    *(
        AtenViaTorch(
            clamp,
            ("torchscript", "dynamo"),
            "at a value equal to a bound, the ORT gradient of the ONNX form (Clip: passes it; Max/Min: splits it "
            "half and half) follows one torch release's clamp (2.13 passes it to x, 2.14 gives 0 for number "
            "bounds and splits it with tensor bounds): PyTorch's autograd of the installed torch",
            when=_clamp_needs_aten,
            floating_only=True,
        )
        for clamp in ("clamp", "clip", "clamp_min", "clamp_max")
    ),
    *(
        AtenViaTorch(
            op,
            ("torchscript", "dynamo"),
            "exported as Clip, whose ORT gradient passes the gradient at a value equal to a bound; "
            "hardtanh_backward gives 0 there (every torch release). CPU float32 training graphs run the "
            "ATen node on ortwrap's clamp kernel (passes/native_cpu_kernels.py: no Python call)",
        )
        for op in ("hardtanh", "relu6")
    ),
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
    *(
        AtenViaTorch(
            pool,
            ("dynamo",),
            "an adaptive average pool to any size but 1 has no torchlib translation: the decomposition writes a "
            "slice-and-mean per output cell (a minute to translate, 3x eager's step); PyTorch's kernel runs it",
            when=lambda c: len(c) > 1 and c[1] is not None and any(s != 1 for s in c[1]),
        )
        for pool in ("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d")
    ),
    AtenViaTorch(
        "im2col",
        ("dynamo",),
        "torchlib writes im2col (F.unfold) as Gathers of index tensors: 7.7x eager's step at 4x3x64x64 (issue 24 §4)",
    ),
    AtenViaTorch(
        "unfold",
        ("dynamo",),
        "torchlib writes Tensor.unfold as Gathers of computed window indices: 4.2x eager's step at 4x3x64x64 "
        "(issue 24 §4)",
    ),
    *(
        AtenViaTorch(
            fft,
            ("dynamo",),
            "ORT 1.19.2 has no gradient for DFT, its shape inference refuses torchlib's inverse one-sided DFT "
            "(irfft, hfft), and the decompositions pad and conjugate complex values torchlib cannot translate: "
            "PyTorch's kernel runs it, complex values in torchlib's real [..., 2] form (bridge/aten.py)",
        )
        for fft in (
            *(
                f"fft_{kind}{dims}"
                for kind in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
                for dims in ("", "2", "n")
            ),
            *("stft", "istft", "_fft_r2c", "_fft_c2c", "_fft_c2r"),
        )
    ),
    AtenViaTorch(
        "stft",
        ("torchscript",),
        "torch's symbolic writes ONNX STFT, which ORT 1.19.2 has no gradient for (the other FFTs have no "
        "symbolic: ATen nodes already, complex values in the real [..., 2] form, bridge/aten.py)",
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
    *(
        AtenViaTorch(
            random_op,
            ("torchscript", "dynamo"),
            "ONNX's Bernoulli/RandomNormalLike have no ORT gradient, and normal's written-out mean + std * noise "
            "would give std the noise as gradient; PyTorch's kernel draws, and its gradient is eager's zeros",
            # a tensor operand (a graph value: None among the constants); normal(0.5, 2.0, size) has
            # nothing to differentiate, and its dtype/device arguments cannot reach an ATen node
            when=lambda c: len(c) < 2 or c[0] is None or c[1] is None,
        )
        for random_op in ("bernoulli", "normal")
    ),
    AtenViaTorch(
        "tile",
        ("torchscript", "dynamo"),
        "both exporters write tile(x, ()) as ONNX Tile with no repeats, which ORT refuses on a 0-d x "
        "(Tile needs rank >= 1); PyTorch's tile returns a copy",
        when=lambda c: len(c) > 1 and isinstance(c[1], (list, tuple)) and len(c[1]) == 0,
    ),
    AtenViaTorch(
        "diagonal_scatter",
        ("dynamo",),
        "no torchlib translation, and the exporter's decomposition writes a copy_to into the diagonal view, "
        "which its functional-graph check refuses",
    ),
    AtenViaTorch(
        "special_erfcx",
        ("dynamo",),
        "torchlib writes erfcx as exp(x^2) * (1 - erf(x)): inf * 0 = NaN from x ~ 9.4 on in float32 (and 0 "
        "where erf rounds to 1), and its int64 exponent fails ORT's Pow gradient (a Sub of int64 and float)",
    ),
    AtenViaTorch(
        "special_log_ndtr",
        ("dynamo",),
        "no torchlib translation: the decomposition's where(x < 1, log(erfcx(-x/sqrt 2) / 2) - x^2/2, "
        "log1p(-erfc(x/sqrt 2) / 2)) differentiates both branches, and the unused one's gradient is inf for "
        "x < -5 (eager's is finite)",
    ),
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
