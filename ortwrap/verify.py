"""``ORTWrap(model, verify=True)``: check each new build against eager PyTorch on its first step.

Exporters can be silently wrong for training (the dynamo exporter's torchlib forces BatchNorm into
inference mode and ignores ``label_smoothing``; ORT's gradient builder drops gradients through
sequence ops). ortwrap fixes the cases it knows; verification catches the ones it does not.

For the first call of every new program, :func:`verify_program`:

1. runs the module eagerly on the call's inputs, and computes the gradients of a fixed random
   projection of its floating outputs (``sum(out_i * w_i)``) with respect to every trainable
   parameter and every input that requires grad (``torch.autograd.grad``: nothing is accumulated
   into ``.grad``);
2. runs the ORT program on the same inputs and does the same;
3. compares outputs, updated buffers and gradients, elementwise, with
   ``|ort - eager| <= atol + rtol * |eager|``, ``atol = ATOL * max(1, max|eager|)``;
4. restores the buffers and the RNG state, so the real step that follows is unaffected, and
   raises :class:`ortwrap.errors.VerificationError` naming the first mismatch.

The real step then runs as usual. Graphs with random ops in training mode (``Dropout`` with a
nonzero ratio) cannot match eager exactly: their verification is skipped with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from . import _tree
from ._logging import logger
from .errors import VerificationError

ATOL = 1e-5
RTOL = 1e-4

_RANDOM_OPS = frozenset({"Dropout", "RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike"})
_RANDOM_OPS |= {"Multinomial", "Bernoulli", "BiasDropout", "BitmaskDropout", "BitmaskBiasDropout"}


class VerificationSkipped(UserWarning):
    """``verify=True`` could not compare a build (it has random ops)."""


def _random_nodes(program) -> list[str]:
    return [f"{n.op_type} {n.name!r}" for n in program.graph.model().graph.node if n.op_type in _RANDOM_OPS]


def _flat_outputs(out: Any) -> list[torch.Tensor]:
    leaves: list[torch.Tensor] = []
    _tree.flatten(out, "output", leaves, lambda path, value: ("O", value), objects=True)
    return leaves


def _projection(outputs: list[torch.Tensor]) -> torch.Tensor | None:
    gen = torch.Generator().manual_seed(1234)
    total = None
    for t in outputs:
        if t.is_floating_point() and t.requires_grad:
            w = torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)
            term = (t * w).sum()
            total = term if total is None else total + term
    return total


def _grads(loss: torch.Tensor | None, wrt: list[torch.Tensor]) -> list[torch.Tensor | None]:
    if loss is None or not wrt:
        return [None] * len(wrt)
    return list(torch.autograd.grad(loss, wrt, allow_unused=True))


def _compare(what: str, ort: torch.Tensor | None, eager: torch.Tensor | None) -> str | None:
    if ort is None and eager is None:
        return None
    if ort is None:
        ort = torch.zeros_like(eager)
    if eager is None:
        eager = torch.zeros_like(ort)
    if ort.shape != eager.shape:
        return f"{what}: shape {tuple(ort.shape)} through ORT, {tuple(eager.shape)} in eager"
    if not (ort.is_floating_point() or ort.is_complex()):
        if not torch.equal(ort.to(eager.dtype), eager):
            return f"{what}: values differ ({int((ort.to(eager.dtype) != eager).sum())} elements)"
        return None
    o, e = ort.detach().double(), eager.detach().double()
    scale = max(1.0, float(e.abs().max())) if e.numel() else 1.0
    diff = (o - e).abs()
    bad = diff > ATOL * scale + RTOL * e.abs()
    if bool(bad.any()) or not bool(torch.isfinite(o).all() == torch.isfinite(e).all()):
        return (
            f"{what}: max |ORT - eager| = {float(diff.max()):.3g} (eager max |value| {float(e.abs().max()):.3g}), "
            f"{int(bad.sum())} of {bad.numel()} elements off"
        )
    return None


def verify_program(module: nn.Module, program, args: tuple, kwargs: dict, leaves: list[torch.Tensor], run) -> None:
    """Compare ``program`` with eager ``module`` on one call; see the module docstring.

    Args:
        module: the wrapped module.
        program: the new :class:`ortwrap.runtime.program.Program`.
        args, kwargs: the call's arguments (for the eager run).
        leaves: the call's flat tensor inputs (for the ORT run).
        run: ``run(program, leaves) -> flat outputs`` (user outputs, then buffer outputs).

    Raises:
        VerificationError: naming the first output, buffer or gradient that differs.
    """
    random_nodes = _random_nodes(program) if module.training else []
    if random_nodes:
        warnings.warn(
            f"ORTWrap(verify=True) skipped {type(module).__name__}: its graph has random ops "
            f"({', '.join(random_nodes[:3])}) that cannot match eager; verify it in eval mode or with dropout 0",
            VerificationSkipped,
            stacklevel=4,
        )
        return
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad] if program.with_backward else []
    inputs = [(i, t) for i, t in enumerate(leaves) if t.requires_grad] if program.with_backward else []
    wrt = [p for _, p in params] + [t for _, t in inputs]
    names = [f"gradient of parameter {n!r}" for n, _ in params] + [f"gradient of input {i}" for i, _ in inputs]
    buffers = dict(module.named_buffers())
    saved = {n: b.detach().clone() for n, b in buffers.items()}
    rng = torch.random.get_rng_state()
    problems: list[str] = []
    try:
        with torch.enable_grad() if program.with_backward else torch.no_grad():
            eager_out = _flat_outputs(module(*args, **kwargs))
            eager_grads = _grads(_projection(eager_out), wrt)
        eager_buffers = {n: b.detach().clone() for n, b in buffers.items()}
        _restore(buffers, saved)
        torch.random.set_rng_state(rng)
        with torch.enable_grad() if program.with_backward else torch.no_grad():
            outputs = run(program, leaves)
            n = program.n_outputs
            ort_out = list(outputs[:n])
            ort_grads = _grads(_projection(ort_out), wrt)
        if len(ort_out) != len(eager_out):
            problems.append(f"{len(ort_out)} outputs through ORT, {len(eager_out)} in eager")
        for i, (o, e) in enumerate(zip(ort_out, eager_out)):
            problems.append(_compare(f"output {i}", o, e))
        # Buffers the program does not output keep their values: compare those too (a graph that
        # silently stopped updating BatchNorm statistics has no buffer outputs at all).
        ort_buffers = dict(saved)
        by_id = {id(b): name for name, b in buffers.items()}
        for buf, value in zip(program.buffer_outputs, outputs[n : n + len(program.buffer_outputs)]):
            if id(buf) in by_id:
                ort_buffers[by_id[id(buf)]] = value
        for name in buffers:
            problems.append(_compare(f"buffer {name!r} after the step", ort_buffers[name], eager_buffers[name]))
        for what, o, e in zip(names, ort_grads, eager_grads):
            problems.append(_compare(what, o, e))
    finally:
        _restore(buffers, saved)
        torch.random.set_rng_state(rng)
    problems = [p for p in problems if p]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise VerificationError(
            f"ORTWrap(verify=True): the ONNX Runtime build of {type(module).__name__} does not match eager PyTorch: "
            f"{problems[0]}{more}. All differences: {'; '.join(problems[:8])}. The export or a rewrite is wrong "
            "for this model: try the other exporter (exporter='torchscript' or 'dynamo'), save the graphs with "
            "debug_dir=... and report it, or run the module without ORTWrap."
        )
    logger.info("verified the new build of %s against eager: %d outputs, %d gradients", type(module).__name__,
                len(eager_out), len(wrt))  # fmt: skip


def _restore(buffers: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, value in saved.items():
            buffers[name].copy_(value)
