"""ATen string arguments as bytes.

ORT's DLPack bridge cannot carry string tensors: a string constant argument of an
``org.pytorch.aten::ATen`` node (gelu's ``approximate``, say) becomes a 1-D uint8 constant of its
UTF-8 bytes, which ortwrap's executor decodes. (Types of ATen outputs are inferred before the
passes run: ``export.type_inference.infer_types``.)
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..graph.names import ATEN_DOMAIN


def _string_constant(value: ir.Value | None) -> str | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Constant":
        return None
    attr = node.attributes.get("value") or node.attributes.get("value_string")
    if attr is not None and attr.type == ir.AttributeType.STRING:
        return attr.as_string()
    return None


class ATenStringArgumentsPass(ir.passes.InPlacePass):
    """Replace string constants feeding ATen nodes by uint8 byte constants."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(model.graph):
            if node.domain != ATEN_DOMAIN or node.op_type != "ATen":
                continue
            for i, value in enumerate(node.inputs):
                text = _string_constant(value)
                if text is None:
                    continue
                data = np.frombuffer(text.encode(), dtype=np.uint8).copy()
                const = ir.node("Constant", [], attributes={"value": ir.tensor(data)}, name=f"{node.name}/arg{i}_utf8")
                model.graph.insert_before(node, const)
                old = value.producer()
                node.replace_input_with(i, const.outputs[0])
                if old is not None and not any(len(o.uses()) for o in old.outputs):
                    model.graph.remove(old, safe=True)
                modified = True
        return ir.passes.PassResult(model, modified=modified)
