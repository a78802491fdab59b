"""Rewrite 4-D ``Resize`` (upsampling, interpolation) over H and W as two MatMuls.

ORT 1.19.2 registers a gradient for Resize but ships no CPU kernel for ``ResizeGrad``. Resizing H
and W is separable for every mode, so ``y = A_h @ x @ A_w^T`` with constant interpolation matrices
``A_h`` (H_out x H) and ``A_w`` (W_out x W). The matrices are tabulated by running ORT's own forward
Resize, with the node's attributes, on one-hot inputs, so every mode and coordinate transform is
reproduced exactly. Needs static H and W and constant scales or sizes (the exporter marks graphs with
Resize as needing static spatial shapes; the batch stays dynamic). Other Resizes (3-D, 5-D, sizes
read at run time) are left to ``TorchGradientsPass`` (PyTorch's upsampling ops, ``ortwrap/ops/mappers.py``).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from .._ort import ort
from ..errors import PassError
from ._build import NodeBuilder, constant_value


def _tabulate(
    attrs: dict, size_in: int, *, scale: float | None = None, size_out: int | None = None, opset: int = 17
) -> np.ndarray:
    """The (out x size_in) matrix of a 1-D Resize, from ORT's forward Resize on ``eye``.

    Given ``scale``, the Resize is run with that scale (as the exported node is), so the coordinate
    mapping is the node's own; otherwise with the output size.
    """
    x = np.eye(size_in, dtype=np.float32).reshape(1, size_in, size_in, 1)
    if scale is not None:
        inputs = ["X", "", "scales"]
        init = onnx.numpy_helper.from_array(np.array([1, 1, scale, 1], np.float32), "scales")
    else:
        inputs = ["X", "", "", "sizes"]
        init = onnx.numpy_helper.from_array(np.array([1, size_in, size_out, 1], np.int64), "sizes")
    node = helper.make_node("Resize", inputs, ["Y"], **attrs)
    graph = helper.make_graph(
        [node],
        "tabulate",
        [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [1, size_in, size_in, 1])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)],
        [init],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    y = sess.run(None, {"X": x})[0]
    return np.ascontiguousarray(y[0, :, :, 0].T)


class ResizeToMatMulPass(ir.passes.InPlacePass):
    """Replace 4-D Resize over H and W with ``A_h @ x @ A_w^T``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "Resize" or node.domain != "":
                continue
            x = node.inputs[0]
            sx = x.shape
            if sx is None or len(sx) != 4 or not all(isinstance(d, int) for d in sx[2:]):
                continue  # TorchGradientsPass: PyTorch's upsampling op (ortwrap/ops/mappers.py)
            attrs = {name: attr.value for name, attr in node.attributes.items()}
            if attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize":
                raise PassError(f"node {node.name!r}: Resize tf_crop_and_resize is not supported")
            scales = constant_value(node.inputs[2]) if len(node.inputs) > 2 else None
            sizes = constant_value(node.inputs[3]) if len(node.inputs) > 3 else None
            if scales is not None and scales.size == 4 and scales[0] == 1 and scales[1] == 1:
                h_kw, w_kw = {"scale": float(scales[2])}, {"scale": float(scales[3])}
            elif sizes is not None and sizes.size == 4:
                h_kw, w_kw = {"size_out": int(sizes[2])}, {"size_out": int(sizes[3])}
            else:
                continue  # sizes read at run time: TorchGradientsPass
            dtype = (x.dtype or ir.DataType.FLOAT).numpy()
            # The node's own opset: opset 18 added attributes (antialias, ...) that exporters set.
            opset = max(model.opset_imports.get("", 17), 17)
            a_h = _tabulate(attrs, sx[2], opset=opset, **h_kw).astype(dtype)
            a_w_t = np.ascontiguousarray(_tabulate(attrs, sx[3], opset=opset, **w_kw).T).astype(dtype)
            b = NodeBuilder(node.name or "resize")
            out = b.op("MatMul", b.const(a_h), b.op("MatMul", x, b.const(a_w_t)))
            b.replace(graph, node, [out])
            modified = True
        return ir.passes.PassResult(model, modified=modified)
