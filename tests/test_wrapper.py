"""ORTWrap as an nn.Module: parameters, state_dict, modes, re-export rules, fallback, bad inputs,
options and build artifacts.

Runs on whichever engine the venv resolves (``ORT_EXTRA=ort make test`` runs it on ``"onnxruntime"``):
outputs and gradients are compared with eager on both. ``export_count``, ``programs()``,
``last_artifacts``, ``debug_dir``, the exporters' own failures (TorchScript's If nodes) and PythonOp
nodes are the training engine's (docs/engines.md); there the tests assert the engine's own behaviour."""

from __future__ import annotations

import copy
import gc
import os
import warnings
import weakref

import onnx
import pytest
import torch
from parity import assert_close, seq_len, signature_builds
from torch import nn

import ortwrap
from ortwrap import ExportError, FallbackWarning, Options, ORTWrap, UnsupportedInputError
from ortwrap.engines import is_training_available

#: The engine ORTWrap resolves here is "onnxruntime" (the venv has no training build).
ON_ENGINE = not is_training_available()
pytestmark = pytest.mark.usefixtures("one_exporter_on_the_engine")


def builds(w: ORTWrap) -> int:
    """Graphs built so far: exports on the training engine, builds on the onnxruntime engine."""
    return signature_builds(w)[0]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(p=0.0), nn.ReLU(), nn.Linear(16, 3))


def test_state_dict_keys_unprefixed_and_module_attribute():
    m = mlp()
    w = ORTWrap(m)
    assert w.module is m
    assert list(w.state_dict()) == list(m.state_dict())
    assert [p is q for p, q in zip(w.parameters(), m.parameters())] == [True] * 4


def test_optimizer_built_before_or_after_wrapping_trains_the_same_tensors():
    m = mlp()
    opt_before = torch.optim.SGD(m.parameters(), lr=0.1)
    w = ORTWrap(m, fallback=False)
    x = torch.randn(5, 8)
    before = [p.detach().clone() for p in m.parameters()]
    w(x).sum().backward()
    opt_before.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, m.parameters()))
    opt_after = torch.optim.SGD(w.parameters(), lr=0.1)
    assert {id(p) for g in opt_after.param_groups for p in g["params"]} == {id(p) for p in m.parameters()}


def test_load_state_dict_is_seen_by_next_step():
    w = ORTWrap(mlp(), fallback=False)
    x = torch.randn(4, 8)
    w(x)
    exports = builds(w)  # 0 if the session's build cache had this graph
    other = mlp()
    for p in other.parameters():
        nn.init.normal_(p)
    w.load_state_dict(other.state_dict())
    assert_close(w(x).detach(), other(x).detach(), "output after load_state_dict")
    assert builds(w) == exports  # new parameter values never rebuild
    # assign=True replaces the parameter objects: the next step must feed the new ones.
    third = mlp()
    for p in third.parameters():
        nn.init.uniform_(p)
    w.load_state_dict(third.state_dict(), assign=True)
    assert_close(w(x).detach(), third(x).detach(), "output after load_state_dict(assign=True)")
    # (the onnxruntime engine keys a build by the parameters' identity: new objects build once more)
    assert builds(w) == exports + (1 if ON_ENGINE else 0)


def test_state_dict_round_trip_through_a_parent_module():
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = ORTWrap(mlp())
            self.extra = nn.Linear(2, 2)

    p = Parent()
    sd = p.state_dict()
    assert "body.0.weight" in sd and not any(k.startswith("body.module.") for k in sd)
    q = Parent()
    q.load_state_dict(copy.deepcopy(sd))
    assert all(torch.equal(sd[k], v) for k, v in q.state_dict().items())


def test_train_eval_and_no_grad_follow_eager(exporter):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 2))
    ref = copy.deepcopy(m)
    w = ORTWrap(m, fallback=False, exporter=exporter)
    x = torch.randn(8, 6)
    # eval + no_grad: running stats are used and stay unchanged; dropout off.
    w.eval()
    ref.eval()
    with torch.no_grad():
        out = w(x)
    assert not out.requires_grad
    assert_close(out, ref(x).detach(), "eval output")
    assert not m.training and not m[2].training
    # train + no_grad: BatchNorm still updates its running statistics, as in eager.
    w.train()
    ref.train()
    m[2].p = 0.0
    ref[2].p = 0.0
    with torch.no_grad():
        w(x)
        ref(x)
    assert_close(m[1].running_mean, ref[1].running_mean, "running_mean after a no_grad train step")
    assert_close(m[1].running_var, ref[1].running_var, "running_var after a no_grad train step")
    assert builds(w) == 2  # the mode change re-exports (and p is a constant of the graph)


