"""ONNX snippets in tests are written as ONNX text: one helper parses them, one runs a pass on them."""

from __future__ import annotations

import onnx
import onnx.parser
import onnx_ir as ir


def parse(body: str, opset: int = 17, check: bool = False) -> onnx.ModelProto:
    """The model whose graph is ``body`` (ONNX text), at ``opset``; checked if ``check``."""
    model = onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : {opset}]>\n{body}')
    if check:
        onnx.checker.check_model(model)
    return model


def run_pass(pass_: ir.passes.PassBase, body: str, opset: int = 17) -> tuple[ir.passes.PassResult, onnx.ModelProto]:
    """Run ``pass_`` on ``body`` after ONNX shape inference; its result and the rewritten model."""
    result = pass_(ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(parse(body, opset))))
    return result, ir.serde.serialize_model(result.model)
