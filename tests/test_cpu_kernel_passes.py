"""Passes that give ORT's CPU kernels faster forms of the same function (passes/gather_to_gathernd.py,
passes/gelu_unfuse.py, passes/linear_to_gemm.py): parity with eager through both exporters, the ops
ORT ends up running, and what each pass leaves alone."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx.parser
import onnx_text
import pytest
import torch
import torch.nn.functional as F
from parity import check_parity, seq_len
from torch import nn

from ortwrap.grad.recompute import SUFFIX as RECOMPUTE_SUFFIX
from ortwrap.passes.gather_to_gathernd import GatherToGatherNDPass
from ortwrap.passes.gelu_unfuse import UnfuseErfGeluPass
from ortwrap.passes.linear_to_gemm import LinearToGemmPass

#: These passes serve ORT's own CPU kernels: with ortwrap's (the default), GELU and embedding
#: lookups run on those instead (tests/test_native_kernels.py).
ORT_KERNELS = {"native_kernels": False}


def built_ops(wrapped) -> Counter:
    """Op counts of the built graph, without the forward nodes that recompute copies into the
    backward (grad/recompute.py; with recompute="cheap")."""
    nodes = wrapped.last_artifacts.graph.model().graph.node
    return Counter(n.op_type for n in nodes if not n.name.endswith(RECOMPUTE_SUFFIX))


def run_pass(pass_, body: str) -> tuple[bool, onnx.ModelProto]:
    result, model = onnx_text.run_pass(pass_, body)
    return result.modified, model


# ------------------------------------------------------------------------------ Gather -> GatherND
class Embed(nn.Module):
    def __init__(self, padding_idx: int | None = None, rank3: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=padding_idx)
        self.table = nn.Parameter(torch.randn(20, 2, 4)) if rank3 else None
        self.head = nn.Linear(8, 20)

    def forward(self, ids):
        h = torch.tanh(self.emb(ids))
        if self.table is not None:  # a lookup into a rank-3 table, and one by a scalar index
            h = h + self.table[ids].reshape(*ids.shape, 8) + self.table[3].reshape(8)
        return self.head(h)


def repeated_ids(b, g):
    ids = torch.randint(0, 20, (b, seq_len(b, 6)), generator=g)
    ids[:, -2:] = 0  # repeated rows: their gradients must add up
    ids[0, :3] = 7
    return (ids,), {}


@pytest.mark.usefixtures("exporter")
@pytest.mark.parametrize(
    "padding_idx,rank3", [(None, False), (0, False), (None, True)], ids=["plain", "padding", "rank3"]
)
def test_embedding_gathernd_parity(padding_idx, rank3):
    wrapped = check_parity(lambda: Embed(padding_idx, rank3), repeated_ids, wrap_options=ORT_KERNELS)
    ops = built_ops(wrapped)
    assert ops["GatherNDGrad"] >= 1 and ops["GatherGrad"] == 0, ops


def test_gathernd_pass_rewrites_parameter_lookups_only():
    body = """
    agraph (float[20, 8] w, int64[2, 3] ids, int32[2, 3] ids32, float[4, 20, 8] x) => (float[2, 3, 8] a, float[2, 3, 8] b, float[8] c, float[4, 2, 3, 8] d) {
        a = Gather <axis = 0> (w, ids)
        b = Gather <axis = 0> (w, ids32)
        zero = Constant <value = int64 {0}> ()
        c = Gather <axis = 0> (w, zero)
        d = Gather <axis = 1> (x, ids)
    }
    """
    modified, model = run_pass(GatherToGatherNDPass(), body)
    assert modified
    ops = [n.op_type for n in model.graph.node]
    # int64 indices on axis 0 of a graph input (a and c) become GatherND; int32 indices and axis 1 stay.
    assert ops.count("GatherND") == 2 and ops.count("Gather") == 2, ops
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    w = rng.standard_normal((20, 8), dtype=np.float32)
    ids = np.array([[1, 5, 5], [-1, 0, 19]], dtype=np.int64)  # negative index counts from the end
    x = rng.standard_normal((4, 20, 8), dtype=np.float32)
    a, b, c, d = sess.run(None, {"w": w, "ids": ids, "ids32": ids.astype(np.int32), "x": x})
    np.testing.assert_array_equal(a, w[ids])
    np.testing.assert_array_equal(b, w[ids])
    np.testing.assert_array_equal(c, w[0])
    np.testing.assert_array_equal(d, x[:, ids])


def test_gathernd_pass_keeps_range_lookups():
    """Position embeddings (indices from Range) stay Gather: ORT turns them into a Slice itself."""
    body = """
    agraph (float[20, 8] w, int64 n) => (float[N, 8] y) {
        zero = Constant <value = int64 {0}> ()
        one = Constant <value = int64 {1}> ()
        pos = Range (zero, n, one)
        y = Gather <axis = 0> (w, pos)
    }
    """
    modified, _ = run_pass(GatherToGatherNDPass(), body)
    assert not modified


# ------------------------------------------------------------------------------ erf GELU
class GeluMLP(nn.Module):
    """F.gelu and nn.GELU, each between two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.act = nn.GELU()
        self.c = nn.Linear(8, 3)

    def forward(self, x):
        return self.c(self.act(self.b(F.gelu(self.a(x)))))


