"""One rank of the torch.distributed tests (launched by tests/test_distributed.py with torchrun, 2 ranks,
gloo): Functions that call collectives, and DistributedDataParallel(ORTWrap(model)).

Each case writes ``$ORTWRAP_DIST_OUT/<case>.rank<r>.json``: ``error`` (a traceback) if a check failed,
and the observations the test asserts on. ``ORTWRAP_ENGINE`` (set by the test) picks the engine of every
ORTWrap here; each result says which engine ran and how many builds it made.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from parity import assert_close, check_parity

from ortwrap import ORTWrap
from ortwrap.integrations.distributed import stubs_active


def engine_of(wrapped: ORTWrap) -> tuple[str, int]:
    """The engine that ran ``wrapped`` and its build count (exports for the training engine)."""
    engine = wrapped._engine
    return ("training", wrapped.export_count) if engine is None else (engine.name, engine.build_count)


CALLS = {"gather_forward": 0, "reduce_backward": 0, "gather_during_export": 0}


class GatherRows(torch.autograd.Function):
    """All-gathers ``x`` along dim 0 over ``group`` (explicit group, asynchronous); the backward keeps
    this rank's rows of the gradient, scaled by the world size (not the forward's derivative)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype)
        work = dist.all_gather_into_tensor(out, x.contiguous(), group=group, async_op=True)
        work.wait()
        if stubs_active():
            CALLS["gather_during_export"] += 1
        else:
            CALLS["gather_forward"] += 1
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        return grad.chunk(world)[dist.get_rank(ctx.group)].contiguous() * world, None


class ReduceGrad(torch.autograd.Function):
    """Identity forward; the backward all-reduces (sums) the gradient over the default group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        CALLS["reduce_backward"] += 1
        return grad


GROUP: dict[str, object] = {}  # the explicit process group (a module attribute would not deepcopy)


class CollectiveNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ReduceGrad.apply(self.fc1(x))
        h = GatherRows.apply(torch.tanh(h), GROUP["group"])
        return self.fc2(h)


def case_functions(rank: int, world: int) -> dict:
    GROUP["group"] = dist.new_group(list(range(world)))  # an explicit group, passed to the Function

    def make_inputs(batch: int, gen: torch.Generator) -> tuple[tuple, dict]:
        for _ in range(rank + 1):  # a different batch on each rank
            x = torch.randn(batch, 6, generator=gen)
        return (x,), {}

    wrapped = check_parity(CollectiveNet, make_inputs, batch_sizes=(4, 4, 3))
    assert CALLS["gather_during_export"] == 1, CALLS  # the export ran the Function once, with stubs
    # The run time's gather really communicated: rows [rank*B, (rank+1)*B) are this rank's, the others
    # are the peer's (checked against an eager all_gather_object of the local rows).
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(7 + rank))
    with torch.no_grad():
        local = torch.tanh(wrapped.module.fc1(x))
        gathered = wrapped(x)
    rows = [None] * world
    dist.all_gather_object(rows, local)
    expected = wrapped.module.fc2(torch.cat(rows))
    assert_close(gathered, expected.detach(), "ORTWrap output from gathered rows")
    return {
        "calls": dict(CALLS),
        "export_count": wrapped.export_count,
        "peer_rows_differ": not torch.allclose(rows[0], rows[1]),
        "output_sum": gathered.sum().item(),
    }


def case_ddp(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    eager_model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
    ours_model = copy.deepcopy(eager_model)
    eager = DDP(eager_model)
    wrapped = ORTWrap(ours_model, fallback=False)
    ours = DDP(wrapped)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    local_grad_differs = []
    for step in range(4):
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
        local_model = copy.deepcopy(eager_model)  # this rank alone, no DDP
        ((local_model(x) - y) ** 2).mean().backward()
        out_e, out_o = eager(x), ours(x)
        assert_close(out_o.detach(), out_e.detach(), f"step {step} output")
        ((out_e - y) ** 2).mean().backward()
        ((out_o - y) ** 2).mean().backward()
        for (name, p_o), p_e in zip(ours_model.named_parameters(), eager_model.parameters()):
            assert_close(p_o.grad, p_e.grad, f"step {step} grad of {name}")
        # DDP averaged the gradients over the ranks: they are not this rank's own gradient.
        local_grad_differs.append(not torch.allclose(local_model[0].weight.grad, ours_model[0].weight.grad))
        opt_e.step()
        opt_o.step()
        opt_e.zero_grad()
        opt_o.zero_grad()
    grads = [None] * world
    dist.all_gather_object(grads, [p.detach() for p in ours_model.parameters()])
    same_everywhere = all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
    engine, builds = engine_of(wrapped)
    return {
        "engine": engine,
        "export_count": builds,
        "fallback": str(wrapped.fallback_reason) if wrapped.fallback_reason else None,
        "params_equal_across_ranks": same_everywhere,
        "allreduced_grad_differs_from_local": local_grad_differs,
    }


def case_logging(rank: int, world: int) -> dict:
    """At INFO verbosity, a build logs its summary on rank 0 only; warnings pass on every rank."""
    import logging

    import ortwrap
    from ortwrap._logging import logger as ortwrap_logger

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    logging.getLogger("ortwrap").addHandler(handler)
    before = ortwrap.get_verbosity()
    ortwrap.set_verbosity(logging.INFO)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 2))
        wrapped = ORTWrap(copy.deepcopy(model), fallback=False)
        x = torch.randn(3, 6)
        assert_close(wrapped(x).detach(), model(x).detach(), "output")
        ortwrap_logger.warning("a warning on rank %d", rank)
    finally:
        ortwrap.set_verbosity(before)
        logging.getLogger("ortwrap").removeHandler(handler)
    return {
        "info": [r.getMessage() for r in records if r.levelno < logging.WARNING],
        "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
        "export_count": wrapped.export_count,
    }


CASES = {"functions": case_functions, "ddp": case_ddp, "logging": case_logging}


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    for case in sys.argv[1:]:
        result: dict = {"case": case, "rank": rank, "world": world}
        try:
            result.update(CASES[case](rank, world))
        except Exception:
            result["error"] = traceback.format_exc()
        with open(os.path.join(os.environ["ORTWRAP_DIST_OUT"], f"{case}.rank{rank}.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
