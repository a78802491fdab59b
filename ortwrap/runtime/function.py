"""The autograd bridge: one ``torch.autograd.Function`` runs ORT's forward and backward.

NOTE: invariants.
- ``forward`` receives every graph feed (user tensors, then parameters and buffers, in the graph's
  feed order) so that autograd links each parameter to the graph; it returns every graph output.
- ORT, not autograd, keeps the activations: they live in the ``PartialGraphExecutionState`` held by
  ``ctx.state``. ``backward`` consumes it and drops it at once. If no backward ever runs (a forward
  under grad mode whose outputs are discarded), the state dies with the autograd graph.
- Outputs ORT calls non-differentiable, and buffer outputs, are marked non-differentiable, so
  autograd gives them no gradient. A missing gradient of a differentiable output is materialized
  as zeros, full-shaped only where the backward needs the shape; the inputs whose gradients depend
  only on missing ones get ``None``, as in eager (``TrainingRunner.place_grads``).
- Outputs ORT's backward reads (the builder's ``saved_output_indices``) are saved with
  ``save_for_backward``: autograd's version counters then catch an in-place edit of one before the
  backward, as eager does. Parameters are not checked (optimizers update them in place between steps).
- The backward is not differentiable: a double backward (``create_graph=True``) raises rather
  than silently returning gradients without a graph.

NOTE: per-step cost. This runs on every training step, so it keeps Python work to a minimum: what
depends only on the graph is precomputed by ``TrainingRunner`` (which outputs get gradients, which
need full shapes, where each gradient goes), and ``run_training_graph`` enters autograd's C implementation
directly. ``torch.autograd.Function.apply`` adds, per call, a Python frame, a closure, a
``setup_context`` check and a generator over every feed (for functorch's dead wrappers); it is used
only while a functorch transform is active, where it raises its own clear error.
"""

from __future__ import annotations

import torch

from .._compat import torch as compat
from ..bridge.runner import RunRecord
from .session import TrainingRunner

_grad_enabled = torch.is_grad_enabled


class RunTrainingGraph(torch.autograd.Function):
    """``RunTrainingGraph.apply(program, values, *feeds) -> outputs``.

    ``values`` are the feeds as OrtValues (``program.bind``); ``program`` holds the
    ``TrainingRunner`` and knows which outputs are non-differentiable (``program.non_differentiable``).
    """

    @staticmethod
    def forward(ctx, program, values, *feeds: torch.Tensor):  # type: ignore[override]
        runner: TrainingRunner = program.runner
        if program.n_pythonops:
            # NOTE: the record collects the PythonOp contexts of this run; it lives in ctx, so if
            # no backward ever runs they are released when autograd drops ctx.
            with RunRecord() as record:
                try:
                    outputs, state = runner.forward(values)
                except BaseException:
                    record.finish()  # the exception may outlive this frame: release now
                    raise
            if program.n_contexts:
                record.context_ids = outputs[len(outputs) - program.n_contexts :]
            ctx.record = record
        else:
            outputs, state = runner.forward(values)
            ctx.record = None
        ctx.runner = runner
        ctx.state = state
        ctx.materialize_grads = False  # what ctx.set_materialize_grads(False) sets, without its frame
        if runner.full_shape_outputs:
            ctx.shapes = {i: outputs[i].shape for i in runner.full_shape_outputs}
        if program.non_differentiable:
            ctx.mark_non_differentiable(*[outputs[i] for i in program.non_differentiable])
        if program.saved_outputs:
            ctx.save_for_backward(*[outputs[i] for i in program.saved_outputs])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor | None):  # type: ignore[override]
        if _grad_enabled():
            raise RuntimeError(
                "ortwrap: double backward (create_graph=True) through an ORTWrap module is not supported"
            )
        # NOTE: unpacking the saved outputs is autograd's in-place check: an output ORT's backward
        # reads, edited in place since the forward, raises eager's "modified by an inplace
        # operation" error here, before ORT computes anything from the edited values.
        ctx.saved_tensors  # noqa: B018
        runner: TrainingRunner = ctx.runner
        state, ctx.state = ctx.state, None
        if state is None:
            raise RuntimeError(
                "ortwrap: backward ran twice through the same ORT forward; retain_graph=True is not supported"
            )
        grads = []
        missing = 0
        for i in runner.grad_outputs:
            g = grad_outputs[i]
            if g is None:
                g = runner.zero_grad(i, ctx.shapes[i] if i in runner.full_shape_outputs else ())
                missing |= 1 << i
            grads.append(g)
        try:
            results = runner.backward(state, grads)
        finally:
            if ctx.record is not None:
                ctx.record.finish()  # ORT erased this run's contexts (or the run failed)
        del state
        return runner.place_grads(results, missing)


_c_apply = None
_functorch_active = None


def run_training_graph(program, values, *feeds: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``RunTrainingGraph.apply(program, values, *feeds)``, through autograd's C ``apply`` unless a
    functorch transform is active (``Function.apply`` then raises its own clear error)."""
    if _c_apply is None:
        _bind()
    if _functorch_active():
        return RunTrainingGraph.apply(program, values, *feeds)
    return _c_apply(program, values, *feeds)


def _bind() -> None:
    """On the first step: autograd's C ``apply`` bound to RunTrainingGraph (see the module's NOTE on
    per-step cost) and the functorch check, from the compat boundary (never at import)."""
    global _c_apply, _functorch_active
    _functorch_active = compat.functorch_transforms_active()
    _c_apply = compat.autograd_c_apply(RunTrainingGraph)
