"""Ops the OpInfo sweep (issue 24) found silently wrong or crashing, each against eager PyTorch:
outputs and every input gradient, under both exporters.

- ``std`` of a full reduction: ORT's ``Sqrt`` gradient of a 0-d value is [1]-shaped, and the
  ``ReduceMean`` gradient below it broadcast it wrongly (``grad/builder.py`` reshapes 0-d gradients);
- a computed ``Pow`` exponent (``x ** y``, ``exp2``, ``logaddexp2``, ``float_power``): ORT gave it no
  gradient (``ops.GRADIENTS["Pow"]``);
- ``scatter_reduce`` (every reduction), ``index_add``, ``_safe_softmax`` (dynamo: ATen nodes),
  ``index_put(accumulate=True)`` (``ScatterND(add)``: PyTorch's gradient);
- ``max_pool3d(return_indices=True)`` on an unbatched input (dynamo: SIGSEGV in ORT's MaxPoolGrad)
  and ``cross_entropy`` of one unbatched sample (SIGABRT in ORT's forward, both exporters): each runs
  in a child process, so a crash fails the test instead of ending the run;
- complex outputs come back complex under dynamo (they came back as real ``[..., 2]`` tensors, then
  were refused); TorchScript refuses them, naming the op.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from parity import assert_close

from ortwrap import ORTWrap
from ortwrap.errors import ORTWrapError

pytestmark = pytest.mark.usefixtures("exporter")


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def check(fn, inputs, exporter, *, atol=1e-5, rtol=1e-4):
    """``fn`` through ORTWrap (fallback off, no build cache) against eager: outputs and the gradients
    of every input that requires grad, for a loss with a different weight per element."""

    def run(module):
        xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
        out = module(*xs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        g = torch.Generator().manual_seed(0)
        loss = sum((o * (torch.rand(o.shape, generator=g) + 0.5)).sum() for o in outs if o.is_floating_point())
        loss.backward()
        return [o.detach() for o in outs], [x.grad for x in xs if x.requires_grad]

    got_out, got_grad = run(ORTWrap(Fn(fn), fallback=False, exporter=exporter, build_cache=False))
    want_out, want_grad = run(Fn(fn))
    for i, (a, b) in enumerate(zip(got_out, want_out)):
        assert_close(a, b, f"output {i}", atol=atol, rtol=rtol)
    for i, (a, b) in enumerate(zip(got_grad, want_grad)):
        assert a is not None, f"input {i}: no gradient (eager has one)"
        assert_close(a, b, f"gradient of input {i}", atol=atol, rtol=rtol)


def check_in_child(case: str, exporter: str) -> None:
    """Run ``case`` (a function of this module taking the exporter) in a fresh Python process: ORT
    aborting or crashing fails the test with the signal instead of ending the run. (Not a fork: the
    forked child of a process whose OpenMP pool has run can hang.)"""
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_op_fixes as t; t.{case}({exporter!r})"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, (
        f"{case} ({exporter}) exited with {r.returncode} (negative: the signal):\n{r.stderr[-3000:]}"
    )


def randn(*shape, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed + len(shape))
    return torch.randn(*shape, generator=g).requires_grad_(grad)


@pytest.mark.parametrize("unbiased", [True, False])
def test_std_full_reduction(exporter, unbiased):
    check(lambda x: torch.std(x, unbiased=unbiased), [randn(5, 5, 5)], exporter)
    check(lambda x: torch.std_mean(x, dim=(0, 1, 2), unbiased=unbiased)[0], [randn(4, 3, 5)], exporter)


def test_sqrt_of_zero_d_value(exporter):
    check(lambda x: torch.sqrt((x * x).mean()) * x.sum(), [randn(3, 4)], exporter)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, y: x.abs() ** y,
        lambda x, y: torch.exp2(x) * y,
        lambda x, y: torch.logaddexp2(x, y),
        lambda x, y: torch.float_power(x.abs() + 0.5, y).float(),
    ],
    ids=["pow", "exp2", "logaddexp2", "float_power"],
)
def test_pow_exponent_gradient(exporter, fn):
    check(fn, [randn(4, 5), randn(4, 5, seed=1)], exporter)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(exporter, reduce, include_self):
    if exporter == "torchscript":
        pytest.skip("TorchScript's scatter_reduce is refused (an If node / an ATen node without overload)")
    index = torch.tensor([[0, 1, 0, 2], [2, 2, 1, 0], [1, 0, 0, 1]])
    check(
        lambda x, src: x.scatter_reduce(1, index, src, reduce, include_self=include_self),
        [randn(3, 5), randn(3, 4, seed=2)],
        exporter,
    )


def test_index_add(exporter):
    if exporter == "torchscript":
        pytest.skip("TorchScript's index_add is refused at the gradient build")
    index = torch.tensor([0, 2, 0, 4])
    check(lambda x, src: x.index_add(0, index, src, alpha=2.0), [randn(5, 3), randn(4, 3, seed=3)], exporter)


def test_index_put_accumulate(exporter):
    rows, cols = torch.tensor([0, 2, 0, 1]), torch.tensor([1, 1, 1, 3])  # (0, 1) twice: eager sums both

    def fn(x, v):
        return x.index_put((rows, cols), v, accumulate=True)

    if exporter == "torchscript":
        # torch's symbolic keeps one update of a repeated index (silently wrong); its ATen node cannot take
        # the index list (ORT has no sequence inputs for ATen ops): refused at build, never trained wrong
        wrapped = ORTWrap(Fn(fn), exporter=exporter, fallback=False)
        with pytest.raises(ORTWrapError, match="ATen"):
            wrapped(torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True))
        return
    check(fn, [randn(3, 4), randn(4, seed=4)], exporter)


def test_safe_softmax_all_masked_row(exporter):
    if exporter == "torchscript":
        pytest.skip("aten._safe_softmax is what torch's SDPA decomposes to under torch.export (dynamo)")
    x = randn(3, 3).detach()
    x[1] = float("-inf")  # a row that is all -inf: eager's output and gradient there are 0
    x[0, 2] = float("-inf")
    check(lambda x: torch.ops.aten._safe_softmax(x, -1), [x.requires_grad_()], exporter)


def max_pool_indices_unbatched(exporter):
    if exporter == "torchscript":  # (refused there: torch's symbolic; a refusal is no crash)
        with pytest.raises(ORTWrapError):
            check(lambda x: F.max_pool3d(x, 1, return_indices=True)[0], [randn(4, 4, 3, 5)], exporter)
        return
    check(lambda x: F.max_pool3d(x, 1, return_indices=True)[0], [randn(4, 4, 3, 5)], exporter)
    check(lambda x: F.adaptive_max_pool3d(x, (None, None, None), return_indices=True)[0], [randn(4, 4, 3, 5)], exporter)


def test_max_pool_indices_unbatched(exporter):
    check_in_child("max_pool_indices_unbatched", exporter)


def cross_entropy_unbatched(exporter):
    target = torch.tensor(2)
    for reduction in ("mean", "none", "sum"):
        check(
            lambda x, w: F.cross_entropy(F.linear(x, w), target, reduction=reduction),  # noqa: B023
            [randn(3), randn(4, 3)],
            exporter,
        )
        check(
            lambda x, w: F.nll_loss(F.log_softmax(F.linear(x, w), -1), target, reduction=reduction),  # noqa: B023
            [randn(3), randn(4, 3)],
            exporter,
        )


def test_cross_entropy_unbatched(exporter):
    check_in_child("cross_entropy_unbatched", exporter)


def test_native_batch_norm_saved_statistics(exporter):
    """The saved mean and inverse std of ``native_batch_norm`` (dynamo: they were the running ones,
    and the output was normalized with the wrong statistics)."""

    def fn(x, w, b, mean, var):
        y, saved_mean, saved_invstd = torch.native_batch_norm(x, w, b, mean, var, True, 0.5, 0.6)
        return y, saved_mean, saved_invstd

    check(fn, [randn(5, 4, 3), randn(4), randn(4, seed=7), randn(4, grad=False), randn(4, grad=False).abs()], exporter)


@pytest.mark.parametrize(
    "fn, torchscript_refuses",
    [
        (lambda x, y: torch.complex(x, y), False),
        (lambda x, y: torch.polar(x.abs(), y), False),
        (lambda x, y: torch.view_as_complex(torch.stack([x * y, x - y], -1)), False),
        (lambda x, y: (x * y).to(torch.complex64) + torch.complex(y, x), True),
    ],
    ids=["complex", "polar", "view_as_complex", "to_complex"],
)
def test_complex_output(exporter, fn, torchscript_refuses):
    """A complex output comes back complex (the graph's real ``[..., 2]`` output viewed as complex, its
    gradient through autograd). Under TorchScript complex values travel as real pairs between ATen
    nodes; one an ONNX op makes (a Cast to complex64) is refused, naming the op (it was a
    ``KeyError: 14`` from the type inference)."""
    inputs = [randn(3, 4), randn(3, 4, seed=5)]
    if exporter == "torchscript" and torchscript_refuses:
        m = ORTWrap(Fn(fn), fallback=False, exporter=exporter, build_cache=False)
        with pytest.raises(ORTWrapError, match=r"ATen op add takes .*complex64 value an ONNX op makes"):
            m(*inputs)
        return

    def run(module):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        out = module(*xs)
        parts = torch.view_as_real(out)
        (parts * (torch.rand(parts.shape, generator=torch.Generator().manual_seed(0)) + 0.5)).sum().backward()
        return out.detach(), [x.grad for x in xs]

    (got, got_grads), (want, want_grads) = (
        run(ORTWrap(Fn(fn), fallback=False, exporter=exporter, build_cache=False)),
        run(Fn(fn)),
    )
    assert got.dtype == want.dtype == torch.complex64 and got.shape == want.shape
    assert_close(got, want, "output")
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        assert a is not None, f"input {i}: no gradient (eager has one)"
        assert_close(a, b, f"gradient of input {i}")


class _ComplexRope(torch.nn.Module):
    """DeepSeek-V2's rotary embedding (transformers' ``DeepseekV2RotaryEmbedding`` and
    ``apply_rotary_emb``): complex frequencies from ``torch.polar``, moved with ``.to(device)``,
    multiplied into the query viewed as complex."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / (10.0 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8)))

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs).unsqueeze(1).to(x.device)
        q = self.proj(x)
        q_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        return torch.view_as_real(q_ * freqs_cis).flatten(3)


