"""One parity helper: run a module eagerly and through ORTWrap, compare outputs, every gradient and
every buffer over several optimizer steps with changing batch sizes."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from ortwrap import ORTWrap

ATOL = 1e-5
RTOL = 1e-4
#: The exporter check_parity uses unless wrap_options names one; the ``exporter`` fixture
#: (conftest.py) runs a test module with each.
EXPORTER = "torchscript"
#: The engine check_parity uses unless wrap_options names one (None: the option's default, "auto");
#: the ``engine`` fixture (conftest.py) runs a test with each engine whose runtime is installed.
ENGINE: str | None = None


def signature_builds(wrapped) -> tuple[int, int]:
    """How many graphs ``wrapped`` built for its calls, and the most one call signature whose sizes
    change may take on its engine: the training engine exports once (its dims are dynamic from the
    start); ``engine="onnxruntime"`` builds the first shape with static sizes, then once with
    symbolic sizes that serve the later ones (docs/engines.md, "Dynamic dims")."""
    engine = getattr(wrapped, "_engine", None)
    if engine is None:
        return wrapped.export_count, 1
    return engine.build_count, 2


def engine_missing(engine: str) -> str | None:
    """Why ``engine`` cannot run in this environment (its runtime is not installed), or None."""
    from ortwrap.engines import is_onnxruntime_available, is_training_available

    ok = {"training": is_training_available, "onnxruntime": is_onnxruntime_available}[engine]()
    return None if ok else f"engine={engine!r}: its runtime is not installed in this environment"


#: For a test in a module that runs each test with each exporter (``usefixtures("exporter")``) but
#: that exports nothing (a pass on hand-written ONNX, a kernel, an option): it runs once, and the
#: fixture's value is no exporter, so a check_parity or ``ORTWrap(..., exporter=exporter)`` in it
#: fails instead of testing one exporter under the name of both.
NO_EXPORTER = "no exporter: this test exports nothing"
no_exporter = pytest.mark.parametrize("exporter", [NO_EXPORTER], indirect=True, ids=["no-exporter"])


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """Tensor leaves of nested outputs, in a stable order (dataclass/dict keys, sequence order)."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in tensor_leaves(getattr(obj, f.name))]
    if isinstance(obj, dict):
        return [t for k in obj for t in tensor_leaves(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensor_leaves(v)]
    return []


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = ATOL, rtol: float = RTOL
) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != eager {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != eager {expected.dtype}"
    if expected.is_floating_point() and expected.numel():
        # Rounding errors of sums grow with the size of what is summed: the absolute tolerance is
        # relative to the tensor's largest element (as verify.py's check), never below ``atol``.
        atol = atol * max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def seq_len(b: int, base: int) -> int:
    """A sequence length that changes with the step's batch size (batch 4, 7, 3 -> ``base``,
    ``base + 3``, ``base - 1``), so every sequence model's parity test runs several lengths
    through one graph: nothing traced may keep a length."""
    return base + {4: 0, 7: 3, 3: -1, 2: 1}.get(b, 2)


def default_loss(out: Any) -> torch.Tensor:
    """A loss touching every floating output with fixed, position-dependent weights."""
    total = 0.0
    for i, t in enumerate(tensor_leaves(out)):
        if t.is_floating_point() and t.requires_grad:
            w = torch.linspace(-1.0, 1.0 + i, t.numel(), dtype=t.dtype, device=t.device).reshape(t.shape)
            total = total + (t * w).sum()
    return total


def _clone_inputs(args: Any, device: str = "cpu") -> Any:
    if isinstance(args, torch.Tensor):
        c = args.detach().to(device).clone()
        c.requires_grad_(args.requires_grad)
        return c
    if isinstance(args, dict):
        return type(args)((k, _clone_inputs(v, device)) for k, v in args.items())
    if isinstance(args, tuple) and hasattr(args, "_fields"):
        return type(args)(*(_clone_inputs(v, device) for v in args))
    if isinstance(args, (list, tuple)):
        return type(args)(_clone_inputs(v, device) for v in args)
    return args


def check_parity(
    make_model: Callable[[], nn.Module],
    make_inputs: Callable[[int, torch.Generator], tuple[tuple, dict]],
    *,
    batch_sizes: Sequence[int] = (4, 7, 3),
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    train: bool = True,
    lr: float = 0.05,
    atol: float = ATOL,
    rtol: float = RTOL,
    wrap_options: dict | None = None,
    seed: int = 0,
    device: str = "cpu",
    autocast: Callable[[], Any] | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> ORTWrap:
    """Train a model eagerly and an identical copy through ORTWrap; assert they agree at every step.

    ``make_inputs(batch_size, generator)`` returns ``(args, kwargs)``; tensors that require grad
    are cloned for each side and their ``.grad`` compared too. ``autocast()``, if given, returns the
    context (``torch.autocast(...)``) both forwards run in. ``optimizer(params)``, if given, builds
    each side's optimizer (default: SGD with momentum at ``lr``). Returns the ORTWrap for further
    assertions (export counts, artifacts).
    """
    import contextlib

    amp = autocast or contextlib.nullcontext
    torch.manual_seed(seed)
    eager = make_model().to(device)
    ours = copy.deepcopy(eager)
    engine = {"engine": ENGINE} if ENGINE is not None else {}
    wrapped = ORTWrap(ours, **{"fallback": False, "exporter": EXPORTER, **engine, **(wrap_options or {})})
    eager.train(train)
    wrapped.train(train)
    make_opt = optimizer or (lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9))
    opt_e = make_opt(eager.parameters())
    opt_o = make_opt(wrapped.parameters())
    gen = torch.Generator().manual_seed(seed + 1)
    for step, bs in enumerate(batch_sizes):
        args, kwargs = make_inputs(bs, gen)
        args_e, kwargs_e = _clone_inputs(args, device), _clone_inputs(kwargs, device)
        args_o, kwargs_o = _clone_inputs(args, device), _clone_inputs(kwargs, device)
        with amp():
            out_e = eager(*args_e, **kwargs_e)
        with amp():
            out_o = wrapped(*args_o, **kwargs_o)
        assert type(out_o) is type(out_e), f"step {step}: output type {type(out_o)} != eager {type(out_e)}"
        leaves_e, leaves_o = tensor_leaves(out_e), tensor_leaves(out_o)
        assert len(leaves_e) == len(leaves_o), f"step {step}: {len(leaves_o)} output tensors, eager has {len(leaves_e)}"
        for i, (a, b) in enumerate(zip(leaves_o, leaves_e)):
            assert_close(a.detach(), b.detach(), f"step {step} output {i}", atol, rtol)
            assert a.requires_grad == b.requires_grad, f"step {step} output {i}: requires_grad differs"
        loss_e = loss_fn(out_e)
        loss_o = loss_fn(out_o)
        if isinstance(loss_e, torch.Tensor) and loss_e.requires_grad:
            loss_e.backward()
            loss_o.backward()
        for i, (a, b) in enumerate(zip(leaves_o, leaves_e)):  # outputs must survive the backward
            assert_close(a.detach(), b.detach(), f"step {step} output {i} after backward", atol, rtol)
        for (name, p_o), (_, p_e) in zip(ours.named_parameters(), eager.named_parameters()):
            if p_e.grad is None:
                assert p_o.grad is None, f"step {step}: {name}.grad is set but eager's is None"
            else:
                assert p_o.grad is not None, f"step {step}: {name}.grad is None but eager's is not"
                assert_close(p_o.grad, p_e.grad, f"step {step} grad of {name}", atol, rtol)
        for i, (a, b) in enumerate(zip(tensor_leaves((args_o, kwargs_o)), tensor_leaves((args_e, kwargs_e)))):
            if b.requires_grad and b.grad is None:
                assert a.grad is None, f"step {step}: input {i}.grad is set but eager's is None"
            elif b.requires_grad:
                assert a.grad is not None, f"step {step}: input {i}.grad is None"
                assert_close(a.grad, b.grad, f"step {step} grad of input {i}", atol, rtol)
        for (name, b_o), (_, b_e) in zip(ours.named_buffers(), eager.named_buffers()):
            assert_close(b_o, b_e, f"step {step} buffer {name}", atol, rtol)
        opt_e.step()
        opt_o.step()
        opt_e.zero_grad()
        opt_o.zero_grad()
    for (name, p_o), (_, p_e) in zip(ours.named_parameters(), eager.named_parameters()):
        assert_close(p_o.detach(), p_e.detach(), f"parameter {name} after training", atol * 10, rtol * 10)
    return wrapped


def gemm_op_counts(w: ORTWrap) -> dict[str, int]:
    """How many ATen nodes of each of ortwrap's GEMM/attention ops (bf16 and float32, their backward
    ops) and of vjps the built graphs of ``w`` have."""
    counts: dict[str, int] = {}
    for program in w.programs():
        for node in program.graph.model().graph.node:
            op = next((a.s.decode() for a in node.attribute if a.name == "operator"), "")
            if op.startswith(("ortwrap_ops::linear", "ortwrap_ops::matmul", "ortwrap_ops::attention", "ortwrap_vjp::")):
                key = op.rsplit("|", 1)[-1]
                counts[key] = counts.get(key, 0) + 1
    return counts
