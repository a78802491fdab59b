"""Activation recompute (``recompute="layers"``, ortwrap/grad/recompute.py): parity with eager, and
that the backward really recomputes instead of keeping the forward's activations."""

from __future__ import annotations

import onnx
import pytest
import torch
from parity import check_parity, seq_len
from tiny_gpt import GPTConfig, TinyGPT

from ortwrap import Options, ORTWrap
from ortwrap.grad.recompute import SUFFIX, stashed_values

pytestmark = pytest.mark.usefixtures("exporter")

CFG = GPTConfig(vocab=97, d=32, heads=4, layers=3, max_len=32)


def _lm_inputs(b: int, gen: torch.Generator):
    t = seq_len(b, 12)
    ids = torch.randint(0, CFG.vocab, (b, t + 1), generator=gen)
    return (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), {}


def _lm_loss(out):
    loss, logits = out
    return loss + 0.01 * logits.float().square().mean()


def test_gpt_recompute_parity():
    """Loss, logits and every parameter gradient match eager with three recomputed GPT blocks."""
    wrapped = check_parity(
        lambda: TinyGPT(CFG),
        _lm_inputs,
        loss_fn=_lm_loss,
        wrap_options={"recompute": "layers", "build_cache": False},
    )
    report = wrapped.last_artifacts.recompute
    assert report is not None and report.mode == "layers"
    # Each block has two checkpoints (its input and the residual after attention).
    assert len(report.checkpoints) >= 2 * CFG.layers
    assert report.recomputed_values and report.recomputed_nodes >= len(report.recomputed_values)


def test_recompute_changes_the_graph():
    """The built graph stashes fewer forward values, and the backward reads recomputed copies of the
    ones it dropped; without the option the graph is the builder's."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    (ids, tgt), _ = _lm_inputs(4, torch.Generator().manual_seed(0))
    plain = ORTWrap(model, fallback=False, build_cache=False)
    plain(ids, tgt)[0].backward()
    assert plain.last_artifacts.recompute is None
    plain_stash = stashed_values(plain.last_artifacts.graph.model())

    ours = ORTWrap(TinyGPT(CFG), fallback=False, build_cache=False, recompute="layers")
    ours(ids, tgt)[0].backward()
    report = ours.last_artifacts.recompute
    built = ours.last_artifacts.graph.model()
    onnx.checker.check_model(built)
    assert report.stashed_before == tuple(plain_stash)
    assert tuple(stashed_values(built)) == report.stashed_after
    dropped = set(report.stashed_before) - set(report.stashed_after)
    assert dropped == set(report.recomputed_values)
    # The softmax of attention and the GELU output of every block are among them.
    assert len(dropped) >= 4 * CFG.layers
    names = [n.name for n in built.graph.node]
    yield_at = next(i for i, n in enumerate(built.graph.node) if n.op_type == "YieldOp")
    copies = [i for i, name in enumerate(names) if name.endswith(SUFFIX)]
    assert len(copies) == report.recomputed_nodes and min(copies) > yield_at
    readers = {x for n in built.graph.node[yield_at + 1 :] for x in n.input}
    assert all(v + SUFFIX in readers for v in report.recomputed_values)
    # The backward runs segment by segment: the gradient into each block waits for the parameter
    # gradients of the block after it (ORT would run most of them at the very end).
    assert sum(n.name.endswith("/Reshape") and "ortwrap_order" in n.name for n in built.graph.node) >= CFG.layers


def test_recompute_with_dropout_keeps_random_ops():
    """Dropout is never recomputed (a second draw would give other masks); the rest of its segment is."""
    cfg = GPTConfig(vocab=97, d=32, heads=4, layers=2, max_len=32, dropout=0.1)
    torch.manual_seed(0)
    model = ORTWrap(TinyGPT(cfg), fallback=False, build_cache=False, recompute="layers")
    (ids, tgt), _ = _lm_inputs(3, torch.Generator().manual_seed(0))
    model(ids, tgt)[0].backward()
    built = model.last_artifacts.graph.model()
    recomputed_ops = {n.op_type for n in built.graph.node if n.name.endswith(SUFFIX)}
    assert "Dropout" not in recomputed_ops and "BitmaskDropout" not in recomputed_ops
    assert model.last_artifacts.recompute.recomputed_values


def test_recompute_option_validation(monkeypatch):
    with pytest.raises(ValueError, match=r"recompute='all' is invalid; allowed: none, layers"):
        ORTWrap(torch.nn.Linear(2, 2), recompute="all")
    monkeypatch.setenv("ORTWRAP_RECOMPUTE", "layers")
    assert Options.resolve().recompute == "layers"
    monkeypatch.setenv("ORTWRAP_RECOMPUTE", "yes")
    with pytest.raises(ValueError, match="recompute='yes' is invalid"):
        Options.resolve()
