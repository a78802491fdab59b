"""Run the host-side shape program before each forward (the aggressive CPU fallback).

``passes/host_shapes.py`` splits the shape computations off the forward graph; this module
computes the values that cross back into the main graph, every step, on the host:

* python feeds (``Shape``/``Size`` of user inputs) from ``tensor.shape``: device tensors are
  never read;
* the shape program, a small ONNX model, on an ``InferenceSession`` with CPUExecutionProvider,
  fed those and the integer user inputs it reads by value (copied to the host when they live on
  the device).

NOTE: the shape program is a pure function of the input shapes and of the integer inputs it
reads, so its results are cached by those (by value only for inputs of at most
:data:`MAX_KEYED_ELEMENTS` elements; larger ones are recomputed each step). A step with a
shape seen before costs one dict lookup. The cached CPU tensors are fed to ORT read-only; the
cache holds at most :data:`MAX_CACHED` entries and is emptied when full.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from .._ort import ort
from ..errors import RuntimeRunError, SessionError
from ..graph.host_shapes import HostFeed, HostShapeSplit, shape_slice

__all__ = ["HostShapeRunner"]

MAX_CACHED = 256
MAX_KEYED_ELEMENTS = 64


def _session_options() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1  # a few integer ops: threads would cost more than they save
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


class HostShapeRunner:
    """Computes the main graph's host-fed inputs from the user's flat input tensors.

    Args:
        split: the result of the split pass.
        input_index: graph input name -> index of the user's flat tensor fed to it.

    Raises:
        SessionError: a feed names an input that is not a user input, or the shape program
            cannot be loaded.
    """

    def __init__(self, split: HostShapeSplit, input_index: Mapping[str, int]) -> None:
        self.split = split

        def leaf(feed: HostFeed) -> int:
            if feed.source not in input_index:
                raise SessionError(
                    f"host shape feed {feed.name!r} is computed from {feed.source!r}, which is not a user input "
                    f"(user inputs: {sorted(input_index)})"
                )
            return input_index[feed.source]

        self._program_inputs = [(f, leaf(f)) for f in split.program_inputs]
        self._feeds = [(f, -1 if f.kind == "program" else leaf(f)) for f in split.feeds]
        self._shape_leaves = sorted(
            {i for f, i in (*self._program_inputs, *self._feeds) if f.kind in ("shape", "size")}
        )
        self._value_leaves = sorted({i for f, i in self._program_inputs if f.kind == "value"})
        self._session = None
        if split.program is not None:
            try:
                self._session = ort.InferenceSession(
                    split.program.SerializeToString(), _session_options(), ["CPUExecutionProvider"]
                )
            except Exception as e:
                raise SessionError(f"onnxruntime could not load the host shape program: {e}") from e
            self._input_names = [f.name for f, _ in self._program_inputs]
        self._cache: dict[tuple, list[torch.Tensor]] = {}
        #: How many times the shape program ran (cache misses), for tests and benchmarks.
        self.runs = 0

    def __call__(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The host-fed inputs, as CPU tensors in ``split.feeds`` order."""
        values = {}
        key_values = []
        cacheable = True
        for i in self._value_leaves:
            t = leaves[i].detach()
            if t.device.type != "cpu":
                t = t.cpu()  # one device-to-host copy of a small integer tensor
            values[i] = t
            if cacheable and t.numel() <= MAX_KEYED_ELEMENTS:
                key_values.append((t.dtype, tuple(t.shape), tuple(t.reshape(-1).tolist())))
            else:
                cacheable = False
        key = (tuple([tuple(leaves[i].shape) for i in self._shape_leaves]), tuple(key_values))
        if cacheable:
            hit = self._cache.get(key)
            if hit is not None:
                return hit
        result = self._compute(leaves, values)
        if cacheable:
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
            self._cache[key] = result
        return result

    def _compute(self, leaves: list[torch.Tensor], values: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        outputs: list[np.ndarray] = []
        if self._session is not None:
            feed = {}
            for f, i in self._program_inputs:
                feed[f.name] = values[i].numpy() if f.kind == "value" else _python(f, leaves[i])
            self.runs += 1
            try:
                outputs = self._session.run(None, feed)
            except Exception as e:
                raise RuntimeRunError(
                    f"the host shape program failed (inputs {', '.join(f'{k}={v.tolist()}' for k, v in feed.items())}): {e}"
                ) from e
        result = []
        for f, i in self._feeds:
            arr = outputs[f.index] if f.kind == "program" else _python(f, leaves[i])
            # NOTE: not np.ascontiguousarray, which turns a 0-d array into a 1-d one.
            result.append(torch.from_numpy(arr if arr.flags.c_contiguous else arr.copy()))
        return result


def _python(f: HostFeed, t: torch.Tensor) -> np.ndarray:
    if f.kind == "size":
        return np.array(t.numel(), dtype=np.int64)
    return np.array(shape_slice(tuple(t.shape), f.start, f.end), dtype=np.int64)