def test_dropout_is_active_in_training(exporter):
    w = ORTWrap(nn.Dropout(0.5), fallback=False, exporter=exporter)
    x = torch.ones(1000, requires_grad=True)
    y = w(x)
    zeros = (y == 0).float().mean().item()
    assert 0.4 < zeros < 0.6
    kept = y != 0
    assert torch.allclose(y[kept], torch.full_like(y[kept], 2.0))
    y.sum().backward()
    assert torch.equal(x.grad != 0, kept)  # the gradient uses the same mask as the forward


def test_reexport_rules(exporter):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x, k: int = 1, flag: bool = False, extra=None):
            y = self.l(x) * k
            if flag:
                y = y + 1
            if extra is not None:
                y = y + extra
            return y

    w = ORTWrap(M(), fallback=False, exporter=exporter)
    # (on the onnxruntime engine the new batch size builds once more, with symbolic sizes: docs/engines.md)
    dyn = 1 if ON_ENGINE else 0
    w(torch.randn(2, 4))
    w(torch.randn(9, 4))  # batch size: no re-export
    assert builds(w) == 1 + dyn
    w(torch.randn(2, 3, 4))  # rank
    assert builds(w) == 2 + dyn
    w(torch.randn(2, 4), k=2)  # constant value
    assert builds(w) == 3 + dyn
    out = w(torch.randn(2, 4), k=2)
    assert builds(w) == 3 + dyn
    w(torch.randn(2, 4), k=2, flag=True)
    assert builds(w) == 4 + dyn
    w(torch.randn(2, 4), extra=torch.randn(4))  # input structure
    assert builds(w) == 5 + dyn
    w(torch.randn(2, 4).requires_grad_())  # requires_grad
    assert builds(w) == 6 + dyn
    w(torch.randn(2, 4, dtype=torch.float64).float())  # same dtype after cast: reuse
    assert builds(w) == 6 + dyn
    w.module.double()
    w(torch.randn(2, 4, dtype=torch.float64))  # dtype
    assert builds(w) == 7 + dyn
    assert out.shape == (2, 4)


def test_non_tensor_constant_values_are_baked_in():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(3, 3)

        def forward(self, x, alpha: float):
            return self.l(x) * alpha

    m = Scale()
    w = ORTWrap(m, fallback=False)
    x = torch.randn(2, 3)
    for alpha in (0.5, 2.0, 0.5):
        assert_close(w(x, alpha).detach(), m(x, alpha).detach(), f"alpha={alpha}")
    assert builds(w) == 2


class ReturnsInt(torch.autograd.Function):
    """A Function with a non-tensor output: it cannot run inside ONNX Runtime."""

    @staticmethod
    def forward(ctx, x):
        return x * 2, 3

    @staticmethod
    def backward(ctx, g, _):
        return g


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        y, k = ReturnsInt.apply(self.l(x))
        return y * k


