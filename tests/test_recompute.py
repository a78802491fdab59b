"""Activation recompute (``recompute="cheap"``, the default, and ``"layers"``; ortwrap/grad/recompute.py):
parity with eager and with no recompute, and that the backward really recomputes instead of keeping
the forward's activations."""

from __future__ import annotations

import copy

import onnx
import pytest
import torch
import torch.nn.functional as F
from parity import assert_close, check_parity, seq_len
from tiny_gpt import GPTConfig, TinyGPT
from torch import nn

from ortwrap import Options, ORTWrap
from ortwrap.engines import is_training_available
from ortwrap.grad.recompute import SUFFIX, stashed_values

pytestmark = pytest.mark.usefixtures("exporter", "one_exporter_on_the_engine")

#: ``engine="onnxruntime"`` resolves here: recompute is AOTAutograd's min-cut partitioner for "cheap"
#: and "layers", its default partitioner for "none" (docs/engines.md); the training engine's recompute
#: report and built graph (``last_artifacts``) are not there.
ON_ENGINE = not is_training_available()
ENGINE_SLOW = pytest.mark.slow if ON_ENGINE else (lambda f: f)


def _training_engine(wrapped) -> bool:
    """Whether ``wrapped`` trains on the training engine (its ``last_artifacts.recompute`` report)."""
    return getattr(wrapped, "_engine", None) is None


def _engine_saved(wrapped) -> int:
    """engine=onnxruntime: how many values the last backward graph reads from the forward."""
    return sum(n.op == "placeholder" for n in wrapped._engine.last.graphs["backward"].graph.nodes)


CFG = GPTConfig(vocab=97, d=32, heads=4, layers=3, max_len=32)


def _lm_inputs(b: int, gen: torch.Generator):
    t = seq_len(b, 12)
    ids = torch.randint(0, CFG.vocab, (b, t + 1), generator=gen)
    return (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), {}


def _lm_loss(out):
    loss, logits = out
    return loss + 0.01 * logits.float().square().mean()


@ENGINE_SLOW
def test_gpt_recompute_parity():
    """Loss, logits and every parameter gradient match eager with three recomputed GPT blocks."""
    wrapped = check_parity(
        lambda: TinyGPT(CFG),
        _lm_inputs,
        loss_fn=_lm_loss,
        wrap_options={"recompute": "layers", "build_cache": False},
    )
    if not _training_engine(wrapped):  # engine=onnxruntime: no recompute report (min-cut partitioner)
        return
    report = wrapped.last_artifacts.recompute
    assert report is not None and report.mode == "layers"
    # Each block has two checkpoints (its input and the residual after attention).
    assert len(report.checkpoints) >= 2 * CFG.layers
    assert report.recomputed_values and report.recomputed_nodes >= len(report.recomputed_values)


