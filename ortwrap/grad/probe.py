"""Ask ONNX Runtime whether it can run (and differentiate) one node, by building it alone.

ORT 1.19.2's training wheel has no kernel-registry query (``get_all_opkernel_def`` is compiled out
of it), and what a node needs is more than its own kernel: the gradient ops ORT's builder writes
for it, and the function bodies ORT inlines (``LayerNormalizationGrad`` in float64 inlines a body
that is invalid at opset 18). So a probe builds a model holding only that node, with the node's
attributes, input types and ranks (constant inputs as initializers, with their values), runs the
gradient builder over it (or not, for inference graphs) and creates a CPU session. The answer is
cached per process by the probe model's bytes: a graph costs one probe per distinct op signature
(about 1 to 10 ms each).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnx_ir as ir

__all__ = ["UNKNOWN", "probe_node"]

#: Constant inputs larger than this are probed as graph inputs (their values rarely matter to
#: whether a kernel exists; small ones do: axes, shapes, exponents).
_MAX_CONST = 4096


def _value_info(name: str, value: ir.Value, as_float: bool) -> onnx.ValueInfoProto:
    dtype = int(value.dtype) if value.dtype is not None else 0
    if as_float and dtype == onnx.TensorProto.DOUBLE:
        dtype = onnx.TensorProto.FLOAT
    shape = None
    if value.shape is not None:
        shape = [d if isinstance(d, int) else (str(d.value) if d.value is not None else None) for d in value.shape]
    return onnx.helper.make_tensor_value_info(name, dtype, shape)


def probe_model(
    node: ir.Node, opsets: dict[str, int], constant_value, as_float: bool = False
) -> tuple[onnx.ModelProto, list[str]] | None:
    """The one-node model for ``node`` and the names of its inputs that get gradients; None where
    the node cannot be probed alone (subgraphs, inputs of unknown type or rank). ``as_float``: its float64
    values as float32."""
    if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
        return None
    proto = ir.serde.serialize_node(node)
    del proto.input[:]
    del proto.output[:]
    proto.name = "probe"
    inputs, initializers, grads = [], [], []
    for i, value in enumerate(node.inputs):
        if value is None:
            proto.input.append("")
            continue
        name = f"x{i}"
        proto.input.append(name)
        const = constant_value(value)
        if const is not None and const.size <= _MAX_CONST:
            const = np.asarray(const)
            if as_float and const.dtype == np.float64:
                const = const.astype(np.float32)
            initializers.append(onnx.numpy_helper.from_array(const, name))
            continue
        if value.dtype is None or (value.dtype.is_floating_point() and value.shape is None):
            return None  # gradients depend on ranks: a probe without them would answer another question
        inputs.append(_value_info(name, value, as_float))
        if value.dtype.is_floating_point():
            grads.append(name)
    outputs = []
    for j, value in enumerate(node.outputs):
        name = f"y{j}"
        proto.output.append(name)
        if value.dtype is None:  # ORT infers it
            outputs.append(onnx.helper.make_value_info(name, onnx.TypeProto()))
            continue
        outputs.append(_value_info(name, value, as_float))
    graph = onnx.helper.make_graph([proto], "probe", inputs, outputs, initializer=initializers)
    imports = [onnx.helper.make_opsetid(d, v) for d, v in opsets.items()]
    return onnx.helper.make_model(graph, opset_imports=imports, ir_version=8), grads


#: What :func:`probe_node` answers for a node it cannot build alone.
UNKNOWN = "its input types or ranks are unknown, so ortwrap cannot ask ONNX Runtime"


def probe_node(
    node: ir.Node,
    opsets: dict[str, int],
    *,
    with_backward: bool,
    constant_value,
    as_float: bool = False,
    every_gradient: bool = False,
) -> str | None:
    """Why ORT's CPU provider cannot run ``node`` (forward, and with ``with_backward`` its gradient),
    or None if it can; :data:`UNKNOWN` where the node cannot be probed alone.

    Args:
        node: the node, with typed inputs and outputs.
        opsets: the model's opset imports.
        with_backward: probe its gradient too.
        constant_value: ``constant_value(value)`` -> the value's constant array, or None.
        as_float: probe the node with its float64 values made float32.
        every_gradient: the gradient of every float input that is not a constant must build (by
            default an input ORT gives no gradient, such as BatchNorm's running statistics, is
            left out; ``Clip``'s tensor bounds are such inputs, which PyTorch differentiates).
    """
    built = probe_model(node, opsets, constant_value, as_float)
    if built is None:
        return UNKNOWN
    model, grads = built
    return _probe(model.SerializeToString(), tuple(grads), with_backward, every_gradient)


@functools.lru_cache(maxsize=4096)
def _probe(model_bytes: bytes, grads: tuple[str, ...], with_backward: bool, every_gradient: bool = False) -> str | None:
    import re

    import onnxruntime as ort

    from .builder import build_graph

    model = onnx.load_model_from_string(model_bytes)
    wanted = list(grads)
    try:
        while with_backward and wanted:
            try:
                model_bytes = build_graph(
                    model,
                    state_names=[],
                    trainable_names=[],
                    input_names_require_grad=wanted,
                    build_gradient=True,
                    log_level=50,
                ).model_bytes
                break
            except Exception as e:
                # An input the op has no gradient for (BatchNorm's running statistics): ask without it.
                undifferentiable = re.search(r"failed to find NodeArg by name: (\S+)_grad", str(e))
                if every_gradient or undifferentiable is None or undifferentiable.group(1) not in wanted:
                    raise
                wanted.remove(undifferentiable.group(1))
        options = ort.SessionOptions()
        options.log_severity_level = 4
        ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # any failure: the node cannot run as it is
        message = str(e)
        for marker in ("NOT_IMPLEMENTED : ", "INVALID_GRAPH : ", "FAIL : ", "INVALID_ARGUMENT : "):
            if marker in message:
                message = message.split(marker, 1)[1]
                break
        return message.strip().splitlines()[0][:300] if message.strip() else type(e).__name__
    return None
