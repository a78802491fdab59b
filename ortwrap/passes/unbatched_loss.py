"""Give ``SoftmaxCrossEntropyLoss`` / ``NegativeLogLikelihoodLoss`` an unbatched input a batch of one.

PyTorch's ``cross_entropy``/``nll_loss`` take an unbatched input (``[C]`` scores, a 0-d target); the
ONNX ops need ``[N, C, ...]``, and ORT 1.19.2 aborts the process (SIGABRT, no exception) on a 1-D
input (``linear_cross_entropy`` of one vector, under both exporters). This pass unsqueezes the scores
and the target on axis 0 and squeezes the outputs back: the loss of ``reduction="none"`` (``[1]`` ->
0-d) and the log-probabilities (``[1, C]`` -> ``[C]``). Same values; ORT differentiates both forms.
A loss node whose input rank is unknown is left as it is.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._build import NodeBuilder

_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")


class UnbatchedLossPass(ir.passes.InPlacePass):
    """Unsqueeze a rank-1 loss input (and its target) to a batch of one."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type not in _LOSSES or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
                continue
            scores = node.inputs[0]
            if scores is None or scores.shape is None or len(scores.shape) != 1:
                continue
            b = NodeBuilder(node.name or f"loss_{id(node):x}")
            axis = b.const(np.array([0], dtype=np.int64))
            for i in (0, 1):
                x = node.inputs[i]
                unsqueezed = b.op("Unsqueeze", x, axis)
                unsqueezed.dtype = x.dtype
                if x.shape is not None:
                    unsqueezed.shape = ir.Shape([1, *x.shape])
                node.replace_input_with(i, unsqueezed)
            graph.insert_before(node, b.nodes)
            after = NodeBuilder(f"{node.name or f'loss_{id(node):x}'}/outputs")
            reduction = node.attributes.get("reduction")
            per_sample = reduction is not None and reduction.value == "none"
            for k, out in enumerate(node.outputs):
                if k == 0 and not per_sample:
                    continue  # mean/sum: 0-d already
                if not out.uses() and not out.is_graph_output():
                    continue
                squeezed = after.op("Squeeze", out, after.const(np.array([0], dtype=np.int64)))
                squeezed.dtype = out.dtype
                if k == 0:  # the per-sample loss: 0-d, now [1]
                    squeezed.shape, out.shape = ir.Shape([]), ir.Shape([1])
                elif out.shape is not None:  # the log-probabilities: [C], now [1, C]
                    squeezed.shape, out.shape = out.shape, ir.Shape([1, *out.shape])
                name = out.name
                out.replace_all_uses_with(squeezed, replace_graph_outputs=True)
                squeezed.producer().replace_input_with(0, out)  # (its own input was replaced too)
                if name:  # the graph's output keeps its name
                    out.name, squeezed.name = f"{name}/batched", name
            graph.insert_after(node, after.nodes)
            modified = True
        return ir.passes.PassResult(model, modified=modified)
