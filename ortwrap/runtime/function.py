"""The autograd bridge: one ``torch.autograd.Function`` runs ORT's forward and backward.

NOTE: invariants.
- ``forward`` receives every graph feed (user tensors, then parameters and buffers, in the graph's
  feed order) so that autograd links each parameter to the graph; it returns every graph output.
- ORT, not autograd, keeps the activations: they live in the ``PartialGraphExecutionState`` held by
  ``ctx.state``. ``backward`` consumes it and drops it at once. If no backward ever runs (a forward
  under grad mode whose outputs are discarded), the state dies with the autograd graph.
- Outputs ORT calls non-differentiable, and buffer outputs, are marked non-differentiable, so
  autograd gives them no gradient. A missing gradient of a differentiable output is materialized
  as zeros, full-shaped only where the backward needs the shape.
- The backward is not differentiable: a double backward (``create_graph=True``) raises rather
  than silently returning gradients without a graph.
"""

from __future__ import annotations

import torch

from ..bridge.runner import RunRecord
from .session import TrainingRunner


class RunTrainingGraph(torch.autograd.Function):
    """``RunTrainingGraph.apply(program, *feeds) -> outputs``.

    ``program`` binds the feeds to OrtValues (``program.bind``), holds the ``TrainingRunner`` and
    knows which outputs are non-differentiable (``program.non_differentiable``).
    """

    @staticmethod
    def forward(ctx, program, *feeds: torch.Tensor):  # type: ignore[override]
        runner: TrainingRunner = program.runner
        if program.n_pythonops:
            # NOTE: the record collects the PythonOp contexts of this run; it lives in ctx, so if
            # no backward ever runs they are released when autograd drops ctx.
            with RunRecord() as record:
                try:
                    outputs, state = runner.forward(program.bind(feeds))
                except BaseException:
                    record.finish()  # the exception may outlive this frame: release now
                    raise
            if program.n_contexts:
                record.context_ids = outputs[len(outputs) - program.n_contexts :]
            ctx.record = record
        else:
            outputs, state = runner.forward(program.bind(feeds))
            ctx.record = None
        ctx.runner = runner
        ctx.state = state
        ctx.n_feeds = len(feeds)
        ctx.set_materialize_grads(False)
        ctx.shapes = [t.shape for t in outputs]
        if program.non_differentiable:
            ctx.mark_non_differentiable(*[outputs[i] for i in program.non_differentiable])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor | None):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(
                "ortwrap: double backward (create_graph=True) through an ORTWrap module is not supported"
            )
        runner: TrainingRunner = ctx.runner
        info = runner.graph.info
        state, ctx.state = ctx.state, None
        if state is None:
            raise RuntimeError(
                "ortwrap: backward ran twice through the same ORT forward; retain_graph=True is not supported"
            )
        grads = []
        non_diff = info.non_differentiable_outputs
        for i in range(len(info.user_output_names)):
            if i in non_diff:
                continue
            g = grad_outputs[i]
            if g is None:
                g = runner.zero_grad(i, ctx.shapes[i] if i in info.full_shape_grad_outputs else ())
            grads.append(g)
        try:
            results = runner.backward(state, grads)
        finally:
            if ctx.record is not None:
                ctx.record.finish()  # ORT erased this run's contexts (or the run failed)
        del state
        out: list[torch.Tensor | None] = [None] * ctx.n_feeds
        for index, g in zip(info.grad_feed_index, results):
            out[index] = g
        return (None, *out)
