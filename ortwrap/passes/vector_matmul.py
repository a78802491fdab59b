"""Give ``MatMul``'s 1-D operands a unit dim, and take it off the result.

ORT 1.19.2's ``MatMul`` gradient assumes matrices: a dot product of two vectors (``torch.dot`` /
``vdot``, spectral_norm's ``sigma = u . (W v)``) fails in the gradient build under the dynamo
exporter (its ``FusedMatMul`` gets a rank-0 input) and in the backward run under TorchScript (a
``Reshape`` of the scalar gradient to the matrix's shape). Written as matrices, the gradient is
ORT's ordinary one: ``a[K] @ B`` becomes ``Unsqueeze(a, 0) @ B`` then ``Squeeze(-2)``, ``A @ b[K]``
becomes ``A @ Unsqueeze(b, 1)`` then ``Squeeze(-1)``, both for a dot product. Same values.
Training graphs only; operands of unknown rank are left alone.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._build import NodeBuilder


class VectorMatMulPass(ir.passes.InPlacePass):
    """Rewrite ``MatMul`` nodes with a rank-1 operand as matrix products."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
                continue
            a, b_in = node.inputs
            if a is None or b_in is None or a.shape is None or b_in.shape is None:
                continue
            ra, rb = len(a.shape), len(b_in.shape)
            if ra != 1 and rb != 1:
                continue
            b = NodeBuilder(f"{node.name or f'matmul_{id(node):x}'}/vector")
            squeeze: list[int] = []
            if ra == 1:
                a = b.op("Unsqueeze", a, b.const(np.array([0], dtype=np.int64)))
                squeeze.append(-2 if rb != 1 else 0)
            if rb == 1:
                b_in = b.op("Unsqueeze", b_in, b.const(np.array([1], dtype=np.int64)))
                squeeze.append(-1 if ra != 1 else 1)
            product = b.op("MatMul", a, b_in)
            out = b.op("Squeeze", product, b.const(np.array(sorted(squeeze), dtype=np.int64)))
            old = node.outputs[0]
            product.dtype = out.dtype = old.dtype
            out.shape = old.shape
            b.replace(graph, node, [out])
            modified = True
        return ir.passes.PassResult(model, modified=modified)
