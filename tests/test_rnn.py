"""Recurrent layers: bidirectional LSTMs and GRUs train like eager (``passes/bidirectional_rnn.py``
splits each into two forward nodes: ORT 1.19.2's training kernels are forward-only), with changing
sequence lengths and batch sizes, under both exporters."""

from __future__ import annotations

import pytest
import torch
from parity import check_parity, no_exporter, seq_len
from torch import nn

from ortwrap.engines import is_training_available

pytestmark = pytest.mark.usefixtures("exporter", "one_exporter_on_the_engine")


class Recurrent(nn.Module):
    """An RNN layer (given initial states or not; time-first or batch-first) and a linear head over
    its output and final states."""

    def __init__(self, kind: str, *, layers: int = 1, batch_first: bool = False, initial: bool = False) -> None:
        super().__init__()
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[kind]
        self.kind, self.initial, self.batch_first = kind, initial, batch_first
        self.rnn = rnn(6, 5, num_layers=layers, bidirectional=True, batch_first=batch_first)
        self.head = nn.Linear(10, 3)
        self.state = nn.Linear(5, 3)
        self.h0 = nn.Parameter(torch.randn(2 * layers, 1, 5) * 0.5)
        self.c0 = nn.Parameter(torch.randn(2 * layers, 1, 5) * 0.5)

    def forward(self, x):
        batch = x.shape[0] if self.batch_first else x.shape[1]
        if not self.initial:
            y, state = self.rnn(x)
        elif self.kind == "lstm":
            y, state = self.rnn(
                x, (self.h0.expand(-1, batch, -1).contiguous(), self.c0.expand(-1, batch, -1).contiguous())
            )
        else:
            y, state = self.rnn(x, self.h0.expand(-1, batch, -1).contiguous())
        h = state[0] if self.kind == "lstm" else state
        out = self.head(y).sum(1 if self.batch_first else 0) + self.state(h).sum(0)
        if self.kind == "lstm":
            out = out + self.state(state[1]).mean(0)
        return out


def inputs(batch_first: bool):
    def make(b, g):
        t = seq_len(b, 5)
        return (torch.randn(*((b, t) if batch_first else (t, b)), 6, generator=g, requires_grad=True),), {}

    return make


CASES = {
    "lstm": {},
    "gru": {},
    "lstm_two_layers_initial_state": {"layers": 2, "initial": True},
    "gru_batch_first_initial_state": {"batch_first": True, "initial": True},
    "lstm_batch_first": {"batch_first": True},
}


#: engine=onnxruntime (no training build): there the fast subset is the GRU (the LSTM took 75 s
#: on the loaded machine, ``ORT_EXTRA=ort make test`` has a time budget)
FAST = ("gru",) if not is_training_available() else ("lstm", "gru")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in CASES])
def test_bidirectional(name):
    kind = name.split("_")[0]
    config = CASES[name]
    check_parity(lambda: Recurrent(kind, **config), inputs(config.get("batch_first", False)))


@no_exporter
def test_split_into_forward_nodes_and_packed_sequences_refused():
    import onnx
    from onnx_text import run_pass

    from ortwrap.errors import PassError
    from ortwrap.passes.bidirectional_rnn import BidirectionalRNNPass

    body = """
        g (float[T, 2, 3] x, float[2, 12, 3] w, float[2, 12, 4] r, int32[2] lens) => (float[T, 2, 2, 4] y) {
            y = GRU<direction = "bidirectional", hidden_size = 4, activations = ["Sigmoid", "Tanh", "Sigmoid", "Relu"]>(x, w, r, %s)
        }
    """
    _, model = run_pass(BidirectionalRNNPass(), body % "")
    grus = [n for n in model.graph.node if n.op_type == "GRU"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in grus]
    assert [a["direction"] for a in attrs] == [b"forward", b"forward"]
    assert [a["activations"] for a in attrs] == [[b"Sigmoid", b"Tanh"], [b"Sigmoid", b"Relu"]]
    with pytest.raises(PassError, match="sequence_lens"):
        run_pass(BidirectionalRNNPass(), body % ", lens")
