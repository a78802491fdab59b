"""Standard-op fusions (``passes/fusions.py``), written as onnxscript rewrite rules: each rule at an
opset below its standard op's threshold and at one above, the fused graph computing what the
unfused one did (in ORT), and models that train like eager with the fused ops."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_text
import pytest
import torch
from parity import check_parity, seq_len
from torch import nn

from ortwrap._ort import ort
from ortwrap.passes.fusions import StandardOpFusionPass


def _fuse(body: str, opset: int, training: bool = False) -> tuple[onnx.ModelProto, onnx.ModelProto, bool]:
    result, after = onnx_text.run_pass(StandardOpFusionPass(training=training), body, opset)
    return onnx.shape_inference.infer_shapes(onnx_text.parse(body, opset)), after, result.modified


def _ops(model: onnx.ModelProto) -> list[tuple[str, str]]:
    return [(n.domain, n.op_type) for n in model.graph.node if n.op_type != "Constant"]


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.ir_version = 8
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # (ORT's own fusions off)
    return ort.InferenceSession(model.SerializeToString(), so).run(None, feeds)


def _same(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict[str, np.ndarray], atol: float = 1e-5) -> None:
    for a, b in zip(_run(before, feeds), _run(after, feeds)):
        np.testing.assert_allclose(b, a, atol=atol, rtol=1e-4)


X = {"x": np.random.default_rng(0).standard_normal((3, 5, 8)).astype(np.float32) * 2}

GELU_ERF = {
    "div": """g (float[N, T, 8] x) => (float[N, T, 8] y) {
        c = Constant <value = float {1.4142135}> ()
        h = Constant <value = float {0.5}> ()
        one = Constant <value = float {1.0}> ()
        d = Div(x, c)
        e = Erf(d)
        a = Add(e, one)
        m = Mul(x, a)
        y = Mul(m, h)
    }""",
    "mul, other order": """g (float[N, T, 8] x) => (float[N, T, 8] y) {
        c = Constant <value = float {0.70710677}> ()
        h = Constant <value = float {0.5}> ()
        one = Constant <value = float {1.0}> ()
        d = Mul(c, x)
        e = Erf(d)
        a = Add(one, e)
        hx = Mul(h, x)
        y = Mul(hx, a)
    }""",
}


@pytest.mark.parametrize("form", list(GELU_ERF))
@pytest.mark.parametrize("opset,expected", [(18, ("com.microsoft", "Gelu")), (20, ("", "Gelu"))])
def test_erf_gelu_fuses_to_the_standard_op_from_opset_20(form, opset, expected):
    before, after, modified = _fuse(GELU_ERF[form], opset)
    assert modified and _ops(after) == [expected], _ops(after)
    _same(before, after, X)


GELU_TANH = """g (float[N, T, 8] x) => (float[N, T, 8] y) {
    c3 = Constant <value = float {0.044715}> ()
    k = Constant <value = float {0.7978846}> ()
    h = Constant <value = float {0.5}> ()
    one = Constant <value = float {1.0}> ()
    three = Constant <value = float {3.0}> ()
    p = Pow(x, three)
    s = Mul(c3, p)
    i = Add(x, s)
    m = Mul(k, i)
    t = Tanh(m)
    a = Add(t, one)
    hx = Mul(h, x)
    y = Mul(hx, a)
}"""


@pytest.mark.parametrize(
    "opset,training,expected",
    [
        (18, False, ("com.microsoft", "FastGelu")),
        (20, False, ("", "Gelu")),
        # ORT 1.19.2's gradient of Gelu ignores approximate="tanh": training graphs keep FastGelu
        (20, True, ("com.microsoft", "FastGelu")),
    ],
)
def test_tanh_gelu_fuses_by_opset_and_training(opset, training, expected):
    before, after, modified = _fuse(GELU_TANH, opset, training)
    assert modified and _ops(after) == [expected], _ops(after)
    node = next(n for n in after.graph.node if n.op_type in ("Gelu", "FastGelu"))
    if expected == ("", "Gelu"):
        assert onnx.helper.get_attribute_value(node.attribute[0]) == b"tanh"
    _same(before, after, X, atol=1e-4)


LAYER_NORM = """g (float[N, T, 8] x, float[8] w, float[8] b) => (float[N, T, 8] y) {{
    two = Constant <value = float {{2.0}}> ()
    eps = Constant <value = float {{1e-5}}> ()
    {axes}
    mean = ReduceMean {mean_args}
    d = Sub(x, mean)
    sq = Pow(d, two)
    var = ReduceMean {var_args}
    ve = Add(var, eps)
    s = Sqrt(ve)
    n = Div(d, s)
    nw = Mul(n, w)
    y = Add(nw, b)
}}"""


def _layer_norm(opset: int) -> str:
    if opset >= 18:  # axes became an input
        return LAYER_NORM.format(
            axes="ax = Constant <value = int64[1] {-1}> ()", mean_args="(x, ax)", var_args="(sq, ax)"
        )
    return LAYER_NORM.format(axes="", mean_args="<axes = [-1]> (x)", var_args="<axes = [-1]> (sq)")


@pytest.mark.parametrize("opset", [16, 17, 18])
def test_layer_norm_fuses_to_layer_normalization(opset):
    """At 17 and later the standard op; below, ORT's contrib op of the same name and domain."""
    before, after, modified = _fuse(_layer_norm(opset), opset)
    assert modified and _ops(after) == [("", "LayerNormalization")], _ops(after)
    rng = np.random.default_rng(1)
    feeds = {**X, "w": rng.standard_normal(8).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32)}
    _same(before, after, feeds)