def test_recompute_changes_the_graph(exporter):
    """The built graph stashes fewer forward values, and the backward reads recomputed copies of the
    ones it dropped; without the option the graph is the builder's."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    (ids, tgt), _ = _lm_inputs(4, torch.Generator().manual_seed(0))
    plain = ORTWrap(model, fallback=False, build_cache=False, recompute="none", exporter=exporter)
    plain(ids, tgt)[0].backward()
    if not _training_engine(plain):
        # engine=onnxruntime: "layers" is the min-cut partitioner, which saves fewer values than "none"
        ours = ORTWrap(TinyGPT(CFG), fallback=False, build_cache=False, recompute="layers", exporter=exporter)
        ours(ids, tgt)[0].backward()
        assert _engine_saved(ours) < _engine_saved(plain), (_engine_saved(ours), _engine_saved(plain))
        return
    assert plain.last_artifacts.recompute is None
    plain_stash = stashed_values(plain.last_artifacts.graph.model())

    ours = ORTWrap(TinyGPT(CFG), fallback=False, build_cache=False, recompute="layers", exporter=exporter)
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


@ENGINE_SLOW
def test_recompute_with_dropout_keeps_random_ops(exporter):
    """Dropout is never recomputed (a second draw would give other masks); the rest of its segment is."""
    cfg = GPTConfig(vocab=97, d=32, heads=4, layers=2, max_len=32, dropout=0.1)
    torch.manual_seed(0)
    model = ORTWrap(TinyGPT(cfg), fallback=False, build_cache=False, recompute="layers", exporter=exporter)
    (ids, tgt), _ = _lm_inputs(3, torch.Generator().manual_seed(0))
    model(ids, tgt)[0].backward()
    if not _training_engine(model):  # engine=onnxruntime: no built graph; AOTAutograd keeps random ops
        return
    built = model.last_artifacts.graph.model()
    recomputed_ops = {n.op_type for n in built.graph.node if n.name.endswith(SUFFIX)}
    assert "Dropout" not in recomputed_ops and "BitmaskDropout" not in recomputed_ops
    assert model.last_artifacts.recompute.recomputed_values


def test_recompute_option_validation(exporter, monkeypatch):
    with pytest.raises(ValueError, match=r"recompute='all' is invalid; allowed: none, cheap, layers"):
        ORTWrap(torch.nn.Linear(2, 2), recompute="all", exporter=exporter)
    assert Options.resolve().recompute == "cheap"
    monkeypatch.setenv("ORTWRAP_RECOMPUTE", "layers")
    assert Options.resolve().recompute == "layers"
    monkeypatch.setenv("ORTWRAP_RECOMPUTE", "yes")
    with pytest.raises(ValueError, match="recompute='yes' is invalid"):
        Options.resolve()


class _PaddedGPT(nn.Module):
    """A GPT-style LM whose attention takes a causal mask combined with a padding mask (so the
    recomputed scores read a data-dependent mask), two blocks, a loss over the unpadded positions."""

    def __init__(self, vocab: int = 61, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.ln1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.ln2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.fc = nn.ModuleList(nn.Linear(d, 4 * d) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(4 * d, d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor, targets: torch.Tensor):
        b, t = ids.shape
        x = self.tok(ids)
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        mask = causal[None, None] & keep[:, None, None, :]
        for i in range(len(self.qkv)):
            d = x.shape[-1]
            q, k, v = self.qkv[i](self.ln1[i](x)).split(d, dim=-1)
            q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + self.proj[i](a.transpose(1, 2).reshape(b, t, d))
            x = x + self.out[i](F.gelu(self.fc[i](self.ln2[i](x))))
        logits = self.head(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.masked_fill(~keep, -100).reshape(-1))
        return loss, logits


def _padded_inputs(b: int, gen: torch.Generator):
    t = seq_len(b, 10)
    ids = torch.randint(0, 61, (b, t), generator=gen)
    lengths = torch.randint(2, t + 1, (b,), generator=gen)
    keep = torch.arange(t)[None, :] < lengths[:, None]
    return (ids, keep, torch.randint(0, 61, (b, t), generator=gen)), {}


_MODELS = {
    "causal": (lambda: TinyGPT(CFG), _lm_inputs),
    "causal_and_padding": (_PaddedGPT, _padded_inputs),
}


def _softmax_outputs(model: onnx.ModelProto) -> set[str]:
    """Outputs of the forward's softmax nodes (ONNX Softmax or ortwrap's CPU kernel)."""
    out = set()
    for n in model.graph.node:
        if n.op_type == "YieldOp":
            break
        op = next((a.s.decode() for a in n.attribute if a.name == "operator"), "")
        if n.op_type == "Softmax" or op.endswith("::softmax"):
            out.update(n.output)
    return out


@ENGINE_SLOW
@pytest.mark.parametrize("which", sorted(_MODELS))
def test_cheap_recompute_parity(which):
    """recompute="cheap": loss, logits and every parameter gradient match eager over three steps
    with changing batch size and sequence length."""
    make_model, make_inputs = _MODELS[which]
    wrapped = check_parity(
        make_model, make_inputs, loss_fn=_lm_loss, wrap_options={"recompute": "cheap", "build_cache": False}
    )
    if not _training_engine(wrapped):  # engine=onnxruntime: no recompute report (min-cut partitioner)
        return
    report = wrapped.last_artifacts.recompute
    assert report is not None and report.mode == "cheap" and report.recomputed_values


@ENGINE_SLOW
@pytest.mark.parametrize("which", sorted(_MODELS))
def test_cheap_recompute_equals_no_recompute(which):
    """The recomputed values are the same computation on the same inputs: outputs and every
    parameter gradient are those of recompute="none", step after step, to rounding (the first step's
    differ in the last bit at most: a tied weight's gradient contributions are summed in another order)."""
    make_model, make_inputs = _MODELS[which]
    torch.manual_seed(0)
    base = make_model()
    runs = {}
    for mode in ("none", "cheap"):
        model = ORTWrap(copy.deepcopy(base), fallback=False, build_cache=False, recompute=mode, exporter=_exporter())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        steps = []
        for b in (4, 7, 3):
            args, _ = make_inputs(b, gen)
            loss, logits = model(*args)
            _lm_loss((loss, logits)).backward()
            steps.append((loss.detach(), logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
            opt.zero_grad()
        runs[mode] = steps
    for step, ((l0, o0, g0), (l1, o1, g1)) in enumerate(zip(runs["none"], runs["cheap"])):
        assert_close(l1, l0, f"step {step} loss", atol=1e-7, rtol=1e-6)
        assert_close(o1, o0, f"step {step} logits", atol=1e-7, rtol=1e-6)
        assert g0.keys() == g1.keys()
        for name in g0:
            assert_close(g1[name], g0[name], f"step {step} grad of {name}", atol=1e-7, rtol=1e-6)


def _exporter() -> str:
    import parity

    return parity.EXPORTER


@pytest.mark.skipif(
    ON_ENGINE, reason="engine=onnxruntime: reads the training engine's built graph and recompute report"
)
@pytest.mark.parametrize("which", sorted(_MODELS))
def test_cheap_recompute_drops_attention_probabilities(which):
    """With ``recompute="cheap"`` the backward no longer keeps the attention probabilities [B, H, T, T]: it
    recomputes them from the stashed scaled q and k^T and the mask."""
    if which == "causal_and_padding":
        # The graph computes the padding mask from the input ``keep`` and stashes neither: the
        # probabilities' chain would need a value not kept, so they stay stashed (docs/performance.md).
        pytest.skip("a padding mask computed from an input is not stashed: the probabilities stay stashed")
    make_model, make_inputs = _MODELS[which]
    torch.manual_seed(0)
    args, _ = make_inputs(4, torch.Generator().manual_seed(0))
    built = {}
    for mode in ("none", None):
        opts = {"recompute": "cheap"} if mode is None else {"recompute": mode}
        model = ORTWrap(make_model(), fallback=False, build_cache=False, exporter=_exporter(), **opts)
        model(*args)[0].backward()
        built[mode] = (model.last_artifacts.graph.model(), model.last_artifacts.recompute)
    plain, _ = built["none"]
    cheap, report = built[None]
    assert report is not None and report.mode == "cheap"
    onnx.checker.check_model(cheap)
    probs_before = _softmax_outputs(plain) & set(stashed_values(plain))
    assert len(probs_before) >= 2, "without recompute the probabilities are stashed"
    after = set(stashed_values(cheap))
    assert not (_softmax_outputs(cheap) & after)
    assert probs_before <= set(report.recomputed_values)
    # Nothing computed from the inputs' data is newly stashed; a causal mask built from shapes may be.
    dims = {v.name: len(v.type.tensor_type.shape.dim) for v in cheap.graph.value_info}
    new = after - set(stashed_values(plain))
    assert all(dims.get(x, 99) <= 2 for x in new), f"newly stashed: {new}"
    assert after == set(report.stashed_after)
    # The copies run in the backward.
    yield_at = next(i for i, n in enumerate(cheap.graph.node) if n.op_type == "YieldOp")
    copies = [i for i, n in enumerate(cheap.graph.node) if n.name.endswith(SUFFIX)]
    assert copies and min(copies) > yield_at


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6, momentum=0.3)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.l(x))))


