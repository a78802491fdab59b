"""ortwrap's group_norm and instance_norm CPU kernels (nn.GroupNorm and nn.InstanceNorm*d, which both exporters
write as InstanceNormalization; an affine GroupNorm, and the SiLU after it, as one group_norm node): parity with
eager through both exporters (affine and not, 1, 2 and C groups, 3-D and 4-D inputs, sizes that do not divide the
thread chunks), the graph holds the kernel nodes and not the decomposition, the kernels against PyTorch's in a
real ORT session, and the decomposition where the kernel does not apply (float64, native_kernels=False)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_text
import pytest
import torch
from parity import check_parity
from test_native_kernels import F32, aten_session, native_ops, run_pass, run_raising
from torch import nn

from ortwrap.passes.native_cpu_kernels import NativeCPUKernelsPass

DECOMPOSED = ("InstanceNormalization", "ReduceMean", "Sqrt")


class NormNet(nn.Module):
    """Conv -> norm -> SiLU -> conv, so the norm's input and output gradients both matter; the input's
    mean and scale are far from 0 and 1 (a wrong centering or variance gives other numbers)."""

    def __init__(self, make_norm, channels: int, dims: int) -> None:
        super().__init__()
        conv = nn.Conv1d if dims == 1 else nn.Conv2d
        self.norm = make_norm()
        # a norm per channel makes the loss independent of inp's bias (its gradient: rounding noise)
        per_channel = getattr(self.norm, "num_groups", channels) == channels
        self.inp = conv(3, channels, 3, padding=1, bias=not per_channel)
        self.out = conv(channels, 2, 1)

    def forward(self, x):
        return self.out(nn.functional.silu(self.norm(self.inp(x) * 3 + 5)))


def _with_affine_values(norm: nn.Module) -> nn.Module:
    if getattr(norm, "weight", None) is not None:
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 2.0, norm.weight.numel()))
            norm.bias.copy_(torch.linspace(-1.0, 1.0, norm.bias.numel()))
    return norm


CASES = {
    # name: (norm, channels, dims, spatial size); the affine GroupNorms (and their SiLU) become group_norm
    "gn2_affine_2d": (lambda: nn.GroupNorm(2, 6), 6, 2, (7, 5)),
    "gn1_affine_2d": (lambda: nn.GroupNorm(1, 6), 6, 2, (9, 11)),
    "gnC_affine_2d": (lambda: nn.GroupNorm(6, 6), 6, 2, (5, 3)),
    "gn2_no_affine_2d": (lambda: nn.GroupNorm(2, 6, affine=False), 6, 2, (7, 5)),
    "gn3_affine_1d": (lambda: nn.GroupNorm(3, 6), 6, 1, (37,)),
    "gn1_no_affine_1d": (lambda: nn.GroupNorm(1, 4, affine=False), 4, 1, (13,)),
    "gn2_large_2d": (lambda: nn.GroupNorm(2, 4, eps=1e-3), 4, 2, (67, 71)),  # several chunks per row set
    "in_affine_2d": (lambda: nn.InstanceNorm2d(4, affine=True), 4, 2, (6, 7)),
    "in_1d": (lambda: nn.InstanceNorm1d(4), 4, 1, (19,)),
}
GROUP_NORM_KERNEL = {"gn2_affine_2d", "gn1_affine_2d", "gnC_affine_2d", "gn3_affine_1d", "gn2_large_2d"}


@pytest.mark.usefixtures("exporter")
@pytest.mark.parametrize("name", list(CASES))
def test_group_norm_parity_on_the_kernel(name):
    make_norm, channels, dims, size = CASES[name]

    def model():
        return NormNet(lambda: _with_affine_values(make_norm()), channels, dims)

    def inputs(b, g):
        return (torch.randn(b, 3, *size, generator=g).requires_grad_(),), {}

    wrapped = check_parity(model, inputs, batch_sizes=(4, 3, 1), lr=0.01)
    ops = native_ops(wrapped.last_artifacts.graph.model())
    kernel, other = ("group_norm", "instance_norm") if name in GROUP_NORM_KERNEL else ("instance_norm", "group_norm")
    assert ops[kernel] == 1 and ops[f"{kernel}_backward"] == 1 and ops[other] == 0, ops
    for slow in DECOMPOSED:
        assert ops[slow] == 0, ops
    if name in GROUP_NORM_KERNEL:  # the affine and the SiLU are in the kernel too
        assert ops["Sigmoid"] == 0 and ops["InstanceNormalization"] == 0, ops


class GroupNormTails(nn.Module):
    """GroupNorms the group_norm rewrite must take apart correctly: a SiLU written as ``sigmoid(z) * z``
    (the other operand order), a GroupNorm whose output a residual also reads (its SiLU stays outside the
    kernel), and one with no activation after it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, 8, 3, padding=1)
        self.n1, self.n2, self.n3 = (_with_affine_values(nn.GroupNorm(g, 8)) for g in (2, 4, 1))
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        h = self.inp(x) * 2 + 3
        z = self.n1(h)
        h = torch.sigmoid(z) * z
        z = self.n2(h)
        h = z + nn.functional.silu(z)  # z is read twice: no SiLU in the kernel
        return self.out(self.n3(h))


