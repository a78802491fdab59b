"""Run one translated graph in an ``onnxruntime.InferenceSession`` through IOBinding.

NOTE: ownership, and why nothing is copied. Inputs are bound by pointer to the torch tensors'
memory (a non-contiguous one is made contiguous first); outputs are torch tensors allocated here
with the shapes the FX graph recorded (the engine builds per shape signature) and bound by pointer,
so ORT writes straight into them. The forward graph's saved values are such tensors: AOTAutograd's
autograd.Function keeps them for the backward, whose session reads them by pointer again. The
tensors bound to a binding are referenced by the call's locals until ``run_with_iobinding``
returns.
"""

from __future__ import annotations

import numpy as np
import torch

from ..._logging import ort_log_wanted
from ..._ort import ort
from ...errors import RuntimeRunError, SessionError
from .half import compute_in_float32
from .translate import TranslatedGraph

_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def numpy_dtype(dtype: torch.dtype) -> type | int:
    """The element type IOBinding takes for ``dtype``: a numpy type, or for bfloat16 (which numpy lacks)
    the ONNX type number, which onnxruntime >= 1.20 accepts (1.19.2's IOBinding takes numpy types only)."""
    try:
        return _NUMPY[dtype]
    except KeyError:
        if dtype == torch.bfloat16 and _BINDS_ONNX_TYPES:
            return 16  # onnx.TensorProto.BFLOAT16 (a bfloat16 buffer: RecurrentGemma's normalizer)
        raise SessionError(f"the onnxruntime engine cannot bind {dtype} tensors yet") from None


#: onnxruntime's IOBinding takes an ONNX type number as the element type (1.20 on; not the training build's 1.19.2)
_BINDS_ONNX_TYPES = tuple(int(x) for x in ort.__version__.split(".")[:2]) >= (1, 20)


def binds_bfloat16() -> bool:
    """Whether this onnxruntime's IOBinding binds bfloat16 tensors (1.20 on)."""
    return _BINDS_ONNX_TYPES


def ort_version() -> str:
    return f"onnxruntime {ort.__version__}"


def providers_for(device: torch.device) -> list:
    if device.type == "cuda":
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def session_options(options) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = options.intra_op_threads or torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.log_severity_level = 2 if ort_log_wanted() else 4  # ORT's own log at ortwrap's DEBUG, as the training engine
    spin = "1" if options.allow_spinning else "0"
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    so.add_session_config_entry("session.inter_op.allow_spinning", spin)
    return so


class GraphRunner:
    """One InferenceSession and how to call it with torch tensors (a boxed callable for AOTAutograd)."""

    def __init__(self, graph: TranslatedGraph, device: torch.device, options, what: str) -> None:
        self.graph = graph
        self.device = device
        self.what = what
        self._ort_device = ("cuda", device.index or 0) if device.type == "cuda" else ("cpu", 0)
        model = graph.model
        #: nodes computed in float32 between Casts (autocast's bf16/fp16 ops on the CPU provider: half.py)
        self.half_rewritten = 0
        if device.type == "cpu":
            model, self.half_rewritten = compute_in_float32(model)
        try:
            self.session = ort.InferenceSession(model, session_options(options), providers=providers_for(device))
        except Exception as e:
            raise SessionError(f"onnxruntime could not create the session of the {what} graph: {e}") from e
        self._in_types = None

    def __call__(self, args: list) -> list:
        graph = self.graph
        device_type, device_id = self._ort_device
        binding = self.session.io_binding()
        held = []
        for name, t in zip(graph.input_names, args):
            if not isinstance(t, torch.Tensor):
                t = torch.tensor(t)  # (a scalar AOTAutograd passes as a Python number)
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            held.append(t)
            binding.bind_input(name, device_type, device_id, numpy_dtype(t.dtype), list(t.shape), t.data_ptr())
        args.clear()  # (boxed convention: the caller's references go, ours stay until the run ends)
        outs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in graph.output_meta]
        for name, o in zip(graph.output_names, outs):
            binding.bind_output(name, device_type, device_id, numpy_dtype(o.dtype), list(o.shape), o.data_ptr())
        try:
            self.session.run_with_iobinding(binding)
        except Exception as e:
            raise RuntimeRunError(f"onnxruntime failed to run the {self.what} graph: {e}") from e
        del held
        return [outs[p] if p is not None else None for p in graph.outputs]
