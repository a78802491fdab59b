"""How ortwrap's CPU-kernel rewrites write a kernel's node, and the constant checks they share
(``passes/native_cpu_kernels.py`` and the rule-based ones in ``passes/kernel_patterns.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from ..graph.names import ATEN_DOMAIN, NATIVE_PREFIX
from ..ops import kernel
from ._build import NodeBuilder, constant_value

#: The domain names of the standard ONNX ops.
ONNX_DOMAINS = ("", "ai.onnx")


def scalar_constant(value: ir.Value | None) -> float | None:
    """The value of a one-element floating-point constant, else None."""
    v = constant_value(value)
    if v is None or v.size != 1 or v.dtype.kind != "f":
        return None
    return float(v.reshape(-1)[0])


def _half_rounded(value: float) -> tuple[float, float]:
    """``value`` rounded to bfloat16 (to nearest even) and to float16."""
    bits = int(np.array(value, dtype=np.float32).view(np.uint32))
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return float(np.array(bits, dtype=np.uint32).view(np.float32)), float(np.float16(value))


def is_constant(value: ir.Value | None, want: float, tol: float) -> bool:
    """``value`` is the constant ``want``, or ``want`` rounded to half precision: a graph exported
    under autocast, or from a bf16/fp16 model, holds its GELU's constants in half precision, and
    ``HalfPrecisionOnCPUPass`` makes them float32 as they are (eager's GELU kernel computes with
    the exact constants, as ortwrap's does)."""
    k = scalar_constant(value)
    return k is not None and (abs(k - want) < tol or k in _half_rounded(want))


def constant_dtype(value: ir.Value | None) -> ir.DataType | None:
    v = constant_value(value)
    return None if v is None else ir.DataType.from_numpy(v.dtype)


_OUTPUT_TYPES = {
    "f": ir.DataType.FLOAT,
    "h": ir.DataType.BFLOAT16,
    "F": ir.DataType.FLOAT,
    "i": ir.DataType.INT64,
    "I": ir.DataType.INT64,
}


def _declared(name: str, inputs: int, outputs: int) -> list[str]:
    """The output types of kernel ``name``, which must take ``inputs`` and write ``outputs``."""
    declared = kernel(name)
    if outputs != len(declared.outputs) or inputs != len(declared.inputs):
        raise AssertionError(f"ortwrap_cpu::{name} is declared as {declared.signature!r}")
    return declared.outputs


def kernel_node(b: NodeBuilder | Any, name: str, *inputs: ir.Value | None, outputs: int = 1) -> ir.Node | ir.Value:
    """The ATen node calling kernel ``name``, its outputs typed from the declaration. ``b``: a
    NodeBuilder (returns the node), or a rule's op builder (returns its one output)."""
    types = _declared(name, len(inputs), outputs)
    attrs = {"operator": NATIVE_PREFIX + name, "overload_name": ""}
    if isinstance(b, NodeBuilder):
        node = b.node("ATen", list(inputs), domain=ATEN_DOMAIN, outputs=outputs, **attrs)
        values = list(node.outputs)
    else:
        node = b.ATen(*inputs, _domain=ATEN_DOMAIN, **attrs)
        values = [node]
    for v, t in zip(values, types):  # ORT cannot infer the outputs of ATen nodes
        v.dtype = _OUTPUT_TYPES[t]
    return node