def test_complex_rope_moved_to_its_device(exporter):
    """DeepSeek-V2's complex RoPE trains under dynamo (outputs and gradients as eager's). Under
    TorchScript the ``.to(device)`` of the complex frequencies is an ATen ``to`` without an overload
    name (it has seven): refused naming the op, the complex value, the overloads and the remedy (it
    was "ATen node 'to' names no overload" from the gradient registration, no word of complex values)."""
    torch.manual_seed(0)
    rope = _ComplexRope()
    x = randn(2, 1, 5, 8)
    position_ids = torch.arange(5).expand(2, 5)
    m = ORTWrap(copy.deepcopy(rope), fallback=False, exporter=exporter, build_cache=False)
    if exporter == "torchscript":
        with pytest.raises(ORTWrapError, match=r"ATen op to takes .*a complex value, without the overload name .*"
                           r"several: .*dtype.*use exporter='dynamo'"):  # fmt: skip
            m(x, position_ids)
        return

    def run(module):
        xs = x.detach().clone().requires_grad_()
        out = module(xs, position_ids)
        (out * (torch.rand(out.shape, generator=torch.Generator().manual_seed(0)) + 0.5)).sum().backward()
        return out.detach(), xs.grad, [p.grad for p in module.parameters()]

    got, got_dx, got_dw = run(m)
    want, want_dx, want_dw = run(rope)
    assert_close(got, want, "output")
    assert_close(got_dx, want_dx, "gradient of x")
    for a, b in zip(got_dw, want_dw):
        assert_close(a, b, "gradient of a parameter")


