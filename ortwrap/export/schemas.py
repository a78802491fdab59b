"""ONNX schemas of ortwrap's own marker ops, registered once per process for both exporters.

ONNX shape inference stops at a node whose schema it does not know, and everything downstream
keeps no shape; ORT's gradient builder then fails on the first broadcasting op (BART: the
residual ``Add`` after the embedding's padding marker, ``GetShape(input_grad)``). Each marker
op therefore gets a schema with its type and shape inference (identity for ``StopGradient``).
"""

from __future__ import annotations

import threading

import onnx

from ..graph.names import ORTWRAP_DOMAIN

_FLOATS = ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"]
_lock = threading.Lock()
_registered = False


def _identity_inference(ctx) -> None:
    t = ctx.get_input_type(0)
    if t is not None:  # unknown (an ATen node's output): left unknown
        ctx.set_output_type(0, t)


def register_schemas() -> None:
    """Register ``ortwrap::StopGradient`` (identity inference) with ONNX; idempotent."""
    global _registered
    with _lock:
        if _registered:
            return
        param = onnx.defs.OpSchema.FormalParameter
        schema = onnx.defs.OpSchema(
            "StopGradient",
            ORTWRAP_DOMAIN,
            1,
            inputs=[param("input", "T")],
            outputs=[param("output", "T")],
            type_constraints=[("T", _FLOATS, "")],
        )
        schema.set_type_and_shape_inference_function(_identity_inference)
        if not onnx.defs.has(schema.name, ORTWRAP_DOMAIN):
            onnx.defs.register_schema(schema)
        _registered = True
