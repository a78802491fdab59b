"""Erase entries of ORT's PythonOp context map whose backward will never run.

ORT 1.19.2 erases a context from its map only after ``PythonOpGrad`` ran for it; the only other
way, ``unregister_python_functions``, empties the whole map and so must wait until no forward awaits
its backward. A training forward whose outputs are dropped without backward (while other forwards
are in flight) would leave its entries behind for good. The janitor is a one-node ONNX graph,
``PythonOpGrad(ctx_id, grad)``: running it makes ORT look the context up, call ortwrap's backward
runner (which declines: the context was already released) and erase the entry. The run's failure
is expected and ignored.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from onnx import TensorProto, helper

from .._ort import ort
from . import state

_session = None
_lock = threading.Lock()


class JanitorFunction(torch.autograd.Function):
    """Named by the janitor graph; never called (the contexts it sees are released)."""

    @staticmethod
    def forward(ctx, x):  # pragma: no cover
        return x

    @staticmethod
    def backward(ctx, g):  # pragma: no cover
        return g


def _build() -> ort.InferenceSession:
    name = state.function_name(JanitorFunction)
    node = helper.make_node(
        "PythonOpGrad",
        ["ctx", "grad"],
        ["grad_input"],
        domain="com.microsoft",
        name="ortwrap_janitor",
        func_name=name,
        output_convention="d",
        safe_run_mode=0,
        input_tensor_types=[TensorProto.FLOAT],
        input_tensor_ranks=[1],
        output_tensor_types=[TensorProto.FLOAT],
        output_tensor_ranks=[1],
        output_tensor_requires_grads=[1],
    )
    graph = helper.make_graph(
        [node],
        "ortwrap_janitor",
        [
            helper.make_tensor_value_info("ctx", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("grad", TensorProto.FLOAT, [1]),
        ],
        [helper.make_tensor_value_info("grad_input", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=8
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 4  # its runs fail by design: do not log them
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def erase_contexts(ids: list[int]) -> None:
    """Erase each context id from ORT's map (ids already erased are ignored)."""
    global _session
    with _lock:
        if _session is None:
            _session = _build()
        grad = np.zeros(1, dtype=np.float32)
        for context_id in ids:
            try:
                _session.run(None, {"ctx": np.array([context_id], dtype=np.int64), "grad": grad})
            except Exception:
                pass
        state.clear_pending()
