"""Convolutions under ``gemm="auto"`` / ``half_compute="auto"``: each 2-D Conv of a CPU training
graph runs as ORT's Conv + ConvGrad or as PyTorch's ``convolution`` + ``convolution_backward``
(``ortwrap_ops::conv``; in bf16 under autocast, as eager's), whichever measured faster on its shape
on this machine (``gemm_choice._choose_convs``, ``passes/torch_conv.py``); a bf16 ConvTranspose in
bf16 where PyTorch's bf16 one measured faster than its float32 one.

The decision is a pure function of measured times (tested with given times); the real tests build
a small UNet-like model, check that the first build measures once and later builds read the
machine's record, and force either route by rewriting that record: training matches eager
(outputs, every parameter's gradient) on both routes, both exporters, fp32 and bf16 autocast."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from parity import check_parity, no_exporter
from torch import nn

from ortwrap import ORTWrap
from ortwrap import gemm_choice as gc
from ortwrap.gemm_choice import Conv, ConvRate, decide_convs

pytestmark = pytest.mark.usefixtures("exporter")

#: bf16 autocast tolerance (test_mixed_precision.py's)
BF16 = {"atol": 3e-2, "rtol": 3e-2}


class SmallUNet(nn.Module):
    """Convolutions above CONV_MIN_FLOPS (with and without bias, one strided), a transposed one,
    GroupNorm + SiLU, a skip concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU())
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.up = nn.ConvTranspose2d(16, 16, 2, 2)
        self.dec = nn.Sequential(nn.Conv2d(24, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU())
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x, target):
        e = self.enc(x)
        d = self.dec(torch.cat([self.up(F.silu(self.down(e))), e], 1))
        return F.mse_loss(self.out(d), target)


def unet_inputs(b, g):
    return (torch.randn(b, 3, 32, 32, generator=g), torch.randn(b, 1, 32, 32, generator=g)), {}


def _loss(out):
    return out


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _conv_nodes(w: ORTWrap) -> dict[str, int]:
    """How many ONNX Conv nodes and ATen conv / conv_transpose nodes the built graphs of ``w`` have."""
    counts: dict[str, int] = {}
    for program in w.programs():
        for node in program.graph.model().graph.node:
            op = next((a.s.decode() for a in node.attribute if a.name == "operator"), node.op_type)
            key = op.rsplit("|", 1)[-1]
            if key in ("Conv", "ortwrap_ops::conv", "ortwrap_ops::conv_transpose"):
                counts[key] = counts.get(key, 0) + 1
    return counts


def _aten_dtypes(w: ORTWrap, operator: str) -> set[int]:
    """The element types of the inputs of the ``operator`` ATen nodes (the forward graph's value info)."""
    found = set()
    for program in w.programs():
        model = program.graph.model()
        types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.input]}
        for node in model.graph.node:
            if any(a.name == "operator" and a.s.decode() == operator for a in node.attribute):
                found |= {types[i] for i in node.input[:1] if i in types}
    return found


def _casts_next_to(w: ORTWrap, operator: str) -> list[str]:
    """The Cast nodes of the built graphs that read an input of, or a result of, the ``operator`` ATen nodes."""
    found = []
    for program in w.programs():
        nodes = program.graph.model().graph.node
        atens = [n for n in nodes if any(a.name == "operator" and a.s.decode() == operator for a in n.attribute)]
        ins = {i for n in atens for i in n.input}
        outs = {o for n in atens for o in n.output}
        found += [n.name for n in nodes if n.op_type == "Cast" and (set(n.output) & ins or set(n.input) & outs)]
    return found


def _first_step(exporter, autocast=None) -> ORTWrap:
    torch.manual_seed(0)
    w = ORTWrap(SmallUNet(), fallback=False, build_cache=False, exporter=exporter)
    (x, t), _ = unet_inputs(4, torch.Generator().manual_seed(0))
    if autocast is None:
        w(x, t).backward()
    else:
        with autocast():
            loss = w(x, t)
        loss.backward()
    return w


