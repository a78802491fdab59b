"""Gradients ORT 1.19.2 lacks, defined through ortwrap's gradient registry (``ortwrap/ops/mappers.py``).

Each op runs as PyTorch's op inside the graph and is differentiated by PyTorch's autograd. Every
case trains with parameters before and after the op and compares outputs and every gradient with
eager, under both exporters, with a changing batch size.

Runs on whichever engine the environment resolves (``engine="auto"``), as tests/test_models.py: the
training engine in ``.venv``; ``engine="onnxruntime"`` in the engine's venv (``ORT_EXTRA=ort make
test`` runs this file's fast cases), where the gradients come from AOTAutograd and the same numbers
are compared. The exporter does not apply there: its torchscript parametrization is skipped (the
dynamo one runs each case once), and so are the assertions on the training engine's build artifacts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import check_parity, engine_missing, no_exporter
from torch import nn

from ortwrap.engines import resolve

pytestmark = pytest.mark.usefixtures("exporter")

#: The engine ``engine="auto"`` (check_parity's default) trains on in this environment.
ENGINE = resolve("auto")


@pytest.fixture(autouse=True)
def _once_per_engine_case(exporter):
    if ENGINE == "onnxruntime" and exporter == "torchscript":
        pytest.skip(
            "engine='onnxruntime' takes its graphs from AOTAutograd, not an exporter: the dynamo "
            "parametrization runs this case"
        )


def _training_engine(wrapped) -> bool:
    """Whether ``wrapped`` trains on the training engine, whose build artifacts (``last_artifacts``: the
    exported graph with ortwrap's ATen nodes) the structural assertions read; ``engine="onnxruntime"``
    has none (docs/engines.md)."""
    return getattr(wrapped, "_engine", None) is None


class Pre(nn.Module):
    """Linear -> op -> Linear."""

    def __init__(self, op, d: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.op = op
        self.b = nn.Linear(d, 3)

    def forward(self, x):
        return self.b(self.op(self.a(x) * 2))


class Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class ConvThen(nn.Module):
    """Conv -> op -> Conv: parameters on both sides of an op on an image."""

    def __init__(self, op, dims: int = 2, c: int = 4) -> None:
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        self.a = conv(3, c, 3, padding=1)
        self.op = op
        self.b = conv(c, 2, 1)

    def forward(self, x):
        return self.b(self.op(self.a(x)))


def cases(table: dict, fast: set[str]) -> list:
    """The table's names as parameters; all but ``fast`` are marked slow (the suite's time budget)."""
    return [pytest.param(n, id=n, marks=() if n in fast else pytest.mark.slow) for n in table]


def seq(b, g):
    return (torch.randn(b, 5, 8, generator=g),), {}


def img(dims: int, hw: int = 6, c: int = 3):
    return lambda b, g: ((torch.randn(b, c, *([hw] * dims), generator=g),), {})


ACTIVATIONS = {
    "hardswish": nn.Hardswish,
    "hardsigmoid": nn.Hardsigmoid,
    "mish": nn.Mish,
    "elu": lambda: nn.ELU(0.7),
    "selu": nn.SELU,
    "celu": lambda: nn.CELU(0.5),
    "softplus": nn.Softplus,
    "softplus_beta_threshold": lambda: nn.Softplus(beta=2.0, threshold=1.0),
    "prelu": nn.PReLU,
    "softshrink": lambda: nn.Softshrink(0.3),
    "hardshrink": lambda: nn.Hardshrink(0.3),
    "threshold": lambda: nn.Threshold(0.1, 2.0),
    "silu": nn.SiLU,
    "logsigmoid": nn.LogSigmoid,
    "softsign": nn.Softsign,
    "tanhshrink": nn.Tanhshrink,
    "relu6": nn.ReLU6,
}


@pytest.mark.parametrize("name", cases(ACTIVATIONS, {"hardswish", "mish", "softplus_beta_threshold", "threshold"}))
def test_activation(name):
    check_parity(lambda: Pre(ACTIVATIONS[name]()), seq)


class ActivationBranches(nn.Module):
    """PyTorch's activations whose gradient is one declared ATen backward op (``ops.ATEN_GRADIENTS``),
    each on its own slice of one Linear's output (scaled to reach every kink and softplus's threshold),
    concatenated into a second Linear."""

    ACTS = (
        lambda h: F.elu(h, 0.7),
        F.selu,
        lambda h: F.celu(h, 0.5),
        F.softplus,
        lambda h: F.softplus(h, beta=2.0, threshold=1.0),
        F.mish,
        lambda h: F.threshold(h, 0.1, 2.0),
    )

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(d, d * len(self.ACTS))
        self.b = nn.Linear(d * len(self.ACTS), 3)

    def forward(self, x):
        parts = (self.a(x) * 4).chunk(len(self.ACTS), -1)
        return self.b(torch.cat([act(h) for act, h in zip(self.ACTS, parts)], -1))


def test_activations_run_their_declared_backward_ops(exporter):
    """elu/selu/celu, softplus (any beta and threshold), mish and threshold train as ATen nodes whose
    gradient is the one ATen backward op eager's autograd calls (``ortwrap_ops::<op>_backward``), never
    a vjp recomputing them under autograd; outputs and every gradient as eager's."""
    w = check_parity(ActivationBranches, seq, wrap_options={"build_cache": False})
    if not _training_engine(w):
        return  # (the numbers above are the whole test there: AOTAutograd's graphs have no ATen nodes)
    ops = _aten_operators(w.last_artifacts.graph.model())
    assert not [op for op in ops if op.startswith("ortwrap_vjp::")], ops
    assert ops.count("elu") == 3 and ops.count("ortwrap_ops::elu_backward") == 3, ops
    if exporter == "torchscript":  # mish as x * tanh(softplus(x)); threshold as an ATen node
        want = {"softplus": 3, "ortwrap_ops::softplus_backward": 3, "ortwrap_ops::threshold_backward": 1}
    else:  # mish as an ATen node; threshold as Where
        want = {"softplus": 2, "ortwrap_ops::softplus_backward": 2, "ortwrap_ops::mish_backward": 1}
    assert {op: ops.count(op) for op in want} == want, ops