class ReentrantCheckpoint(nn.Module):
    """checkpoint(use_reentrant=True): a Function whose forward reads parameters from a closure; the
    onnxruntime engine can neither trace it nor run it as an opaque op (docs/engines.md, "Functions")."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda h: self.l(h).tanh(), x, use_reentrant=True)


#: A module each engine cannot build, and what its fallback warning and error name.
UNBUILDABLE, UNBUILDABLE_ERROR, UNBUILDABLE_MATCH = (
    (ReentrantCheckpoint, ortwrap.UnsupportedFunctionError, r"AOTAutograd could not trace.*CheckpointFunction")
    if ON_ENGINE
    else (Untraceable, ExportError, r"export phase failed.*ReturnsInt returned tuple holding Tensor, int")
)


def test_fallback_warns_once_names_phase_and_matches_eager():
    m = UNBUILDABLE()
    w = ORTWrap(m)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.warns(FallbackWarning, match=UNBUILDABLE_MATCH):
        y = w(x)
    assert isinstance(w.fallback_reason, UNBUILDABLE_ERROR)
    assert isinstance(w.fallback_reason.__cause__, Exception)
    assert_close(y, m(x), "fallback output")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w(x).sum().backward()  # no second warning
    assert m.l.weight.grad is not None


def test_fallback_false_raises_the_phase_error():
    w = ORTWrap(UNBUILDABLE(), fallback=False)
    with pytest.raises(UNBUILDABLE_ERROR, match=UNBUILDABLE_MATCH.rsplit(".*", 1)[-1]) as info:
        w(torch.randn(3, 4, requires_grad=True))
    assert info.value.__cause__ is not None


def test_fallback_env_var_raises(monkeypatch):
    monkeypatch.setenv("ORTWRAP_FALLBACK", "0")
    w = ORTWrap(UNBUILDABLE())
    assert w.options.fallback is False
    with pytest.raises(UNBUILDABLE_ERROR):
        w(torch.randn(3, 4, requires_grad=True))


@pytest.mark.skipif(not ON_ENGINE, reason="the training engine cannot run it (the fallback tests above)")
def test_a_function_returning_an_int_trains_like_eager_on_the_onnxruntime_engine():
    """AOTAutograd traces a Function with a non-tensor output (the training engine's PythonOp cannot
    return one): it trains on the onnxruntime engine, with eager's numbers."""
    torch.manual_seed(0)
    m = Untraceable()
    ref = copy.deepcopy(m)
    w = ORTWrap(m, fallback=False)
    x = torch.randn(3, 4)
    y = w(x)
    assert_close(y.detach(), ref(x).detach(), "output")
    (y * torch.arange(4.0)).sum().backward()
    (ref(x) * torch.arange(4.0)).sum().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"{name}.grad")
    assert w.fallback_reason is None and w._engine.fallback_calls == 0


def test_wrong_feature_size_raises_like_eager_and_wrapper_keeps_working(exporter):
    m = mlp()
    w = ORTWrap(m, fallback=False, exporter=exporter)
    x = torch.randn(4, 8)
    w(x).sum().backward()
    bad = torch.randn(4, 7)
    with pytest.raises(RuntimeError) as eager:
        m(bad)
    with pytest.raises(RuntimeError) as ours:  # eager's own error, not ORT's
        w(bad)
    assert str(ours.value) == str(eager.value)
    m.zero_grad()
    y = w(x)
    y.sum().backward()
    ref = copy.deepcopy(m)
    ref.zero_grad()
    ref(x).sum().backward()
    assert_close(y.detach(), ref(x).detach(), "output after a failed call")
    assert_close(m[0].weight.grad, ref[0].weight.grad, "grad after a failed call")