def _set_times(gemm_dir, torch_faster: bool) -> None:
    """Rewrite the recorded convolution times: one route 3x the other on every shape."""
    (path,) = gemm_dir.glob("*.json")
    data = json.loads(path.read_text())
    convs = [r for k, r in data["rates"].items() if k.startswith("conv")]
    assert convs
    for r in convs:
        fast = min(r["ort_s"], r["torch_s"])
        r["ort_s"], r["torch_s"] = (3 * fast + 1e-3, fast) if torch_faster else (fast, 3 * fast + 1e-3)
    path.write_text(json.dumps(data))
    gc._memo.clear()


# ------------------------------------------------------------------------------------ the decision


@no_exporter
def test_decide_convs_weighs_the_crossings():
    """PyTorch's route wins where its time in a step (CONV_TORCH_IN_STEP x the isolated one) plus two
    ATen calls is below ORT's by the margin: a conv 3x faster there, not a tie, not a tiny one whose
    crossings eat the gain; a transposed one (an ATen node either way) needs no crossing nor factor."""
    big = Conv(4, 24, 40, 40, 8, 3, 3, pads=(1, 1))
    tiny = Conv(4, 8, 10, 10, 8, 3, 3, pads=(1, 1))
    tie = Conv(4, 32, 20, 20, 16, 3, 3, pads=(1, 1))
    up = Conv(4, 16, 20, 20, 16, 2, 2, stride=(2, 2), dtype="bf16", transposed=True)
    rates = [
        ConvRate(big, 1.2e-3, 0.4e-3),
        ConvRate(tiny, 0.2e-3, 0.08e-3),  # 2.5x faster, but 0.09 ms + 2 x CONV_CROSSING_S (0.06 ms) of crossings
        ConvRate(tie, 0.5e-3, 0.49e-3),
        ConvRate(up, 0.3e-3, 0.2e-3),
        ConvRate(Conv(4, 3, 40, 40, 8, 3, 3, pads=(1, 1)), 0.2e-3, 0.4e-3),  # ORT faster
    ]
    assert decide_convs(rates) == [big, up]
    assert decide_convs(rates, crossing_s=0.0, margin=0.0, in_step=1.0) == [big, tiny, tie, up]


@no_exporter
def test_decide_convs_routes_the_unets_convolutions_that_pay():
    """The UNet's shapes as measured on a Zen 5 EPYC (1 thread; ms through ORT vs PyTorch, forward and
    backward): the 32->16 convolution (fp32 and bf16) and the bf16 24->8 one are PyTorch's (their
    steps got faster routed, docs/performance.md "Convolutions"), the fp32 24->8 one (10% faster in
    isolation, which a step does not keep) and the few-channel ones stay ORT's. The crossing price
    as first measured (0.25 ms a call, a loaded machine) routed none."""
    f32 = {"pads": (1, 1)}
    b16 = {"pads": (1, 1), "dtype": "bf16"}
    rates = [
        ConvRate(Conv(4, 24, 40, 40, 8, 3, 3, **f32), 1.17e-3, 1.05e-3),
        ConvRate(Conv(4, 32, 20, 20, 16, 3, 3, **f32), 0.54e-3, 0.33e-3),
        ConvRate(Conv(4, 8, 20, 20, 16, 3, 3, **f32), 0.15e-3, 0.22e-3),
        ConvRate(Conv(4, 3, 40, 40, 8, 3, 3, **f32), 0.17e-3, 0.33e-3),
        ConvRate(Conv(4, 24, 40, 40, 8, 3, 3, **b16), 1.21e-3, 0.71e-3),
        ConvRate(Conv(4, 32, 20, 20, 16, 3, 3, **b16), 0.55e-3, 0.33e-3),
        ConvRate(Conv(4, 16, 10, 10, 16, 3, 3, **b16), 0.09e-3, 0.17e-3),
    ]
    assert decide_convs(rates) == [rates[1].conv, rates[4].conv, rates[5].conv]