def test_log_sigmoid_large_logits(exporter):
    """``Log(Sigmoid(x))`` underflowed: -inf from x = -17 on (eager: x), also inside
    ``binary_cross_entropy_with_logits``."""
    x = (torch.linspace(-40, 40, 17) + 0.3).requires_grad_()
    check(lambda x: F.logsigmoid(x), [x], exporter)
    target = torch.tensor([0.0, 1.0] * 8 + [1.0])
    check(lambda x: F.binary_cross_entropy_with_logits(x, target, reduction="none"), [x], exporter)


def test_module_returning_its_input(exporter):
    """A graph without nodes (``contiguous``/``positive`` of the input) imported no opset under
    dynamo, and the Identity that copies the output failed type inference."""
    check(lambda x: x.contiguous(), [randn(3, 4)], exporter)
    check(lambda x: torch.positive(x), [randn(5)], exporter)


# --- session 24: the OpInfo groups (refused before; each must now train with eager's numbers) ---


@pytest.mark.parametrize(
    "fn",
    [
        torch.linalg.svdvals,  # _linalg_svd: only S is used, U and Vh get no gradient
        lambda x: torch.linalg.eigvalsh(x @ x.mT),  # _linalg_eigh: eigenvectors unused
        lambda x: torch.linalg.lu(x)[1],  # linalg_lu: P and U unused
    ],
    ids=["svdvals", "eigvalsh", "lu_L"],
)
def test_vjp_of_partly_used_outputs(exporter, fn):
    """An ATen node whose outputs are partly used: ORT's gradient graph has no gradient for the unused
    ones, which the vjp node read (the session refused: "Node input ..._grad is not a graph input")."""
    check(fn, [randn(4, 4)], exporter, atol=1e-4)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.amax(x.sum()),  # torchlib's amax requires dim (0-d input, dim=[])
        lambda x: torch.cumprod(x, 0),  # decomposed into prims.prod, which torchlib cannot translate
        lambda x: torch.special.i0e(x),  # prims.bessel_i0e
        lambda x: torch.fft.fftshift(x),  # roll with symbolic shifts (size // 2)
        lambda x: torch.diff(x, n=0, dim=0),  # ortwrap's diff translation: n=1 only
    ],
    ids=["amax_0d", "cumprod", "i0e", "fftshift", "diff_n0"],
)
def test_failed_translation_runs_as_aten_node(exporter, fn):
    check(fn, [randn(3, 4)], exporter)