@pytest.mark.usefixtures("exporter")
def test_group_norm_rewrite_takes_the_silu_only_where_it_alone_reads_the_norm():
    def inputs(b, g):
        return (torch.randn(b, 3, 6, 5, generator=g).requires_grad_(),), {}

    wrapped = check_parity(GroupNormTails, inputs, batch_sizes=(2, 3), lr=0.01)
    model = wrapped.last_artifacts.graph.model()
    ops = native_ops(model)
    assert ops["group_norm"] == 3 and ops["group_norm_backward"] == 3 and ops["instance_norm"] == 0, ops
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    consts.update(
        {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node if n.op_type == "Constant"}
    )
    forward = [
        n
        for n in model.graph.node
        if n.op_type == "ATen"
        and any(a.name == "operator" and a.s == b"ortwrap_cpu::group_norm" for a in n.attribute)
        and "recompute" not in n.name
    ]
    # (groups, silu) per norm, in graph order: n1 with its SiLU, n2 without (z is read twice), n3 without
    assert [(int(consts[n.input[4]]), int(consts[n.input[5]])) for n in forward] == [(2, 1), (4, 0), (1, 0)]


@pytest.mark.usefixtures("exporter")
def test_group_norm_decomposed_without_native_kernels():
    make_norm, channels, dims, size = CASES["gn2_affine_2d"]

    def inputs(b, g):
        return (torch.randn(b, 3, *size, generator=g).requires_grad_(),), {}

    wrapped = check_parity(
        lambda: NormNet(lambda: _with_affine_values(make_norm()), channels, dims),
        inputs,
        batch_sizes=(4, 3),
        wrap_options={"native_kernels": False},
    )
    ops = native_ops(wrapped.last_artifacts.graph.model())
    assert ops["instance_norm"] == 0 and ops["ReduceMean"] >= 2, ops