def test_declared_aten_backward_ops_match_autograd():
    """Each declared backward op of ``ops.ATEN_GRADIENTS`` gives autograd's gradient of its forward
    bit for bit, at the kinks (0, the threshold), on both sides of softplus's threshold, for large
    and negative values, in float32 and float64; a [1] gradient of a 0-d input keeps its shape."""
    from ortwrap.ops import define_ops
    from ortwrap.ops.torch_ops import ATEN_GRADIENTS

    define_ops()
    aten, own = torch.ops.aten, torch.ops.ortwrap_ops
    cases = {
        "elu": [(0.7, 1.0, 1.0), (1.6732632423543772, 1.0507009873554805, 1.0), (0.5, 1.0, 2.0), ()],
        "softplus": [(1.0, 20.0), (2.0, 1.0), (1.0, float("inf")), (0.5, 3.0), ()],
        "mish": [()],
        "threshold": [(0.1, 2.0), (0.0, 0.0)],
        "leaky_relu": [(0.01,), (0.3,), ()],
        "gelu": [("none",), ("tanh",)],
    }
    assert set(cases) == set(ATEN_GRADIENTS)
    for dtype in (torch.float32, torch.float64):
        base = torch.cat(
            [torch.linspace(-30, 30, 241), torch.tensor([0.0, -0.0, 0.1, 0.5, 1.0, 1.5, 10.0, 20.0, 40.0, 88.0, -88.0])]
        ).to(dtype)
        g = torch.randn(base.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
        for name, consts in cases.items():
            backward = getattr(own, ATEN_GRADIENTS[name].backward)
            for c in consts:
                x = base.clone().requires_grad_()
                forward = getattr(aten, name)
                y = forward(x, approximate=c[0]) if name == "gelu" else forward(x, *c)
                (want,) = torch.autograd.grad(y, x, g)
                args = [g, x.detach(), *c]
                if name == "gelu":  # (the bridge passes every argument positionally)
                    args = [g, x.detach(), c[0]]
                (got,) = backward(*args, output_mask=[True])
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name}{c} {dtype}")
    x0 = torch.tensor(-0.5)
    (got,) = own.elu_backward(torch.ones(1), x0, 1.0, 1.0, 1.0, [True])
    assert got.shape == x0.shape


