"""Give the gradient builder the shapes it needs: infer again after the rewrites, and forget the dim
names ONNX shape inference invents.

* Shapes are inferred once, before the passes; a value downstream of an op ONNX cannot infer (the
  ``ortwrap::StopGradient`` marker of an embedding with ``padding_idx``) stays unknown even after a
  pass resolves that op. ORT 1.19.2's gradient builder then fails on the first broadcasting op that
  reads it (``gradient_builder_base.cc:210 GetShape(input_grad, ...)``). Inference runs again here,
  through ATen nodes (``export.type_inference.infer_types``), whose outputs the passes typed.
* ONNX shape inference names the dims it cannot relate to any other ``unk__0``, ``unk__1``, ...
  ORT's gradient builder compares dims by name when it decides how a broadcast gradient is reduced,
  and two invented names are no evidence that the dims differ or agree: a [1, T, D] position
  embedding added to [B, T', D] token embeddings had its gradient left unreduced over the batch
  (``embedding_backward: dy has 768 elements, expected 384``). Invented names become unknown dims.
"""

from __future__ import annotations

import onnx_ir as ir

from ..export.type_inference import infer_types
from ..graph.names import INVENTED_PREFIX


def _forget_invented(value: ir.Value) -> bool:
    shape = value.shape
    if shape is None or not any(
        isinstance(d, ir.SymbolicDim) and str(d.value or "").startswith(INVENTED_PREFIX) for d in shape
    ):
        return False
    value.shape = ir.Shape(
        [None if isinstance(d, ir.SymbolicDim) and str(d.value or "").startswith(INVENTED_PREFIX) else d for d in shape]
    )
    return True


class ShapesForGradientsPass(ir.passes.FunctionalPass):
    """Infer shapes again after the rewrites; drop the dim names ONNX shape inference invents."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        for node in model.graph:  # ONNX inference wants every domain imported (passes add ATen nodes)
            if node.domain and node.domain not in model.opset_imports:
                model.opset_imports[node.domain] = 1
        before = {v.name: (v.dtype, v.shape) for node in model.graph for v in node.outputs if v.name}
        proto = infer_types(ir.serde.serialize_model(model), strict=False)
        model = ir.serde.deserialize_model(proto)
        for node in model.graph:
            for v in node.outputs:
                dtype, shape = before.get(v.name, (None, None))
                if dtype is not None:  # known before: kept (inference fills in what was unknown)
                    v.dtype = dtype
                if shape is not None:
                    v.shape = shape
                _forget_invented(v)
        for v in model.graph.outputs:
            _forget_invented(v)
        return ir.passes.PassResult(model, modified=True)
