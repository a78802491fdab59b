"""Fuse GELU, LayerNorm and RMSNorm into single ops, the standard ones where the opset has them.

Written as onnxscript rewrite rules (pattern, check, replacement), applied before ORT partitions
the graph (ORT issue 20915: fusions that run after partitioning help only the provider they were
written for):

=========================================  ===========================================================
pattern (every operand order)              replacement
=========================================  ===========================================================
``0.5 * x * (1 + erf(x / sqrt(2)))``       ``Gelu(x)`` at opset >= 20, else ``com.microsoft::Gelu(x)``
``0.5 * x * (1 + tanh(sqrt(2/pi) *         ``Gelu(x, approximate="tanh")`` at opset >= 20 in inference
(x + 0.044715 * x**3)))``                  graphs; else ``com.microsoft::FastGelu(x)`` (ORT 1.19.2's
                                           gradient of ``Gelu`` ignores ``approximate``)
``(x - mean(x)) / sqrt(var(x) + eps)       ``LayerNormalization(x, w, b, axis=-1, epsilon=eps)``: the
* w + b`` (the TorchScript exporter's      standard op at opset >= 17, ORT's contrib op of the same name
LayerNorm below opset 17)                  below (registered in the ONNX domain)
``x * 1/sqrt(mean(x**2) + eps) * w``       ``SimplifiedLayerNormalization(x, w, axis=-1, epsilon=eps)``
(Llama's RMSNorm, casts to float32          (ORT's contrib op; ONNX's RMSNormalization is opset 23,
around it or not)                           which ORT 1.19.2 does not load)
=========================================  ===========================================================

Which rules run is the pipeline's choice (``passes.pipeline``): on CPU training graphs ortwrap's
own GELU kernels are faster than ORT's fused Gelu/GeluGrad (docs/performance.md), so the GELU
rules do not run there; the LayerNorm rule's result is what ortwrap's LayerNorm kernel replaces.
There, ``NativeCPUKernelsPass`` writes ortwrap's GELU kernels with the same GELU patterns
(``GeluErfRule``, ``GeluTanhRule``: its own check and replacement). GELU rules are tried only where
a GELU can end (``apply_at_gelus``): onnxscript would try each commuted pattern at every node.

The rules live in ``passes/fusion_patterns.py``, imported when this pass first runs (not by
``import ortwrap``: a build from the build cache never needs onnxscript).
"""

from __future__ import annotations

import onnx_ir as ir


class StandardOpFusionPass(ir.passes.InPlacePass):
    """Apply ``fusion_patterns.apply_fusions`` (see the module docstring)."""

    def __init__(self, *, training: bool, gelu: bool = True, norms: bool = True) -> None:
        super().__init__()
        self.training, self.gelu, self.norms = training, gelu, norms

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from .fusion_patterns import apply_fusions

        count = apply_fusions(model, training=self.training, gelu=self.gelu, norms=self.norms)
        return ir.passes.PassResult(model, modified=bool(count))