@pytest.mark.skipif(
    bool(engine_missing("training")), reason="registers an ATen gradient with the training build's gradient builder"
)
def test_declared_aten_backward_reads_defaults_of_absent_arguments():
    """An ATen node that leaves out trailing arguments (their defaults) gets them as absent inputs
    before its declared gradient is registered, and the backward op, called as ORT calls it, takes the
    forward's defaults for them."""
    import onnx
    from torch.utils.dlpack import from_dlpack, to_dlpack

    from ortwrap.bridge import aten
    from ortwrap.grad.aten import register_gradients

    node = onnx.helper.make_node("ATen", ["x"], ["y"], domain="org.pytorch.aten", operator="elu")
    graph = onnx.helper.make_graph(
        [node],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])],
    )
    model = onnx.helper.make_model(graph)
    register_gradients(model)
    assert list(model.graph.node[0].input) == ["x", "", "", ""]
    x = torch.tensor([-2.0, -0.5, 0.0, 3.0], requires_grad=True)
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    for op, forward, absent in (("elu_backward", F.elu, 3), ("softplus_backward", F.softplus, 2)):
        (want,) = torch.autograd.grad(forward(x), x, g)
        # as ORT calls it: the output gradient, the forward's inputs (absent ones None)
        out = aten._execute(f"ortwrap_ops::{op}", "used=1", (to_dlpack(g), to_dlpack(x.detach()), *[None] * absent), 1)
        assert out is not None
        torch.testing.assert_close(from_dlpack(out[0]), want, rtol=0, atol=0)


@pytest.mark.slow
def test_prelu_per_channel():
    check_parity(lambda: ConvThen(nn.PReLU(4)), img(2))


REDUCTIONS = {
    "amax": lambda x: x.amax(-1, keepdim=True) + x,
    "amin_two_dims": lambda x: x.amin((1, 2)).unsqueeze(1).unsqueeze(2) * x,
    "max_all": lambda x: x.max() + x,
    "min_all": lambda x: x.min() * x,
    "max_dim": lambda x: x.max(1).values.unsqueeze(1) + x,
    "min_dim_indices": lambda x: x + x.min(-1).values.unsqueeze(-1) * x.min(-1).indices.unsqueeze(-1).float(),
}


@pytest.mark.parametrize("name", cases(REDUCTIONS, {"amax", "max_dim"}))
def test_max_min(name):
    check_parity(lambda: Pre(Fn(REDUCTIONS[name])), seq)


@pytest.mark.slow
def test_max_min_ties():
    """Ties (ReLU zeros, repeated values) share the gradient as in eager."""
    check_parity(lambda: Pre(Fn(lambda x: F.relu(x - 3).amax(-1, keepdim=True) + x.round().amin(1, keepdim=True))), seq)


CONV_TRANSPOSE = {
    "1d_groups_dilation": (lambda: nn.ConvTranspose1d(4, 4, 3, stride=2, groups=2, dilation=2), 1, 4),
    "2d_stride_padding_output_padding": (
        lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1),
        2,
        4,
    ),
    # (kernel == stride, no padding: a MatMul, tests/test_conv_transpose_matmul.py)
    "3d_no_bias": (lambda: nn.ConvTranspose3d(4, 4, 3, stride=2, bias=False), 3, 4),
}


@pytest.mark.parametrize("name", cases(CONV_TRANSPOSE, {"2d_stride_padding_output_padding"}))
def test_conv_transpose(name):
    """ConvTranspose runs as ortwrap's op with ``convolution_backward`` as its explicit backward (no vjp)."""
    make, dims, c = CONV_TRANSPOSE[name]
    w = check_parity(lambda: ConvThen(make(), dims=dims, c=c), img(dims, hw=4), wrap_options={"build_cache": False})
    if not _training_engine(w):
        return  # (the numbers above are the whole test there: AOTAutograd's graphs have no ATen nodes)
    ops = _aten_operators(w.last_artifacts.graph.model())
    assert ops.count("ortwrap_ops::conv_transpose_backward") == 1, ops
    assert not [op for op in ops if op.startswith("ortwrap_vjp::")], ops