RMS_NORMS = {
    "reciprocal": ("r = Reciprocal(s)\n    n = Mul(x, r)", "p = Pow(x, two)"),
    "div": ("n = Div(x, s)", "p = Mul(x, x)"),
}


@pytest.mark.parametrize("form", list(RMS_NORMS))
@pytest.mark.parametrize("opset", [17, 20])
def test_rms_norm_fuses_to_simplified_layer_normalization(form, opset):
    norm, square = RMS_NORMS[form]
    reduce = "ReduceMean <axes = [-1]> (p)" if opset < 18 else "ReduceMean(p, ax)"
    body = f"""g (float[N, T, 8] x, float[8] w) => (float[N, T, 8] y) {{
    two = Constant <value = float {{2.0}}> ()
    eps = Constant <value = float {{1e-6}}> ()
    ax = Constant <value = int64[1] {{-1}}> ()
    {square}
    ms = {reduce}
    me = Add(ms, eps)
    s = Sqrt(me)
    {norm}
    y = Mul(w, n)
}}"""
    before, after, modified = _fuse(body, opset)
    assert modified and ("", "SimplifiedLayerNormalization") in _ops(after), _ops(after)
    _same(before, after, {**X, "w": np.linspace(0.5, 2, 8, dtype=np.float32)})


def test_a_near_miss_is_left_alone():
    """A GELU-looking graph with another constant, or a mean over another axis, is not fused."""
    body = GELU_ERF["div"].replace("{0.5}", "{0.25}")
    _, after, modified = _fuse(body, 20)
    assert not modified and ("", "Gelu") not in _ops(after)
    _, after, modified = _fuse(_layer_norm(17).replace("axes = [-1]", "axes = [1]"), 17)
    assert not modified


# ------------------------------------------------------------------------------------ end to end


def test_llama_rms_norm_trains_as_simplified_layer_normalization(exporter):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip

    def inputs(b, g):
        ids = torch.randint(0, 64, (b, seq_len(b, 9)), generator=g)
        return (), {"input_ids": ids, "labels": ids}

    w = check_parity(lambda: transformers.LlamaForCausalLM(cfg), inputs, loss_fn=lambda o: o.loss)
    ops = [n.op_type for n in w.last_artifacts.pre_grad.graph.node]
    assert ops.count("SimplifiedLayerNormalization") == 5, ops  # 2 per layer and the final norm


class LNGelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(torch.nn.functional.gelu(self.ln(self.l1(x))))


def test_torchscript_below_opset_17_gets_layer_normalization_and_trains_on_ortwraps_kernel():
    """The TorchScript exporter writes LayerNorm out in ops below opset 17: fused, it runs on
    ortwrap's LayerNorm kernel on the CPU, as at opset 17."""
    w = check_parity(
        LNGelu, lambda b, g: ((torch.randn(b, seq_len(b, 5), 8, generator=g),), {}),
        wrap_options={"exporter": "torchscript", "opset": 16},
    )  # fmt: skip
    built = [n for n in w.last_artifacts.graph.model().graph.node if n.op_type == "ATen"]
    operators = {a.s.decode() for n in built for a in n.attribute if a.name == "operator"}
    assert "ortwrap_cpu::layer_norm" in operators, operators


@pytest.mark.usefixtures("exporter")
def test_inference_graphs_get_fused_gelu():
    """Inference graphs (no ortwrap kernels there) run GELU as one fused op, equal to eager."""
    torch.manual_seed(0)
    m = LNGelu().eval()
    import parity

    from ortwrap import ORTWrap

    w = ORTWrap(m, fallback=False, exporter=parity.EXPORTER)
    x = torch.randn(3, 7, 8)
    with torch.no_grad():
        torch.testing.assert_close(w(x), m(x), atol=1e-5, rtol=1e-4)
    ops = {(n.domain, n.op_type) for n in w.last_artifacts.pre_grad.graph.node}
    assert ops & {("", "Gelu"), ("com.microsoft", "Gelu")}, ops
