"""CUDA safety on machines without a GPU: a CUDA program is refused with a SessionError before ORT
sees a CUDA provider (creating one without a GPU aborts the process), and a session that came up
without a requested provider (it failed to load) is refused rather than run silently on the CPU."""

from __future__ import annotations

import types

import onnx
import pytest
import torch
from onnx import helper

from ortwrap.errors import SessionError
from ortwrap.options import Options
from ortwrap.runtime import session


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_cuda_program_without_a_gpu_is_a_session_error():
    with pytest.raises(SessionError, match="cuda"):
        session.providers_for(torch.device("cuda"))
    with pytest.raises(SessionError, match="cuda:3"):
        session.providers_for(torch.device("cuda:3"))


def test_a_requested_provider_that_did_not_load_is_refused(monkeypatch):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    model_bytes = model.SerializeToString()
    cpu = session.providers_for(torch.device("cpu"))
    sess, _ = session._create_session(
        types.SimpleNamespace(model_bytes=model_bytes, has_backward=False, ort_threads=0),
        torch.device("cpu"),
        Options(),
    )
    assert sess.get_providers() == ["CPUExecutionProvider"]
    # A provider list naming one this onnxruntime cannot load (the CPU wheel has no CUDA provider).
    monkeypatch.setattr(
        session, "providers_for", lambda device: (["CUDAExecutionProvider", *cpu[0]], [{}, *cpu[1]], cpu[2])
    )
    with pytest.raises(SessionError, match="without CUDAExecutionProvider"):
        session._create_session(
            types.SimpleNamespace(model_bytes=model_bytes, has_backward=False, ort_threads=0),
            torch.device("cpu"),
            Options(),
        )


@pytest.mark.gpu
def test_cuda_session_has_the_cuda_provider():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    sess, _ = session._create_session(
        types.SimpleNamespace(model_bytes=model.SerializeToString(), has_backward=False, ort_threads=0),
        torch.device("cuda"),
        Options(),
    )
    assert sess.get_providers()[0] == "CUDAExecutionProvider"