SAME_PADDING = {
    # TorchScript writes padding="same" as auto_pad=SAME_UPPER: ORT's ConvGrad ignored it (an even
    # kernel's uneven padding gave wrong gradients) and its Conv refused it with a dilation.
    "2d_even_kernel": (lambda: nn.Conv2d(4, 4, 4, padding="same"), 2),
    "2d_dilation": (lambda: nn.Conv2d(4, 4, 3, padding="same", dilation=2), 2),
    "1d_even_kernel_dilation": (lambda: nn.Conv1d(4, 4, 2, padding="same", dilation=3), 1),
    "3d_mixed_kernel": (lambda: nn.Conv3d(4, 4, (2, 3, 4), padding="same"), 3),
}


@pytest.mark.parametrize("name", cases(SAME_PADDING, {"2d_even_kernel", "1d_even_kernel_dilation"}))
def test_conv_same_padding(name, exporter):
    make, dims = SAME_PADDING[name]
    check_parity(lambda: ConvThen(make(), dims=dims), img(dims, hw=5))


class Warp(nn.Module):
    """grid_sample of a conv's map at a grid computed from it (gradients into both)."""

    def __init__(self, **kw) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.kw = kw

    def forward(self, x):
        y = self.c(x)
        grid = torch.tanh(y[:, :2].permute(0, 2, 3, 1)) * 1.2  # some points outside [-1, 1]
        return F.grid_sample(y, grid, **self.kw)


GRID_SAMPLE = {
    "bilinear_zeros": {},
    "nearest_border_align": {"mode": "nearest", "padding_mode": "border", "align_corners": True},
    "bicubic_reflection": {"mode": "bicubic", "padding_mode": "reflection", "align_corners": False},
}


@pytest.mark.parametrize("name", cases(GRID_SAMPLE, {"bilinear_zeros", "bicubic_reflection"}))
def test_grid_sample(name, exporter):
    # ORT 1.19.2 has no GridSample gradient: PyTorch's grid_sampler runs it. A small learning rate:
    # the interpolation has kinks at pixel borders, and a large step moves sample points across them
    # on one side and not the other (differences of rounding, amplified).
    check_parity(lambda: Warp(**GRID_SAMPLE[name]), img(2, hw=5), lr=1e-3)