# (3, 7, 5000): 21 rows in 6 chunks (uneven); (1, 1, 100_003): one long row
@pytest.mark.parametrize("shape", [(4, 2, 1000), (3, 5, 7, 9), (3, 7, 5000), (1, 1, 100_003), (2, 3, 1)], ids=str)
def test_instance_norm_kernels_match_pytorch(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 40 + 300  # large mean and variance
    c = shape[1]
    s, b = torch.randn(c, generator=g), torch.randn(c, generator=g)
    dy = torch.randn(shape, generator=g)
    dims = [f"d{i}" for i in range(len(shape))]
    fwd = aten_session(
        "instance_norm",
        [("x", F32, dims), ("s", F32, [c]), ("b", F32, [c])],
        [("y", F32, dims)],
        consts=[("eps", np.array(1e-5, dtype=np.float32))],
    )
    (y,) = fwd.run(None, {"x": x.numpy(), "s": s.numpy(), "b": b.numpy()})
    n, hw = shape[0], int(np.prod(shape[2:]))
    # PyTorch's kernels in float64: the reference (its float32 ones are further off, e.g. y of a 1-element row)
    ref, ref_mean, ref_rstd = torch.ops.aten.native_group_norm(x.double(), s.double(), b.double(), n, c, hw, c, 1e-5)
    torch.testing.assert_close(torch.from_numpy(y).double(), ref, atol=1e-4, rtol=1e-4)
    bwd = aten_session(
        "instance_norm_backward",
        [("dy", F32, dims), ("x", F32, dims), ("s", F32, [c])],
        [("dx", F32, dims), ("ds", F32, [c]), ("db", F32, [c])],
        consts=[("eps", np.array(1e-5, dtype=np.float32))],
    )
    dx, ds, db = bwd.run(None, {"dy": dy.numpy(), "x": x.numpy(), "s": s.numpy()})
    rdx, rds, rdb = torch.ops.aten.native_group_norm_backward(
        dy.double(), x.double(), ref_mean, ref_rstd, s.double(), n, c, hw, c, [True, True, True]
    )
    torch.testing.assert_close(torch.from_numpy(dx).double(), rdx, atol=1e-5, rtol=1e-3)
    torch.testing.assert_close(torch.from_numpy(ds).double(), rds, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(torch.from_numpy(db).double(), rdb, atol=1e-3, rtol=1e-5)


# (shape, groups): uneven chunks, one long row, a 1-element group, C groups
@pytest.mark.parametrize(
    "shape,groups",
    [((4, 6, 1000), 2), ((3, 6, 7, 9), 3), ((3, 8, 33, 35), 2), ((1, 2, 100_003), 1), ((2, 4, 1), 4), ((2, 6, 5), 6)],
    ids=str,
)
@pytest.mark.parametrize("silu", [0, 1])
def test_group_norm_kernels_match_pytorch(shape, groups, silu):
    """group_norm and its backward (in ORT sessions) against PyTorch's GroupNorm (+ SiLU) in float64:
    the output and the gradients of x, gamma and beta, on inputs with a large mean and variance."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 40 + 300
    c = shape[1]
    gamma, beta = torch.randn(c, generator=g), torch.randn(c, generator=g)
    dy = torch.randn(shape, generator=g)
    dims = [f"d{i}" for i in range(len(shape))]
    scalars = [
        ("eps", np.array(1e-5, dtype=np.float32)),
        ("groups", np.array(groups, dtype=np.int64)),
        ("silu", np.array(silu, dtype=np.int64)),
    ]
    fwd = aten_session(
        "group_norm", [("x", F32, dims), ("g", F32, [c]), ("b", F32, [c])], [("y", F32, dims)], consts=scalars
    )
    (y,) = fwd.run(None, {"x": x.numpy(), "g": gamma.numpy(), "b": beta.numpy()})
    xd, gd, bd = (t.double().requires_grad_() for t in (x, gamma, beta))
    ref = nn.functional.group_norm(xd, groups, gd, bd, 1e-5)
    if silu:
        ref = nn.functional.silu(ref)
    torch.testing.assert_close(torch.from_numpy(y).double(), ref.detach(), atol=1e-4, rtol=1e-4)
    ref.backward(dy.double())
    bwd = aten_session(
        "group_norm_backward",
        [("dy", F32, dims), ("x", F32, dims), ("g", F32, [c]), ("b", F32, [c])],
        [("dx", F32, dims), ("dg", F32, [c]), ("db", F32, [c])],
        consts=scalars,
    )
    dx, dg, db = bwd.run(None, {"dy": dy.numpy(), "x": x.numpy(), "g": gamma.numpy(), "b": beta.numpy()})
    torch.testing.assert_close(torch.from_numpy(dx).double(), xd.grad, atol=1e-5, rtol=1e-3)
    torch.testing.assert_close(torch.from_numpy(dg).double(), gd.grad, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(torch.from_numpy(db).double(), bd.grad, atol=1e-3, rtol=1e-5)


def test_group_norm_kernel_refuses_bad_arguments():
    """A group count that does not divide the channels, or a gamma of the wrong size: a clear error."""
    scalars = [("eps", np.array(1e-5, dtype=np.float32)), ("groups", np.array(4, dtype=np.int64))]
    fwd = aten_session(
        "group_norm",
        [("x", F32, [2, 6, 5]), ("g", F32, ["c"]), ("b", F32, ["c"])],
        [("y", F32, [2, 6, 5])],
        consts=[*scalars, ("silu", np.array(0, dtype=np.int64))],
    )
    x = np.ones((2, 6, 5), dtype=np.float32)
    with pytest.raises(RuntimeError, match="group_norm: groups=4 must divide x's 6 channels"):
        run_raising(fwd, {"x": x, "g": np.ones(6, np.float32), "b": np.ones(6, np.float32)})
    fwd = aten_session(
        "group_norm",
        [("x", F32, [2, 6, 5]), ("g", F32, ["c"]), ("b", F32, ["c"])],
        [("y", F32, [2, 6, 5])],
        consts=[
            ("eps", np.array(1e-5, dtype=np.float32)),
            ("groups", np.array(3, dtype=np.int64)),
            ("silu", np.array(0, dtype=np.int64)),
        ],
    )
    with pytest.raises(RuntimeError, match="gamma and beta must have the 6 elements"):
        run_raising(fwd, {"x": x, "g": np.ones(5, np.float32), "b": np.ones(5, np.float32)})


def test_pass_instance_norm_conditions():
    body = """
    agraph (float[2, 3, 8] x, float[3] s, float[3] b, double[2, 3, 8] xd, double[3] sd, double[3] bd, float[2, 3, 8] z)
           => (float[2, 3, 8] y1, double[2, 3, 8] y2, float[2, 3, 8] y3) {
        y1 = InstanceNormalization <epsilon = 0.001> (x, s, b)
        y2 = InstanceNormalization (xd, sd, bd)
        y3 = Softmax <axis = -1> (z)
    }
    """
    p, model = run_pass(body)
    assert p.rewritten["instance_norm"] == 1 and p.rewritten["softmax"] == 1, p.rewritten  # not float64
    (node,) = [n for n in model.graph.node if n.op_type == "ATen" and b"instance_norm" in n.attribute[0].s]
    assert node.attribute[0].s == b"ortwrap_cpu::instance_norm" and node.output[0] == "y1"
    eps = next(n for n in model.graph.node if n.output[0] == node.input[3])
    assert np.isclose(onnx.numpy_helper.to_array(eps.attribute[0].t), 1e-3)
    # the pipeline's early run: only InstanceNormalization
    only = NativeCPUKernelsPass(("InstanceNormalization",))
    onnx_text.run_pass(only, body)
    assert only.rewritten["instance_norm"] == 1 and sum(only.rewritten.values()) == 1, only.rewritten