@pytest.mark.parametrize(
    "fn",
    [
        torch.linalg.inv,
        lambda x: torch.linalg.solve(x, x.sum(-1)),
        lambda x: torch.linalg.cholesky(x @ x.mT + 4 * torch.eye(4)),
    ],
    ids=["inv", "solve", "cholesky"],
)
def test_linalg_error_checks(exporter, fn):
    """dynamo: torch.export wraps ``_linalg_check_errors`` in ``with_effects``, which the exporter
    could not translate; ortwrap drops the check (and its effect tokens)."""
    x = (torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) + 4 * torch.eye(4)).requires_grad_()
    check(fn, [x], exporter, atol=1e-4)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.split(x, 2),  # SplitToSequence(split=2) read at constant indices
        lambda x: torch.unbind(x, 1),  # SplitToSequence(keepdims=0)
        lambda x: torch.hstack([x, 2 * x]),  # atleast_1d of a list (dynamo: SequenceMap with an If)
        lambda x: torch.dstack([x[0], 2 * x[1]]),  # atleast_3d of 1-D tensors: (1, n, 1)
        lambda x: torch.column_stack([x[:, 0], 2 * x]),  # 1-D and 2-D: columns
    ],
    ids=["split", "unbind", "hstack", "dstack", "column_stack"],
)
def test_static_sequences(exporter, fn):
    """Sequences whose elements are known where they are read train as Slice/Concat (passes/sequence_ops.py);
    TorchScript's hstack/dstack/column_stack are concatenated by rank (symbolics.py)."""
    check(fn, [randn(5, 3)], exporter)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, lo: torch.clamp_min(x, lo),
        lambda x, hi: torch.clamp_max(x, hi),
        lambda x, lo: torch.clamp(x, lo, 2 * lo),
    ],
    ids=["clamp_min", "clamp_max", "clamp"],
)
def test_clip_tensor_bound_gradient(exporter, fn):
    """``Clip`` with a bound that needs a gradient: ORT's gradient has none for it (the build failed:
    "failed to find NodeArg by name: ..._grad"); the general rule runs it as ``clip.Tensor``."""
    check(fn, [randn(4, 5), randn(5, seed=1)], exporter)


@pytest.mark.parametrize(
    "fn",
    [lambda x: x.mT, lambda x: torch.einsum("...ij,...jk->...ik", x, x.mT), lambda x: torch.einsum("...ij", x)],
    ids=["mT", "batched_matmul", "implicit_output"],
)
def test_einsum_ellipsis(exporter, fn):
    """Einsum with ``...`` (dynamo writes ``mT`` as one): spelled out from the input ranks."""
    check(fn, [randn(2, 3, 4, 5)], exporter)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.permute(0, -2, -1, 1),
        lambda x: torch.movedim(x, (-1, 0), (0, -2)),
        lambda x: x[0, 0, 0, 0].sum(0) + x[0, 0, 0, 1].mean(-1) + torch.logsumexp(x[0, 0, 1, 1], 0),
    ],
    ids=["permute", "movedim", "reduce_0d"],
)
def test_negative_dims_and_0d_reductions(exporter, fn):
    """TorchScript wrote negative dims into Transpose's perm and a Reduce axis on a 0-d input (refused)."""
    check(fn, [randn(2, 3, 4, 5)], exporter)


@pytest.mark.parametrize(
    "fn",
    [lambda x: torch.quantile(x, 0.3, dim=1), lambda x: torch.linalg.pinv(x)],
    ids=["quantile_scalar_q", "pinv"],
)
def test_aten_node_overload_from_arguments(exporter, fn):
    """TorchScript's ATen fallback nodes without an overload: a traced number picks ``quantile.scalar``
    (``quantile``'s float64 ``q`` tensor failed), ``linalg_pinv`` without atol/rtol its keyword form."""
    check(fn, [randn(4, 5)], exporter, atol=1e-4)


def test_if_on_static_rank_folded(exporter):
    """TorchScript writes ``scatter_reduce`` of 0-d tensors behind ``If(Size(Shape(x)) == 0)``; the
    rank is known, so the If is replaced by its branch (passes/control_flow.py) instead of refused."""
    index = torch.tensor(0)
    check(
        lambda x, s: torch.scatter_reduce(x, 0, index, s, "sum"),
        [torch.tensor(0.7, requires_grad=True), torch.tensor(-1.3, requires_grad=True)],
        exporter,
    )