@pytest.mark.usefixtures("exporter")
def test_erf_gelu_parity_without_gelugrad():
    wrapped = check_parity(
        GeluMLP, lambda b, g: ((torch.randn(b, seq_len(b, 5), 8, generator=g),), {}), wrap_options=ORT_KERNELS
    )
    ops = built_ops(wrapped)
    assert ops["Gelu"] == 0 and ops["GeluGrad"] == 0 and ops["Erf"] == 2, ops


def test_gelu_pass_rewrites_only_div_by_sqrt2_into_erf():
    body = """
    agraph (float[4] x) => (float[4] y, float[4] z, float[4] w) {
        s = Constant <value = float {1.4142135}> ()
        t = Constant <value = float {2.0}> ()
        d = Div (x, s)
        y = Erf (d)
        e = Div (x, t)
        z = Erf (e)
        w = Div (x, s)
    }
    """
    modified, model = run_pass(UnfuseErfGeluPass(), body)
    assert modified
    ops = [n.op_type for n in model.graph.node if n.op_type in ("Div", "Mul")]
    # Only the Div by sqrt(2) that feeds Erf becomes a Mul; the graph output w keeps its Div.
    assert sorted(ops) == ["Div", "Div", "Mul"], ops
    import onnxruntime as ort

    x = np.linspace(-3, 3, 4, dtype=np.float32)
    y, z, w = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(y, torch.erf(torch.from_numpy(x) / 2**0.5).numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(z, torch.erf(torch.from_numpy(x) / 2).numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(w, x / np.float32(1.4142135), rtol=1e-7)


# ------------------------------------------------------------------------------ Linear -> Gemm
class Linears(nn.Module):
    """Linear layers on 3-D and 4-D activations, with and without bias, and a tied ``x @ W.t()``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        nn.init.normal_(self.emb.weight, std=0.3)  # unit-scale tables make the tied gradient cancel
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8, bias=False)
        self.c = nn.Linear(8, 6)

    def forward(self, ids, x4):
        h = self.emb(ids)  # (B, T, 8)
        h = self.b(torch.tanh(self.a(h))) + h
        y4 = self.c(x4) * 1.5  # (B, 2, T, 6)
        # A tied head whose result is a graph output: left as MatMul (see the pass's docstring).
        return h @ self.emb.weight.t(), y4


def linear_inputs(b, g):
    t = seq_len(b, 5)
    return (torch.randint(0, 11, (b, t), generator=g), torch.randn(b, 2, t, 8, generator=g)), {}


@pytest.mark.usefixtures("exporter")
def test_linear_gemm_parity():
    wrapped = check_parity(Linears, linear_inputs)
    pre_grad = Counter(n.op_type for n in wrapped.last_artifacts.pre_grad.graph.node)
    assert pre_grad["MatMul"] == 1 and pre_grad["Gemm"] == 3, pre_grad
    ops = built_ops(wrapped)
    # Bias gradients reduce one axis of the 2-D dY, statically (no shape-generic broadcast subgraph).
    assert ops["BroadcastGradientArgs"] == 0, ops


def test_linear_gemm_pass_rewrites():
    body = """
    agraph (float[2, 3, 4] x, float[5, 4] w, float[5] b, float[4, 5] v, float[3, 5] c, float[2, 4] x2, int64[3] shape) =>
           (float[2, 3, 5] y1, float[2, 3, 5] y2, float[2, 3, 5] y3, float[2, 3, 5] y4, float[2, 5] y5,
            float[2, 3, 5] y6) {
        wt = Transpose <perm = [1, 0]> (w)
        m1 = MatMul (x, wt)
        a1 = Add (b, m1)
        y1 = Neg (a1)
        a2 = MatMul (x, wt)
        y2 = Neg (a2)
        m3 = MatMul (x, v)
        a3 = Add (m3, b)
        y3 = Neg (a3)
        m4 = MatMul (x, v)
        a4 = Add (m4, c)
        y4 = Neg (a4)
        y5 = MatMul (x2, wt)
        m6 = MatMul (x, wt)
        a6 = Add (m6, b)
        y6 = Reshape (a6, shape)
    }
    """
    modified, model = run_pass(LinearToGemmPass(), body)
    assert modified
    ops = Counter(n.op_type for n in model.graph.node)
    # a1 (bias and transpose), a2 (transpose only), a3 (bias only) and y5 (2-D, no reshape) become
    # Gemm. a4's addend is not a bias of shape [N] and its MatMul has nothing to gain; a6 reaches a
    # graph output through a Reshape (ORT would overwrite the Gemm buffer both alias): both stay.
    assert ops["Gemm"] == 4 and ops["MatMul"] == 2 and ops["Add"] == 2 and ops["Transpose"] == 1, ops
    gemm = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert [len(n.input) for n in gemm] == [3, 2, 3, 2], [list(n.input) for n in gemm]
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    shapes = {"x": (2, 3, 4), "w": (5, 4), "b": (5,), "v": (4, 5), "c": (3, 5), "x2": (2, 4)}
    feeds = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
    feeds["shape"] = np.array([2, 3, 5], dtype=np.int64)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y1, y2, y3, y4, y5, y6 = sess.run(None, feeds)
    x, w, b, v, c = (feeds[k] for k in "xwbvc")
    np.testing.assert_allclose(-y1, x @ w.T + b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(-y2, x @ w.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(-y3, x @ v + b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(-y4, x @ v + c, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y5, feeds["x2"] @ w.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y6, x @ w.T + b, rtol=1e-6, atol=1e-6)
