"""Constants of ONNX graphs: read from a graph (:func:`constant_value`), read from a float attribute
(:func:`written`), written as an ATen node's argument (:func:`constant_array`). Used by the argument
mappers (``ops/mappers.py``) and the passes."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

__all__ = ["constant_array", "constant_value", "written"]


def constant_value(value: ir.Value | None) -> np.ndarray | None:
    """The value of a tensor computed from constants only (Constant, Concat, Cast, Identity)."""
    if value is None:
        return None
    if value.const_value is not None:
        # NOTE: a writable copy, whatever the storage (raw bytes, a read-only mapping, a torch
        # tensor): callers may use numpy's iterators and in-place operations on it.
        return np.array(value.const_value.numpy())
    node = value.producer()
    if node is None:
        return None
    if node.op_type == "Constant" and "value" in node.attributes:
        return np.array(node.attributes["value"].as_tensor().numpy())
    if node.op_type == "Constant" and "value_float" in node.attributes:
        return np.array(node.attributes["value_float"].as_float(), dtype=np.float32)
    if node.op_type == "Constant" and "value_int" in node.attributes:
        return np.array(node.attributes["value_int"].as_int(), dtype=np.int64)
    if node.op_type == "Constant" and "value_floats" in node.attributes:
        return np.array(node.attributes["value_floats"].as_floats(), dtype=np.float32)
    if node.op_type == "Constant" and "value_ints" in node.attributes:
        return np.array(node.attributes["value_ints"].as_ints(), dtype=np.int64)
    if node.op_type not in ("Concat", "Identity", "Cast"):
        return None  # before recursing: walking every producer up a deep graph takes exponential time
    args = [constant_value(v) for v in node.inputs]
    if any(a is None for a in args):
        return None
    if node.op_type == "Concat":
        return np.concatenate(args, axis=node.attributes["axis"].as_int())
    if node.op_type == "Identity":
        return args[0]
    if node.op_type == "Cast":
        return args[0].astype(ir.DataType(node.attributes["to"].as_int()).numpy())
    return None


def written(value: float) -> float:
    """A float attribute as its author wrote it: ONNX stores float attributes in float32, so
    ``epsilon=1e-5`` reads back as 9.99999974e-06; a float64 computation wants the decimal the
    float32 came from (the shortest one that rounds to it), which is the Python float eager used."""
    return float(str(np.float32(value)))


def constant_array(value: Any) -> np.ndarray:
    """The ATen bridge's encoding of a constant argument (``bridge/aten.py``): a number as a 0-d
    array (bool, int64, float64), a list of numbers as a 1-D one, a string as its UTF-8 bytes. The
    one encoder: the mappers and passes here, and the dynamo exporter's ATen nodes
    (``export/aten_fallback.py``, which encodes dtypes itself).

    Raises:
        TypeError: a value no ATen node argument can hold."""
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
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return np.array(value, dtype=np.float64).reshape(len(value))
    raise TypeError(f"{value!r} cannot be an ATen node argument")