@pytest.mark.parametrize("mode", ["cheap", "layers"])
def test_recompute_never_repeats_batchnorm(mode):
    """BatchNorm in training mode writes its running statistics into the buffers: a recomputed copy
    would update them twice. Buffers and every gradient match eager."""
    check_parity(
        _BatchNormNet,
        lambda b, g: ((torch.randn(b, 5, generator=g),), {}),
        wrap_options={"recompute": mode, "build_cache": False},
    )


class _PoolNorm(nn.Module):
    """A 1x1 convolution, then a normalization by a pooled square of the activation across channels.

    ``"lrn"`` is ``nn.LocalResponseNorm``; ``"depth_pool"`` another chain of the same kind (pad the
    channel axis on the other side, pool two channels, divide by another power). Under TorchScript
    both export as ``Pad -> ATen avg_pool3d -> ATen ortwrap_ops::squeeze_ones`` (ONNX shape inference
    loses the unsqueezed size-1 dim): the backward has two ATen vjp nodes in a row, and the first
    one's result is a view of its input gradient."""

    def __init__(self, chain: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.out = nn.Conv2d(4, 2, 1)
        self.chain = chain

    def forward(self, x):
        h = self.conv(x)
        if self.chain == "lrn":
            h = F.local_response_norm(h, 2, alpha=0.1, beta=0.6, k=1.5)
        else:
            pooled = F.avg_pool3d(F.pad(h.square().unsqueeze(1), (0, 0, 0, 0, 1, 0)), (2, 1, 1), stride=1).squeeze(1)
            h = h / (1.0 + pooled).pow(0.75)
        return self.out(h)


# dynamo exports no squeeze_ones; engine=onnxruntime: exporter= does not apply, the [dynamo] variant runs
@pytest.mark.parametrize("exporter", ["dynamo" if ON_ENGINE else "torchscript"], indirect=True)
@pytest.mark.parametrize("mode", ["none", "cheap", "layers"])
@pytest.mark.parametrize("chain", ["lrn", "depth_pool"])
def test_recompute_pooled_normalization_torchscript(chain, mode):
    """Every parameter gradient matches eager over three steps, with and without recompute.

    Regression: an ATen vjp result that was a view of its input gradient (``squeeze_ones``' backward
    unsqueezes the gradient) was handed to ORT as is; ORT's memory planner reused that input's buffer
    for a later value (with recompute, the recomputed copy of the squared activation) before the next
    vjp read the view, and ``cheap`` and ``layers`` gave gradients off by tens. The bridge now copies
    a result that shares an input's memory (``bridge/aten.py``, ``_encode``)."""
    check_parity(
        lambda: _PoolNorm(chain),
        lambda b, g: ((torch.randn(b, 3, 6, 6, generator=g),), {}),
        wrap_options={"recompute": mode, "build_cache": False},
    )


def _operator(node) -> str | None:
    return next((a.s.decode() for a in node.attribute if a.name == "operator"), None)


@pytest.mark.skipif(ON_ENGINE, reason="the training engine's built graph")
def test_cheap_recompute_keeps_windowed_pooling():
    """``"cheap"`` treats windowed pooling as heavy: no max-pool copy in the UNet's backward (ORT's
    MaxPool with indices cost as much again, to free an output a quarter of its input; before, the
    second max-pool's output was recomputed, with the norm and SiLU before it, from the block's
    stashed input; ortwrap's max_pool kernel is declared heavy for the same reason); parity with eager."""
    from model_zoo import UNet, unet_inputs

    wrapped = check_parity(UNet, unet_inputs, batch_sizes=(2, 3), wrap_options={"build_cache": False})
    model = wrapped.last_artifacts.graph.model()
    copies = [n for n in model.graph.node if n.name.endswith(SUFFIX)]
    pools = [n for n in model.graph.node if n.op_type == "MaxPool" or _operator(n) == "ortwrap_cpu::max_pool"]
    assert len(pools) == 2 and not [n.name for n in pools if n.name.endswith(SUFFIX)]
    assert not [n.name for n in copies if n.op_type == "AveragePool"]