@no_exporter
def test_conv_shapes_and_keys():
    c = Conv(4, 8, 24, 24, 16, 3, 3, stride=(2, 2), pads=(1, 1))
    assert c.out_hw() == (12, 12) and c.flops == 2.0 * 4 * 16 * 12 * 12 * 8 * 9
    t = Conv(4, 16, 12, 12, 16, 2, 2, stride=(2, 2), transposed=True, dtype="bf16")
    assert t.out_hw() == (24, 24) and t.key() != Conv(4, 16, 12, 12, 16, 2, 2, stride=(2, 2), dtype="bf16").key()


# ------------------------------------------------------------------------------------ real builds


def test_auto_measures_convolutions_once_per_machine(gemm_dir, exporter):
    """The first build times the graph's convolution shapes (once); the Conv nodes the times choose
    run as PyTorch's, the others as ORT's; a later build (after the in-process record is gone: from
    the disk) measures nothing and chooses the same."""
    before = gc.conv_measurements
    w = _first_step(exporter)
    choice = w.last_artifacts.gemm_choice
    assert gc.conv_measurements == before + 1 and choice.conv_how == "measured", choice.summary()
    # enc, down, dec (out's 1x1 conv is below CONV_MIN_FLOPS; the float32 ConvTranspose is PyTorch's anyway)
    assert len(choice.conv_rates) == 3 and all(r.ort_s > 0 and r.torch_s > 0 for r in choice.conv_rates)
    chosen = decide_convs(choice.conv_rates)
    assert len(choice.torch_convs) == len(chosen)
    counts = _conv_nodes(w)
    assert (counts.get("ortwrap_ops::conv", 0), counts.get("Conv", 0)) == (len(chosen), 4 - len(chosen)), counts
    gc._memo.clear()
    again = _first_step(exporter)
    assert again.last_artifacts.gemm_choice.conv_how == "cached" and gc.conv_measurements == before + 1
    assert again.last_artifacts.gemm_choice.torch_convs == choice.torch_convs


@pytest.mark.parametrize("torch_faster", [True, False], ids=["torch-faster", "ort-faster"])
def test_recorded_times_choose_the_route_fp32(gemm_dir, exporter, torch_faster):
    """Whichever route the machine's record says is faster runs the convolutions, and training
    matches eager on it (outputs, every parameter's gradient, several steps and batch sizes); an
    explicit ``gemm`` routes no convolution and measures nothing."""
    _first_step(exporter)
    _set_times(gemm_dir, torch_faster)
    before = gc.conv_measurements
    w = check_parity(SmallUNet, unet_inputs, loss_fn=_loss, lr=0.01, wrap_options={"build_cache": False})
    choice = w.last_artifacts.gemm_choice
    assert choice.conv_how == "cached" and len(choice.torch_convs) == (3 if torch_faster else 0), choice.summary()
    counts = _conv_nodes(w)
    assert counts.get("ortwrap_ops::conv", 0) == (3 if torch_faster else 0), counts
    torch.manual_seed(0)
    explicit = ORTWrap(SmallUNet(), fallback=False, build_cache=False, exporter=exporter, gemm="ort")
    (x, t), _ = unet_inputs(4, torch.Generator().manual_seed(0))
    explicit(x, t).backward()
    assert not explicit.last_artifacts.gemm_choice.torch_convs and "ortwrap_ops::conv" not in _conv_nodes(explicit)
    assert gc.conv_measurements == before