def test_a_bad_batch_raises_eagers_error_without_falling_back_and_keeps_the_dims_dynamic(exporter):
    """With ``fallback`` on, a batch the module rejects raises eager's exception: no FallbackWarning, no
    fallback_reason, and (onnxruntime engine) the signature's dims still go symbolic after it."""
    m = mlp()
    w = ORTWrap(m, exporter=exporter)
    w(torch.randn(4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(5x7 and 8x16\)"):
            w(torch.randn(5, 7))
    assert w.fallback_reason is None
    for b in (5, 6, 3):
        x = torch.randn(b, 8)
        assert_close(w(x).detach(), m(x).detach(), f"batch {b} after a bad batch")
    built, most = signature_builds(w)
    assert built <= most, "a bad batch must not keep later batch sizes from sharing a build"


def test_unsupported_input_type_names_the_argument():
    import numpy as np

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(2, 2)

        def forward(self, x, batch):
            return self.l(x)

    w = ORTWrap(M())
    with pytest.raises(UnsupportedInputError, match=r"`batch\['weights'\]`.*numpy.ndarray"):
        w(torch.randn(1, 2), {"weights": np.ones(2)})


def test_options_validation_and_environment(monkeypatch):
    with pytest.raises(TypeError, match=r"unknown option.*fallbak"):
        ORTWrap(mlp(), fallbak=True)
    with pytest.raises(ValueError, match=r"log_level.*allowed: DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        ORTWrap(mlp(), log_level="LOUD")
    monkeypatch.setenv("ORTWRAP_INTRA_OP_THREADS", "1")
    monkeypatch.setenv("ORTWRAP_LOG_LEVEL", "error")  # the process's verbosity, read at import: not an option's
    opts = Options.resolve()
    assert opts.intra_op_threads == 1 and opts.log_level is None
    assert Options.resolve(intra_op_threads=2).intra_op_threads == 2  # keyword wins
    monkeypatch.setenv("ORTWRAP_ALLOW_SPINNING", "maybe")
    with pytest.raises(ValueError, match="ORTWRAP_ALLOW_SPINNING"):
        Options.resolve()
    assert set(ortwrap.ENV_VARS) >= {"ORTWRAP_FALLBACK", "ORTWRAP_DEBUG_DIR", "ORTWRAP_LOG_LEVEL"}


def test_debug_dir_and_last_artifacts(tmp_path):
    # ORT's own LayerNorm kernels (not ortwrap's): the optional outputs must be restored for them.
    w = ORTWrap(
        nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)),
        debug_dir=str(tmp_path),
        fallback=False,
        native_kernels=False,
        build_cache=False,  # a full build, not one loaded from the cache
    )
    w(torch.randn(2, 3)).sum().backward()
    files = sorted(os.listdir(tmp_path))
    if ON_ENGINE:  # debug_dir and last_artifacts are the training engine's (docs/engines.md): none here
        assert files == [] and w.last_artifacts is None and w._engine.build_count == 1
        return
    assert {
        "build01_train_exported.onnx",
        "build01_train_forward_backward.onnx",
        "build01_train_pre_grad.onnx",
    } <= set(files)
    # Every stage that provides an ONNX model left a snapshot; passes only where they changed it.
    snapshots = [f for f in files if f.startswith("build01_train_") and f[len("build01_train_") :][:2].isdigit()]
    stages = [f.split("_", 3)[3].rsplit("_", 1)[0] for f in snapshots]
    for name in ("translate", "type_inference", "RestoreOptionalOutputsPass", "serialize", "gradient_build"):
        assert any(s.startswith(name) for s in stages), (name, snapshots)
    assert not any(s.startswith("RefuseControlFlowPass") for s in stages)  # changed nothing
    art = w.last_artifacts
    assert list(art.stage_seconds)[:3] == ["export", "cache_lookup", "translate"]  # the key is made from the capture
    assert "gradient_build" in art.stage_seconds
    assert [r.name for r in art.stages] == list(art.stage_seconds)
    ops = [n.op_type for n in art.graph.model().graph.node]
    assert "YieldOp" in ops and "LayerNormalizationGrad" in ops
    ln = next(n for n in art.pre_grad.graph.node if n.op_type == "LayerNormalization")
    assert len(ln.output) == 3  # the optional outputs were restored for the gradient
    assert "RestoreOptionalOutputsPass" in [p.name for p in art.passes if p.modified]
    assert set(art.seconds) == {"export", "passes", "gradient_build", "session"}
    onnx.checker.check_model(onnx.load(str(tmp_path / "build01_train_exported.onnx")))


def test_a_failed_build_keeps_its_snapshots_and_the_error(tmp_path):
    class SqueezeBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return self.l(x).squeeze(0)

    m = SqueezeBatch()
    w = ORTWrap(m, exporter="torchscript", debug_dir=str(tmp_path), fallback=False)
    if ON_ENGINE:  # (no TorchScript If node, no snapshots there: AOTAutograd's graph trains, as eager)
        x = torch.randn(1, 3, 4)
        assert_close(w(x).detach(), m(x).detach(), "output")
        assert os.listdir(tmp_path) == []
        return
    with pytest.raises(ortwrap.PassError, match="control flow"):
        w(torch.randn(1, 3, 4))
    files = sorted(os.listdir(tmp_path))
    failed = [f for f in files if f.endswith("_FAILED.txt")]
    assert len(failed) == 1 and "RefuseControlFlowPass" in failed[0], files
    assert "control flow" in (tmp_path / failed[0]).read_text()
    assert any("type_inference" in f for f in files)  # the snapshots before the failure stay


def test_user_export_unaffected_by_wrapper(tmp_path):
    # ortwrap exports with its own settings and symbolics; a user's export of the same module is untouched.
    m = mlp().eval()
    w = ORTWrap(m, fallback=False)
    w(torch.randn(2, 8))
    emb = nn.Embedding(10, 4, padding_idx=0)
    ORTWrap(emb, fallback=False)(torch.tensor([[0, 3]])).sum().backward()  # uses ortwrap's embedding symbolic
    emb_path = str(tmp_path / "emb.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(emb, (torch.tensor([[0, 3]]),), emb_path, dynamo=False)
    assert [n.op_type for n in onnx.load(emb_path).graph.node] == ["Gather"]
    path = str(tmp_path / "user.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (torch.randn(2, 8),), path, dynamo=False)
    model = onnx.load(path)
    assert len(model.graph.initializer) == 4  # parameters stay initializers in the user's export


def test_custom_autograd_function_is_never_silently_differentiated_by_ort():
    # The Function runs as a PythonOp: ORT calls its own backward (3x), not the derivative of round().
    class StraightThrough(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.round(x)

        @staticmethod
        def backward(ctx, g):
            return g * 3.0  # not the derivative of round()

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(3, 3)

        def forward(self, x):
            return StraightThrough.apply(self.l(x))

    m = M()
    ref = copy.deepcopy(m)
    w = ORTWrap(m, fallback=False)
    x = torch.randn(4, 3)
    w(x).sum().backward()
    ref(x).sum().backward()
    assert_close(m.l.weight.grad, ref.l.weight.grad, "gradient through the custom backward")
    if ON_ENGINE:  # (no PythonOp there: its backward was traced, and the gradient above is the check)
        return
    ops = {n.op_type for n in w.last_artifacts.graph.model().graph.node}
    assert {"PythonOp", "PythonOpGrad"} <= ops


def test_double_backward_and_second_backward_raise_clearly():
    m = mlp()
    w = ORTWrap(m, fallback=False)
    x = torch.randn(3, 8, requires_grad=True)
    y = w(x).sum()
    if ON_ENGINE:
        # AOTAutograd's rules there: create_graph gives the first-order gradient, whose own backward
        # raises; a retained graph's second backward runs, accumulating eager's gradient twice.
        ref = copy.deepcopy(m)
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        assert_close(g.detach(), torch.autograd.grad(ref(x).sum(), x)[0], "first-order gradient")
        with pytest.raises(RuntimeError, match="double backward"):
            g.sum().backward()
        m.zero_grad(), ref.zero_grad()
        y, expected = w(x).sum(), ref(x).sum()
        for _ in range(2):
            y.backward(retain_graph=True), expected.backward(retain_graph=True)
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, f"{name}.grad after two backwards of one graph")
        return
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y, x, create_graph=True)
    y = w(x).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True is not supported"):
        y.backward()
    w(x).sum().backward()  # still works


def test_outputs_keep_their_values_after_backward():
    # ORT's memory planner must not hand the buffers of yielded outputs to backward values.
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * x, torch.tanh(x)

    w = ORTWrap(M(), fallback=False)
    x = torch.randn(3, 5, 4, requires_grad=True)
    y, t = w(x)
    saved = y.detach().clone(), t.detach().clone()
    (y * torch.randn_like(y)).sum().backward(retain_graph=False)
    assert torch.equal(y.detach(), saved[0]) and torch.equal(t.detach(), saved[1])


class SqueezeMask(nn.Module):
    """masked_fill on an unsqueezed activation, then squeeze(1): the exporter writes the squeeze of a
    dynamic dimension as an If node, on which ORT's gradient builder aborts the process."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, mask):
        return self.l(x).unsqueeze(1).masked_fill(mask, -1e4).squeeze(1)


def test_squeeze_of_a_non_batch_dimension_trains_with_static_dims():
    from parity import check_parity

    def inputs(b, g):
        t = seq_len(b, 4)  # the length changes: each one gets its own static-shape program
        mask = torch.zeros(b, 1, t, 4, dtype=torch.bool)
        mask[..., -1] = True
        return (torch.randn(b, t, 4, generator=g), mask), {}

    w = check_parity(SqueezeMask, inputs)
    if ON_ENGINE:  # (static_reasons and pre_grad are the training engine's artifacts; the numbers above)
        return
    assert any("If node" in r for r in w.last_artifacts.static_reasons)
    assert "If" not in {n.op_type for n in w.last_artifacts.pre_grad.graph.node}


def test_control_flow_on_the_batch_dimension_falls_back_instead_of_crashing():
    class SqueezeBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return self.l(x).squeeze(0)

    m = SqueezeBatch()
    # TorchScript writes squeeze of a dynamic dim as an If node, which ORT cannot differentiate.
    w = ORTWrap(m, exporter="torchscript")
    x = torch.randn(1, 3, 4)
    if ON_ENGINE:  # (exporter= does not apply there: AOTAutograd's graph has no If node, and trains)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            assert_close(w(x).detach(), m(x).detach(), "output")
        assert w.fallback_reason is None
    else:
        with pytest.warns(FallbackWarning, match=r"passes phase failed.*If.*control flow"):
            y = w(x)
        assert_close(y, m(x), "fallback output")
    # The dynamo capture specializes the batch of 1 instead (a shape guard): no If, ORT trains it,
    # and a batch of 3 gets its own program.
    for order in ((1, 3), (3, 1)):
        # In the other order, the capture for batch 3 assumed batch >= 2 (squeeze(0) a no-op):
        # batch 1 breaks that guard and gets a capture of its own, which squeezes.
        w = ORTWrap(m, fallback=False)
        for b in order:
            x = torch.randn(b, 3, 4)
            assert_close(w(x).detach(), m(x).detach(), f"batch {b}")
        assert w.fallback_reason is None
        if not ON_ENGINE:  # (the exporter and programs() are the training engine's)
            assert w.last_artifacts.exporter == "dynamo" and len(w.programs()) == 2


def test_module_hooks_still_run():
    """ORTWrap.__call__ skips nn.Module's hook dispatch only when no hook is registered."""
    torch.manual_seed(0)
    w = ORTWrap(nn.Linear(3, 2), fallback=False)
    x = torch.randn(4, 3)
    plain = w(x).detach()
    seen = []
    pre = w.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    post = w.register_forward_hook(lambda mod, args, out: out + 1)
    torch.testing.assert_close(w(x), w.module(x * 2) + 1)
    pre.remove()
    post.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: seen.append(mod))
    try:
        torch.testing.assert_close(w(x), plain)
    finally:
        handle.remove()
    assert any(m is w for m in seen)
    torch.testing.assert_close(w(x), plain)  # and the fast path again


_freeze_counts: list[int] = []


class _FreezeProbe(nn.Module):
    """An MLP that records the collector's freeze count each time its forward runs (the capture runs it)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = mlp()

    def forward(self, x):
        _freeze_counts.append(gc.get_freeze_count())
        return self.mlp(x)


class _Cycle:
    pass


def test_a_build_leaves_the_garbage_collector_as_it_found_it():
    """During a build the collector skips the objects that existed before it (program._build_gc):
    afterwards thresholds and freeze count are back, and garbage older than the build is collected."""
    x = torch.randn(4, 8)
    old = _Cycle()
    old.self = old
    older_garbage = weakref.ref(old)
    del old
    thresholds = gc.get_threshold()
    probe = _FreezeProbe()
    w = ORTWrap(probe, fallback=False, build_cache=False)
    _freeze_counts.clear()
    out = w(x)
    if not ON_ENGINE:  # (the training engine's build freezes older objects: program._build_gc; not AOTAutograd's)
        assert _freeze_counts and all(n > 0 for n in _freeze_counts)  # the capture ran with older objects frozen
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0
    assert_close(out.detach(), probe.mlp(x).detach(), "output")
    gc.collect()
    assert older_garbage() is None
    # A freeze of the user's own is left alone: not undone by the build.
    gc.freeze()
    try:
        ORTWrap(_FreezeProbe(), fallback=False, build_cache=False)(x)
        assert gc.get_freeze_count() > 0 and gc.get_threshold() == thresholds  # (frozen objects that died left it)
    finally:
        gc.unfreeze()


class TwoHeads(nn.Module):
    """A trunk and two heads: a loss on one head does not reach the other head's parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.ones(()))  # reaches output b only through argmax: no gradient

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        pick = (h * self.scale).argmax(-1, keepdim=True).float()
        return self.a(h), self.b(h) + pick


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_parameters_the_loss_does_not_reach_keep_grad_none(exporter):
    # Eager leaves .grad None on a parameter the loss does not reach, and AdamW then skips it (no
    # weight decay, no moment update); a zero gradient would move it.
    torch.manual_seed(0)
    eager = TwoHeads()
    wrapped = ORTWrap(copy.deepcopy(eager), fallback=False, exporter=exporter)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5) for m in (eager, wrapped)]
    for step, head in enumerate([0, 0, 1, 0, 1, 1]):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        for model, opt in zip((eager, wrapped), opts):
            opt.zero_grad(set_to_none=True)
            model(x)[head].pow(2).sum().backward()
        for (name, p), q in zip(eager.named_parameters(), wrapped.parameters()):
            assert (q.grad is None) == (p.grad is None), f"step {step}, {name}: grad {q.grad} vs eager {p.grad}"
            if p.grad is not None:
                assert_close(q.grad, p.grad, f"step {step}, {name}.grad")
        for opt in opts:
            opt.step()
        for (name, p), q in zip(eager.named_parameters(), wrapped.parameters()):
            assert_close(q.detach(), p.detach(), f"step {step}, {name}")
    assert eager.scale.grad is None and wrapped.fallback_reason is None
