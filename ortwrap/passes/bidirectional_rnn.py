"""Split bidirectional ``LSTM``/``GRU`` nodes into two forward nodes.

ORT 1.19.2's LSTM and GRU training kernels (``LSTMTraining``/``GRUTraining`` and their gradients)
take ``direction="forward"`` only: a bidirectional node fails when the session is created. Both
exporters write ``nn.LSTM(bidirectional=True)`` as one bidirectional node; this pass rewrites it
into what it computes, each half a forward node ORT can differentiate (``layout=0``: time first)::

    Y, Y_h, Y_c = LSTM[bidirectional](X, W, R, B, , h0, c0, P)
      ->  Yf, Yf_h, Yf_c = LSTM[forward](X, W[0:1], R[0:1], B[0:1], , h0[0:1], c0[0:1], P[0:1])
          Yr, Yr_h, Yr_c = LSTM[forward](Gather(X, t), W[1:2], R[1:2], ..)     t = T-1, ..., 0
          Y = Concat(Yf, Gather(Yr, t), axis=1); Y_h = Concat(Yf_h, Yr_h); Y_c = Concat(Yf_c, Yr_c)

The reversed pass reads the sequence back to front, so its outputs come back in reverse time
order (ONNX's reverse direction returns them in input order). The time reversal is a ``Gather``
with indices computed from the sequence length, whose gradient ORT has. Per-direction attributes
(``activations``, ``activation_alpha``, ``activation_beta``) are split between the two nodes.

Not rewritten (``PassError``): ``sequence_lens`` (packed sequences: each sequence must be reversed
within its own length) and ``layout=1``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..errors import PassError
from ._build import NodeBuilder

#: op -> (number of outputs, activations per direction)
_RNNS = {"LSTM": (3, 3), "GRU": (2, 2)}
#: Attributes with one entry per activation (split between the directions).
_PER_ACTIVATION = ("activations", "activation_alpha", "activation_beta")


class BidirectionalRNNPass(ir.passes.InPlacePass):
    """Rewrite each bidirectional LSTM/GRU into a forward node and a forward node on the reversed sequence."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type not in _RNNS or node.domain not in ("", "ai.onnx"):
                continue
            direction = node.attributes.get("direction")
            if direction is None or direction.as_string() != "bidirectional":
                continue
            _split(graph, node)
            modified = True
        return ir.passes.PassResult(model, modified=modified)


def _split(graph: ir.Graph, node: ir.Node) -> None:
    n_outputs, per_direction = _RNNS[node.op_type]
    inputs = list(node.inputs) + [None] * (8 - len(node.inputs))
    if inputs[4] is not None:
        raise PassError(
            f"node {node.name!r}: a bidirectional {node.op_type} with sequence_lens (packed sequences) "
            "cannot be trained (ORT 1.19.2's kernel is forward-only)"
        )
    layout = node.attributes.get("layout")
    if layout is not None and layout.as_int() != 0:
        raise PassError(f"node {node.name!r}: a bidirectional {node.op_type} with layout=1 cannot be trained")
    b = NodeBuilder(node.name or node.op_type)
    zero, one, two = (b.const(np.array([v], dtype=np.int64)) for v in (0, 1, 2))

    def half(value: ir.Value | None, start: ir.Value, end: ir.Value) -> ir.Value | None:
        return None if value is None else b.op("Slice", value, start, end, zero)

    # Time indices T-1, ..., 0: the reversal (a Gather, differentiable by ORT) of X and of the
    # reverse node's Y.
    length = b.op("Gather", b.op("Shape", inputs[0]), b.const(np.array(0, dtype=np.int64)), axis=0)
    minus_one = b.const(np.array(-1, dtype=np.int64))
    backwards = b.op("Range", b.op("Add", length, minus_one), minus_one, minus_one)

    attributes = {k: v for k, v in node.attributes.items() if k not in ("direction", *_PER_ACTIVATION)}
    outputs = []
    for d, (start, end) in enumerate(((zero, one), (one, two))):
        args = [half(v, start, end) if i not in (0, 4) else v for i, v in enumerate(inputs[:8])]
        if d == 1:
            args[0] = b.op("Gather", inputs[0], backwards, axis=0)
        while args and args[-1] is None:
            args.pop()
        attrs = dict(attributes)
        for name in _PER_ACTIVATION:
            a = node.attributes.get(name)
            if a is not None:
                values = list(a.value)
                attrs[name] = values[d * per_direction : (d + 1) * per_direction]
        attrs["direction"] = "forward"
        rnn = b.node(node.op_type, args, outputs=n_outputs, **{k: _plain(v) for k, v in attrs.items()})
        outputs.append(list(rnn.outputs))
    forward, reverse = outputs
    new = [b.op("Concat", forward[0], b.op("Gather", reverse[0], backwards, axis=0), axis=1)]
    new += [b.op("Concat", forward[i], reverse[i], axis=0) for i in range(1, len(node.outputs))]
    b.replace(graph, node, new)


def _plain(value):
    """An attribute's Python value (``ir.Attr`` as copied from the node, or already plain)."""
    return value.value if isinstance(value, ir.Attr) else value