@pytest.mark.parametrize("torch_faster", [True, False], ids=["torch-faster", "ort-faster"])
def test_recorded_times_choose_the_route_bf16(gemm_dir, exporter, torch_faster):
    """Under bf16 autocast PyTorch's route computes the convolutions (and the ConvTranspose) in bf16,
    as eager does (a Conv from float32 values, casting inside the op); training matches eager autocast
    either way."""
    _first_step(exporter, bf16)
    _set_times(gemm_dir, torch_faster)
    w = check_parity(
        SmallUNet, unet_inputs, loss_fn=_loss, lr=0.01, autocast=bf16, wrap_options={"build_cache": False}, **BF16
    )
    choice = w.last_artifacts.gemm_choice
    assert choice.option == "half_compute" and choice.conv_how == "cached", choice.summary()
    # dynamo: the four convolutions above CONV_MIN_FLOPS in bf16 (three Conv, the ConvTranspose); the
    # TorchScript exporter's autocast graph has some Convs in float32 (and then its ConvTranspose too)
    assert any(r.conv.dtype == "bf16" for r in choice.conv_rates), choice.summary()
    routed = [r.conv for r in choice.conv_rates] if torch_faster else []
    assert len(choice.torch_convs) == sum(c.count for c in routed), choice.summary()
    counts = _conv_nodes(w)
    assert counts.get("ortwrap_ops::conv", 0) == sum(c.count for c in routed if not c.transposed), counts
    # float32 values in and out (the op casts inside PyTorch): no ORT Cast next to a routed Conv
    assert _aten_dtypes(w, "ortwrap_ops::conv") == ({1} if any(not c.transposed for c in routed) else set())
    assert not _casts_next_to(w, "ortwrap_ops::conv")
    if any(c.transposed for c in routed):
        assert _aten_dtypes(w, "ortwrap_ops::conv_transpose") == {16}
    else:
        assert _aten_dtypes(w, "ortwrap_ops::conv_transpose") <= {1}


# ------------------------------------------------------------------------------------ the pass


@no_exporter
def test_torch_conv_pass_rewrites_the_named_convs():
    """TorchConvOnCPUPass: the named 2-D Conv becomes one ``ortwrap_ops::conv`` ATen node (stride,
    pads, dilation, groups as its constant arguments); an unnamed one, and a named one PyTorch's op
    has no form of (asymmetric pads), stay ORT's."""
    import onnx
    import onnx_ir as ir
    from onnx import TensorProto, helper

    from ortwrap.passes.torch_conv import TorchConvOnCPUPass

    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["y"], name="routed", pads=[1, 1, 1, 1], strides=[2, 2], group=2),
            helper.make_node("Conv", ["x", "w"], ["z"], name="kept", pads=[1, 1, 1, 1], strides=[2, 2], group=2),
            helper.make_node("Conv", ["x", "w"], ["a"], name="asymmetric", pads=[0, 0, 1, 1], group=2),
        ],
        "g",
        [helper.make_tensor_value_info("x", f, [2, 4, 8, 8]), helper.make_tensor_value_info("w", f, [6, 2, 3, 3]),
         helper.make_tensor_value_info("b", f, [6])],
        [helper.make_tensor_value_info(n, f, None) for n in ("y", "z", "a")],
    )  # fmt: skip
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    p = TorchConvOnCPUPass(names={"routed", "asymmetric"})
    result = p(ir.serde.deserialize_model(model))
    assert result.modified and p.rewritten == 1
    nodes = list(result.model.graph)
    atens = [n for n in nodes if n.op_type == "ATen"]
    assert [n.name for n in nodes if n.op_type == "Conv"] == ["kept", "asymmetric"]
    assert len(atens) == 1 and atens[0].attributes["operator"].as_string() == "ortwrap_ops::conv"
    args = [None if v is None else v.name for v in atens[0].inputs[:3]]
    assert args == ["x", "w", "b"]
    consts = [v.producer().attributes["value"].as_tensor().numpy().tolist() for v in atens[0].inputs[3:]]
    assert consts == [[2, 2], [1, 1], [1, 1], 2, False]
    assert atens[0].outputs[0].name == "y" and atens[0].outputs[0].shape == ir.Shape([2, 6, 4, 4])
    # with the build's choice (a GemmChoice naming none): nothing
    assert not TorchConvOnCPUPass(gc.GemmChoice(False, False))(ir.serde.deserialize_model(model)).modified
