"""Prepare ATen nodes for ORT: string arguments as bytes, and typed outputs.

- ORT's DLPack bridge cannot carry string tensors: a string constant argument (gelu's
  ``approximate``, say) becomes a 1-D uint8 constant of its UTF-8 bytes, which the executor decodes.
- ONNX has no type inference for ``org.pytorch.aten::ATen``, and ORT's gradient builder fails
  ("type inference failed") on an output without a type. Each ATen node is evaluated once on
  PyTorch's ``meta`` device, with inputs of the recorded dtype and rank (symbolic dimensions set to
  2) and constant inputs at their values, which yields the dtype and rank of every output.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from ..bridge.aten import ATEN_DOMAIN, VJP_PREFIX, resolve
from ..errors import PassError
from ._build import constant_value


def _meta_input(value: ir.Value | None):
    if value is None:
        return None
    const = constant_value(value)
    if const is not None:
        return torch.from_numpy(const.copy())
    if value.dtype is None or value.shape is None:
        raise ValueError(f"input {value.name!r} has no known type or rank")
    dims = [d if isinstance(d, int) else 2 for d in value.shape]
    dtype = torch.from_numpy(np.empty(0, dtype=value.dtype.numpy())).dtype
    return torch.empty(dims, dtype=dtype, device="meta")


def _string_constant(value: ir.Value | None) -> str | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Constant":
        return None
    attr = node.attributes.get("value") or node.attributes.get("value_string")
    if attr is not None and attr.type == ir.AttributeType.STRING:
        return attr.as_string()
    return None


def _to_meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


class ATenOutputTypesPass(ir.passes.InPlacePass):
    """Set dtype and rank on ATen node outputs by evaluating the op on the meta device."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(model.graph):
            if node.domain != ATEN_DOMAIN or node.op_type != "ATen":
                continue
            for i, value in enumerate(node.inputs):
                text = _string_constant(value)
                if text is not None:
                    const = ir.node(
                        "Constant",
                        [],
                        attributes={"value": ir.tensor(np.frombuffer(text.encode(), dtype=np.uint8).copy())},
                    )
                    model.graph.insert_before(node, const)
                    old = value.producer()
                    node.replace_input_with(i, const.outputs[0])
                    if old is not None and not any(len(o.uses()) for o in old.outputs):
                        model.graph.remove(old, safe=True)
                    modified = True
            op = node.attributes["operator"].as_string()
            overload = node.attributes["overload_name"].as_string() if "overload_name" in node.attributes else ""
            if op.startswith(VJP_PREFIX) or all(o.dtype is not None and o.shape is not None for o in node.outputs):
                continue
            try:
                plan = resolve(op, overload)
                args, kwargs = plan.decode(op, [_meta_input(v) for v in node.inputs])
                args = [_to_meta(a) for a in args]
                kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
                result = plan.fn(*args, **kwargs)
            except Exception as e:
                raise PassError(f"ATen node {node.name!r} ({op}): cannot infer its output types: {e}") from e
            results = result if isinstance(result, (tuple, list)) else (result,)
            for value, r in zip(node.outputs, results):
                if isinstance(r, torch.Tensor):
                    value.dtype = ir.DataType.from_numpy(torch.empty((), dtype=r.dtype).numpy().dtype)
                    value.shape = ir.Shape([None] * r.dim())
                    modified = True
        return ir.passes.PassResult(model, modified=modified)