class FoldBack(nn.Module):
    """F.unfold then F.fold to the map's own size (read at run time): overlapping patches summed."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.c(x)
        patches = F.unfold(y, 2, padding=1, stride=1) * 0.5
        return F.fold(patches, y.shape[-2:], 2, padding=1, stride=1)


def test_fold(exporter):
    # dynamo writes Col2Im, which ORT 1.19.2 cannot differentiate: PyTorch's col2im runs it
    check_parity(FoldBack, img(2, hw=5))


@pytest.mark.slow
def test_diagonal():
    check_parity(
        lambda: Pre(Fn(lambda x: torch.diagonal(x.reshape(x.shape[0], 5, 2, 4), 0, -2, -1).repeat(1, 1, 4))), seq
    )


def _bounded(x):
    return torch.tanh(x) * 0.9


ELEMENTWISE = {
    "floor_ceil_round": lambda x: torch.floor(x) * x + torch.ceil(x) + torch.round(x) * 2,
    "asin_acos": lambda x: torch.asin(_bounded(x)) + torch.acos(_bounded(x)) * 2,
    "atan_tan": lambda x: torch.atan(x) + torch.tan(_bounded(x)),
    "cumsum": lambda x: torch.cumsum(x, 1) + torch.cumsum(x, -1).flip(-1),
    "cummax": lambda x: torch.cummax(x, 1).values,
    "flip_maximum_atan2": lambda x: torch.maximum(x, x.flip(-1)) + torch.atan2(x, x.flip(1)),
    "prod": lambda x: x.prod(-1, keepdim=True) + x,
    # TorchScript's unfold symbolic placed the window axis wrong for a negative dim (wrong forward)
    "unfold_negative_dim": lambda x: x.unfold(-1, 4, 2).sum(-1).repeat(1, 1, 3)[..., :8] * x,
    # dynamo decomposes erfinv into prims.erf_inv, which has no autograd formula (aten.erfinv runs)
    "erfinv": lambda x: torch.erfinv(_bounded(x)),
    # an ATen node under dynamo: its bool mask crossed ORT's DLPack as uint8 (the op refused it)
    "masked_select": lambda x: x.masked_select(x > 0).sum() * x + x.masked_select(x.flip(-1) < 0.5).mean(),
    # zero distances (each row with itself): TorchScript's Sqrt form had NaN gradients there
    "cdist": lambda x: (
        torch.cdist(x, x).sum(-1, keepdim=True) * x + torch.cdist(x, x.flip(1), p=1).mean(-1, keepdim=True)
    ),
    "l1_norm": lambda x: x.norm(p=1, dim=-1, keepdim=True) + x,
    # norm(dim) exports as ReduceL2, whose ORT gradient without keepdims is an invalid graph at opset >= 13
    "l2_norm": lambda x: F.normalize(x, dim=-1) * torch.linalg.vector_norm(x, dim=1).unsqueeze(1),
    "fmod_remainder": lambda x: torch.fmod(x, 0.7) * x + torch.remainder(x, 0.7),
    "reflection_pad": lambda x: F.pad(x, (2, 2), mode="reflect")[..., 1:9] * 2,
    "replication_pad": lambda x: F.pad(x, (2, 1), mode="replicate")[..., 2:10] * 2,
    "pixel_shuffle": lambda x: F.pixel_shuffle(x.reshape(x.shape[0], 8, 5, 1), 2).reshape(x.shape[0], 5, 8) * x,
    "softmax_dtype": lambda x: F.softmax(x.double(), -1, dtype=torch.float32),
    "log_softmax_dtype": lambda x: F.log_softmax(x.double(), 1, dtype=torch.float32),
}


@pytest.mark.parametrize(
    "name",
    cases(
        ELEMENTWISE,
        {
            "flip_maximum_atan2",
            "reflection_pad",
            "softmax_dtype",
            "l2_norm",
            "unfold_negative_dim",
            "erfinv",
            "masked_select",
        },
    ),
)
def test_elementwise(name, exporter):
    check_parity(lambda: Pre(Fn(ELEMENTWISE[name])), seq)


class PaddedPositions(nn.Module):
    """RoBERTa's position ids: a cumsum over the int32 padding mask indexes an embedding; then a
    float cumsum of the same op (ORT keeps one gradient definition per op: the integer one, had it
    been an ATen node, would have left out the float one's output gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(20, 8, padding_idx=1)
        self.positions = nn.Embedding(32, 8, padding_idx=1)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        mask = ids.ne(1).int()
        positions = (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + 1
        return self.head((self.tokens(ids) + self.positions(positions)).cumsum(1))


def test_position_ids_from_integer_cumsum():
    def inputs(b, g):
        ids = torch.randint(2, 20, (b, 6 + b), generator=g)
        ids[1:, -2:] = 1  # padded rows
        return (ids,), {}

    check_parity(PaddedPositions, inputs)


class SkipUp(nn.Module):
    """A U-Net skip: the coarse map is resized to the fine map's size, read at run time."""

    def __init__(self, mode: str, dims: int = 2, **kw) -> None:
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        self.fine = conv(3, 4, 3, padding=1)
        self.coarse = conv(4, 4, 3, stride=2, padding=1)
        self.mode, self.kw = mode, kw

    def forward(self, x):
        h = self.fine(x)
        return h * F.interpolate(self.coarse(h), size=h.shape[2:], mode=self.mode, **self.kw)


RESIZE = {
    "1d_nearest_scale": (lambda: ConvThen(Fn(lambda x: F.interpolate(x, scale_factor=2, mode="nearest")), 1), 1, 6),
    "1d_linear": (lambda: ConvThen(Fn(lambda x: F.interpolate(x, scale_factor=2, mode="linear")), 1), 1, 6),
    "1d_nearest_exact": (
        lambda: ConvThen(Fn(lambda x: F.interpolate(x, scale_factor=2, mode="nearest-exact")), 1),
        1,
        6,
    ),
    "2d_bicubic_align_corners": (
        lambda: ConvThen(Fn(lambda x: F.interpolate(x, scale_factor=2, mode="bicubic", align_corners=True))),
        2,
        5,
    ),
    "3d_trilinear": (lambda: ConvThen(Fn(lambda x: F.interpolate(x, scale_factor=2, mode="trilinear")), 3), 3, 4),
    "3d_nearest": (lambda: ConvThen(Fn(lambda x: F.interpolate(x, scale_factor=2, mode="nearest")), 3), 3, 4),
    "2d_skip_nearest": (lambda: SkipUp("nearest"), 2, 7),
    "2d_skip_bilinear": (lambda: SkipUp("bilinear", align_corners=False), 2, 7),
    "3d_skip_trilinear_align_corners": (lambda: SkipUp("trilinear", 3, align_corners=True), 3, 5),
}


@pytest.mark.parametrize("name", cases(RESIZE, {"1d_linear", "3d_skip_trilinear_align_corners"}))
def test_resize(name):
    make, dims, hw = RESIZE[name]
    check_parity(make, img(dims, hw))


POOLS = {
    "avg2d_ceil": (lambda: ConvThen(nn.AvgPool2d(3, 2, ceil_mode=True)), 2, 8),
    "avg1d_ceil": (lambda: ConvThen(nn.AvgPool1d(3, 2, ceil_mode=True), 1), 1, 8),
    "avg1d_exclude_pad": (lambda: ConvThen(nn.AvgPool1d(3, 2, padding=1, count_include_pad=False), 1), 1, 8),
    "adaptive_avg2d_non_dividing": (lambda: ConvThen(nn.AdaptiveAvgPool2d(4)), 2, 7),
    "adaptive_max1d_non_dividing": (lambda: ConvThen(nn.AdaptiveMaxPool1d(3), 1), 1, 7),
    "max2d_resnet_stem": (lambda: ConvThen(nn.Sequential(nn.ReLU(), nn.MaxPool2d(3, 2, 1))), 2, 8),
    "max3d_ceil": (lambda: ConvThen(nn.MaxPool3d(2, 2, ceil_mode=True), 3), 3, 5),
}


@pytest.mark.parametrize("name", cases(POOLS, {"adaptive_avg2d_non_dividing", "avg2d_ceil"}))
def test_pool(name):
    make, dims, hw = POOLS[name]
    check_parity(make, img(dims, hw))


class TracedIgnoreIndex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 6)

    def forward(self, x):
        logits = self.l(x).reshape(-1, 6)
        target = torch.arange(logits.shape[0]) % 6
        return F.cross_entropy(logits, target, ignore_index=logits.shape[1] - 1)


def test_cross_entropy_traced_ignore_index():
    check_parity(TracedIgnoreIndex, seq)


class Sample(nn.Module):
    def __init__(self, two_d: bool) -> None:
        super().__init__()
        self.l = nn.Linear(8, 6)
        self.two_d = two_d

    def forward(self, x):
        p = F.softmax(self.l(x), -1)
        probs = p[:, 0] if self.two_d else p[0, 0]
        # One outcome has all the mass: the sample is deterministic, so eager and ORT agree.
        onehot = (probs > 2).float() + F.one_hot(torch.zeros(probs.shape[:-1], dtype=torch.long), 6).float()
        idx = torch.multinomial(onehot, 3, replacement=True)
        return p * (1 + idx.float().sum())


@pytest.mark.parametrize("two_d", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["1d", "2d"])
def test_multinomial(two_d):
    check_parity(lambda: Sample(two_d), seq)


NORMS = {
    "group_norm_no_affine": (lambda: ConvThen(nn.GroupNorm(2, 4, affine=False)), 2),
    "group_norm_1d": (lambda: ConvThen(nn.GroupNorm(2, 4), 1), 1),
    "instance_norm_1d": (lambda: ConvThen(nn.InstanceNorm1d(4, affine=True), 1), 1),
    "instance_norm_running_stats": (lambda: ConvThen(nn.InstanceNorm2d(4, affine=True, track_running_stats=True)), 2),
    "instance_norm_1d_running_stats_no_affine": (
        lambda: ConvThen(nn.InstanceNorm1d(4, track_running_stats=True, momentum=0.3), 1),
        1,
    ),
    # TorchScript: squeeze(1) after a computed Pad (ortwrap_ops::squeeze_ones, export/symbolics.py).
    "local_response_norm_1d": (lambda: ConvThen(nn.LocalResponseNorm(3), 1), 1),
    "local_response_norm_2d": (lambda: ConvThen(nn.LocalResponseNorm(2, alpha=0.1, beta=0.6, k=1.5)), 2),
}


@pytest.mark.parametrize("name", cases(NORMS, {"group_norm_no_affine"}))
def test_norm(name):
    """GroupNorm(affine=False)'s output (a Reshape's buffer once ORT drops the x*1+0) must survive
    the backward."""
    make, dims = NORMS[name]
    check_parity(make, img(dims, 6))


def test_local_response_norm_without_backward():
    """An inference graph keeps torch's squeeze (an ``If`` under TorchScript, which ORT runs)."""
    import parity

    from ortwrap import ORTWrap

    torch.manual_seed(0)
    model = ConvThen(nn.LocalResponseNorm(3), dims=1).eval()
    wrapped = ORTWrap(model, fallback=False, exporter=parity.EXPORTER)
    for b in (2, 5):
        x = torch.randn(b, 3, 6 + b)
        with torch.no_grad():
            torch.testing.assert_close(wrapped(x), model(x), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["layer_norm_no_bias", "rms_norm"])
def test_sequence_norm(norm):
    check_parity(lambda: Pre(nn.LayerNorm(8, bias=False) if norm == "layer_norm_no_bias" else nn.RMSNorm(8)), seq)


class HardBlock(nn.Module):
    """MobileNetV3's activations: Conv -> Hardswish, a squeeze-excite gate through Hardsigmoid, inputs
    spread over [-6, 6] so both kinks of each (and the flat parts) are crossed."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.se = nn.Conv2d(6, 6, 1)
        self.out = nn.Conv2d(6, 2, 1)

    def forward(self, x):
        h = F.hardswish(self.conv(x) * 3)
        gate = F.hardsigmoid(self.se(h.mean((2, 3), keepdim=True)) * 4)
        return self.out(F.hardswish(h * gate - 1))


def _aten_operators(model) -> list[str]:
    return [
        next(a.s.decode() for a in n.attribute if a.name == "operator") for n in model.graph.node if n.op_type == "ATen"
    ]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch_ops"])
def test_hard_activations_run_their_backward_ops(native):
    """HardSwish and HardSigmoid train on ortwrap's CPU kernels (float32), else through ortwrap's ops
    with their explicit backward ops (``hardswish_backward``, ``hard_sigmoid_backward``); never a vjp
    recomputing them under autograd. On ``engine="onnxruntime"``: eager's numbers only."""
    if ENGINE == "onnxruntime" and native:
        pytest.skip(
            "native_kernels (ortwrap's CPU kernels) is a training-engine option: on engine='onnxruntime' "
            "this case is the torch_ops one"
        )
    w = check_parity(HardBlock, img(2, hw=5), wrap_options={"build_cache": False, "native_kernels": native})
    if not _training_engine(w):
        return  # (no build artifacts there: AOTAutograd's graphs have no ATen nodes)
    ops = _aten_operators(w.last_artifacts.graph.model())
    prefix, sigmoid = ("ortwrap_cpu::", "hardsigmoid") if native else ("ortwrap_ops::", "hard_sigmoid")
    assert ops.count(f"{prefix}hardswish_backward") == 2 and ops.count(f"{prefix}{sigmoid}_backward") == 1, ops
    assert not [op for op in ops if op.startswith("ortwrap_vjp::")]


@no_exporter
def test_hard_sigmoid_backward_matches_autograd():
    """ONNX HardSigmoid's other alpha/beta (not PyTorch's 1/6, 1/2): the backward op equals autograd of
    ``clamp(alpha * x + beta, 0, 1)``, kinks included (clamp passes the gradient at its bounds)."""
    from ortwrap.ops import define_ops

    define_ops()
    for alpha, beta in ((0.2, 0.5), (1 / 6, 0.5), (0.5, 0.25)):
        x = torch.cat([torch.linspace(-8, 8, 161), torch.tensor([-beta / alpha, (1 - beta) / alpha])])
        x = x.requires_grad_()
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
        (want,) = torch.autograd.grad(torch.ops.ortwrap_ops.hard_sigmoid(x, alpha, beta), x, g)
        (got,) = torch.ops.ortwrap_ops.hard_sigmoid_backward(g, x.detach(), alpha, beta, [True])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        (got,) = torch.ops.ortwrap_ops.hardswish_backward(g, x.detach(), [True])
        (want,) = torch.autograd.grad(F.hardswish(x), x, g)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
