"""``Options.gemm="torch"``: float32 MatMul/Gemm and attention run as PyTorch's GEMMs and CPU flash
attention inside the graph (``passes/half_matmul.py`` with ``dtype=FLOAT``), each with its explicit
backward op. Outputs and every parameter gradient match eager float32; ``gemm="ort"`` leaves the
graph's MatMuls to ONNX Runtime."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from parity import check_parity, gemm_op_counts, no_exporter, seq_len
from torch import nn

from ortwrap import ORTWrap
from ortwrap.options import Options

pytestmark = pytest.mark.usefixtures("exporter")


def matmuls(w: ORTWrap) -> int:
    return sum(n.op_type in ("MatMul", "Gemm", "FusedMatMul") for p in w.programs() for n in p.graph.model().graph.node)


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32, bias=False), nn.LayerNorm(32), nn.Linear(32, 5)
    )


def mlp_inputs(b, g):
    return (torch.randn(b, 12, generator=g),), {}


def test_mlp_torch_gemm():
    w = check_parity(mlp, mlp_inputs, wrap_options={"gemm": "torch"})
    counts = gemm_op_counts(w)
    assert counts.get("ortwrap_ops::linear_f32") == 3, counts
    assert counts.get("ortwrap_ops::linear_backward") == 3, counts
    assert not any(k.startswith("ortwrap_vjp::") for k in counts), counts
    assert matmuls(w) == 0


def test_mlp_ort_gemm_leaves_matmuls():
    w = check_parity(mlp, mlp_inputs, wrap_options={"gemm": "ort"})
    assert not gemm_op_counts(w)
    assert matmuls(w) > 0


class MaskedGPT(nn.Module):
    """Two pre-LN blocks with SDPA under a causal and padding mask, and a tied LM head."""

    def __init__(self, vocab: int = 40, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(32, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d),
                           "ln2": nn.LayerNorm(d), "fc": nn.Linear(d, 2 * d), "out": nn.Linear(2 * d, d)})
            for _ in range(2)
        )  # fmt: skip
        self.ln = nn.LayerNorm(d)

    def forward(self, ids, keep):
        b, t = ids.shape
        x = self.emb(ids) + self.pos(torch.arange(t, device=ids.device))
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        mask = causal[None, None] & keep[:, None, None, :].bool()
        for blk in self.blocks:
            h = blk["ln1"](x)
            q, k, v = blk["qkv"](h).split(x.shape[-1], dim=-1)
            q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + blk["proj"](a.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["out"](nn.functional.gelu(blk["fc"](blk["ln2"](x))))
        return self.ln(x) @ self.emb.weight.t()


def gpt_inputs(b, g):
    t = seq_len(b, 10)
    ids = torch.randint(0, 40, (b, t), generator=g)
    keep = torch.ones(b, t, dtype=torch.int64)
    keep[0, t - 3 :] = 0  # padding at the end of one row (causal: no row fully masked)
    return (ids, keep), {}


def _attention_is_flash(w: ORTWrap, causal: bool) -> None:
    """Both SDPAs as one flash attention op on q, k, v in the projections' [B, T, H, D] layout: no
    matmuls, no Transposes into heads and back."""
    counts = gemm_op_counts(w)
    assert counts.get("ortwrap_ops::attention_bthd_f32") == 2, counts
    assert counts.get("ortwrap_ops::attention_bthd_backward") == 2, counts
    assert matmuls(w) == 0
    nodes = [n for p in w.programs() for n in p.graph.model().graph.node]
    assert not any(n.op_type == "Transpose" for n in nodes)
    forwards = [
        n for n in nodes if {a.name: a.s for a in n.attribute}.get("operator") == b"ortwrap_ops::attention_bthd_f32"
    ]
    assert [n.input[3] == "" for n in forwards] == [causal] * 2  # the causal mode reads no mask tensor


def test_masked_gpt_torch_gemm():
    """Every linear (tied head included) as the float32 linear op; several lengths."""
    w = check_parity(MaskedGPT, gpt_inputs, wrap_options={"gemm": "torch"}, lr=0.01)
    counts = gemm_op_counts(w)
    assert counts.get("ortwrap_ops::linear_f32") == 9, counts
    assert counts.get("ortwrap_ops::linear_backward") == 9, counts
    assert not any(k.startswith("ortwrap_vjp::") for k in counts), counts


def test_masked_gpt_attention_is_flash_attention():
    """SDPA under a causal and padding mask built from an input, which both exporters write as
    ``Where(IsNaN(p), 0, p)`` after the softmax (rows masked everywhere give 0): PyTorch's flash
    attention with the mask, no matmuls, no T x T probabilities kept."""
    _attention_is_flash(check_parity(MaskedGPT, gpt_inputs, wrap_options={"gemm": "torch"}, lr=0.01), causal=False)


def test_causal_gpt_attention_is_causal_flash_attention():
    """A causal-only SDPA (examples/tiny_gpt.py, ``is_causal=True``): PyTorch's flash attention in its
    causal mode (no mask tensor: the blocks above the diagonal are skipped), no matmuls."""
    from tiny_gpt import GPTConfig, TinyGPT

    def inputs(b, g):
        ids = torch.randint(0, 64, (b, seq_len(b, 12)), generator=g)
        return (ids, ids), {}

    w = check_parity(
        lambda: TinyGPT(GPTConfig(vocab=64, d=32, heads=4, layers=2)), inputs,
        wrap_options={"gemm": "torch"}, loss_fn=lambda out: out[0], lr=0.01,
    )  # fmt: skip
    _attention_is_flash(w, causal=True)


def test_masked_gpt_inference_torch_gemm():
    """Under no_grad (inference graph: the ops return only their result), several lengths."""
    from parity import EXPORTER as exporter

    torch.manual_seed(0)
    eager = MaskedGPT().eval()
    w = ORTWrap(copy.deepcopy(eager), fallback=False, exporter=exporter, gemm="torch")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in (4, 7, 3):
            args, _ = gpt_inputs(b, g)
            torch.testing.assert_close(w(*args), eager(*args), atol=1e-4, rtol=1e-4)
    assert gemm_op_counts(w).get("ortwrap_ops::linear_f32") == 9


@no_exporter
def test_gemm_option(monkeypatch):
    assert Options(gemm="torch").torch_gemm and not Options(gemm="ort").torch_gemm
    monkeypatch.setenv("ORTWRAP_GEMM", "torch")
    assert Options.resolve().gemm == "torch" and Options.resolve().torch_gemm
    with pytest.raises(ValueError, match="gemm"):
        Options(gemm="mkl")


@no_exporter
def test_auto_gemm_is_the_default():
    """``gemm="auto"``, the default, is decided per graph by measurement (test_gemm_choice.py)."""
    assert Options().gemm == "auto" and Options.resolve().torch_gemm is None


@no_exporter
def test_cpu_is_intel_reads_the_vendor():
    """(ortwrap's bf16 attention kernel still picks its GEMM library by vendor: kernels/__init__.py.)"""
    from ortwrap.cpu import cpu_is_intel

    with open("/proc/cpuinfo") as f:
        intel = "GenuineIntel" in f.read()
    assert cpu_is_intel() == intel


NAN_GUARDED_SDPA = """
    agraph (float[2, 3, 5, 8] q, float[2, 3, 8, 5] kt, float[2, 3, 5, 8] v, bool[2, 1, 5, 5] keep)
            => (float[2, 3, 5, 8] y) {
        zero = Constant <value = float {0.0}> ()
        minus = Constant <value = float {-inf}> ()
        mask = Where (keep, zero, minus)
        c = Constant <value = float {0.59460355}> ()
        qs = Mul (q, c)
        ks = Mul (kt, c)
        s = MatMul (qs, ks)
        m = Add (s, mask)
        p = Softmax <axis = -1> (m)
        nan = IsNaN (p)
        fill = Constant <value = float {FILL}> ()
        safe = Where (nan, fill, p)
        y = MatMul (safe, v)
    }
"""


@no_exporter
@pytest.mark.parametrize("fill, rewritten", [("0.0", 1), ("0.5", 0)], ids=["nan-to-zero", "nan-to-half"])
def test_attention_pattern_reads_through_the_nan_guard(fill, rewritten):
    """The exporters' SDPA with ``attn_mask`` zeroes fully masked rows with ``Where(IsNaN(p), 0, p)``
    (as flash attention's output is there): one attention_f32 node with the mask; any other fill is
    not SDPA and stays."""
    import onnx_text

    from ortwrap.ops import OPS_NAMESPACE
    from ortwrap.passes.half_matmul import TorchGemmOnCPUPass

    p = TorchGemmOnCPUPass(dtype=ir.DataType.FLOAT)
    _, after = onnx_text.run_pass(p, NAN_GUARDED_SDPA.replace("FILL", fill))
    assert p.rewritten["attention"] == rewritten
    ops = [n.op_type for n in after.graph.node if n.op_type not in ("Constant", "Where")]
    if rewritten:
        assert ops == ["ATen"], ops
        node = next(n for n in after.graph.node if n.op_type == "ATen")
        assert node.attribute[0].s.decode() == f"{OPS_NAMESPACE}::attention_f32"
        assert list(node.input[:4]) == ["q", "kt", "v", "mask"] and len(node.output) == 3
    else:
        assert "Softmax" in ops and "IsNaN" in ops, ops


CAUSAL_SDPA = """
    agraph (float[2, 3, 5, 8] q, float[2, 3, 8, 5] kt, float[2, 3, 5, 8] v) => (float[2, 3, 5, 8] y) {
        one = Constant <value = float {1.0}> ()
        shape = Constant <value = int64[2] {ROWS, 5}> ()
        ones = Expand (one, shape)
        tril = Trilu <upper = UPPER> (ones)
        zero = Constant <value = float {0.0}> ()
        above = Equal (tril, zero)
        lowest = Constant <value = float {-3.4028234663852886e+38}> ()
        mask = Where (above, lowest, zero)
        c = Constant <value = float {0.59460355}> ()
        qs = Mul (q, c)
        ks = Mul (kt, c)
        s = MatMul (qs, ks)
        m = Add (s, mask)
        p = Softmax <axis = -1> (m)
        y = MatMul (p, v)
    }
"""


@pytest.mark.parametrize(
    "upper, rows, causal", [(0, 5, True), (1, 5, False), (0, 1, False)], ids=["causal", "upper", "one-row"]
)
@no_exporter
def test_attention_pattern_finds_the_causal_mask(upper, rows, causal):
    """The exporters' ``is_causal`` mask (``Where(Trilu(ones(L, S)) == 0, lowest, 0)``, as large as the
    scores) becomes flash attention's causal mode, without the mask; another triangle, or a mask that
    broadcasts one row, stays a mask input."""
    import onnx_text

    from ortwrap.ops import OPS_NAMESPACE
    from ortwrap.passes.half_matmul import TorchGemmOnCPUPass

    p = TorchGemmOnCPUPass(dtype=ir.DataType.FLOAT)
    _, after = onnx_text.run_pass(p, CAUSAL_SDPA.replace("UPPER", str(upper)).replace("ROWS", str(rows)))
    assert p.rewritten["attention"] == 1
    (node,) = [n for n in after.graph.node if n.op_type == "ATen"]
    if causal:
        assert node.attribute[0].s.decode() == f"{OPS_NAMESPACE}::attention_causal_f32"
        assert list(node.input[:3]) == ["q", "kt", "v"] and len(node.input) == 4
        assert not {"Trilu", "Where", "Expand"} & {n.op_type for n in after.graph.node}  # the mask's nodes, gone
    else:
        assert node.attribute[0].s.decode() == f"{OPS_NAMESPACE}::attention_f32"
        assert list(node.input[:4]) == ["q", "kt", "v", "mask"]


HEADS_SDPA = """
    agraph (float[2, 5, 3, 8] q4, float[2, 5, 3, 8] k4, float[2, 5, 3, 8] v4) => (float[2, 5, 3, 8] y, int64[1] n) {
        q = Transpose <perm = [0, 2, 1, 3]> (q4)
        KT_CHAIN
        v = Transpose <perm = [0, 2, 1, 3]> (v4)
        n = Shape <start = -2, end = -1> (q)
        c = Constant <value = float {0.59460355}> ()
        qs = Mul (q, c)
        ks = Mul (kt, c)
        s = MatMul (qs, ks)
        p = Softmax <axis = -1> (s)
        o = MatMul (p, v)
        y = Transpose <perm = [0, 2, 1, 3]> (o)
    }
"""
TORCHSCRIPT_KT = "kt = Transpose <perm = [0, 2, 3, 1]> (k4)"
DYNAMO_KT = """k = Transpose <perm = [0, 2, 1, 3]> (k4)
        flat = Constant <value = int64[3] {-1, 5, 8}> ()
        k3 = Reshape (k, flat)
        kt3 = Transpose <perm = [0, 2, 1]> (k3)
        four = Constant <value = int64[4] {2, 3, 8, 5}> ()
        kt = Reshape (kt3, four)"""


@no_exporter
@pytest.mark.parametrize("kt_chain", [TORCHSCRIPT_KT, DYNAMO_KT], ids=["torchscript-kt", "dynamo-kt"])
def test_attention_pattern_reads_the_heads_layout(kt_chain):
    """q, k, v moved into heads by Transposes (k^T as either exporter writes it) and the output moved
    back: one attention_bthd_f32 on the [B, T, H, D] tensors, every Transpose gone; a Shape of the
    transposed q reads q4's shape, permuted."""
    import onnx_text

    from ortwrap.ops import OPS_NAMESPACE
    from ortwrap.passes.half_matmul import TorchGemmOnCPUPass

    p = TorchGemmOnCPUPass(dtype=ir.DataType.FLOAT)
    _, after = onnx_text.run_pass(p, HEADS_SDPA.replace("KT_CHAIN", kt_chain))
    assert p.rewritten["attention"] == 1
    (node,) = [n for n in after.graph.node if n.op_type == "ATen"]
    assert {a.name: a.s for a in node.attribute}["operator"].decode() == f"{OPS_NAMESPACE}::attention_bthd_f32"
    assert list(node.input[:4]) == ["q4", "k4", "v4", ""] and list(node.output) == ["y", node.output[1]]
    assert not any(n.op_type in ("Transpose", "MatMul", "Softmax", "Reshape") for n in after.graph.node)
    # n = Shape(q)[-2:-1] = q's T: now Slice(Gather(Shape(q4), perm), -2, -1), evaluated here
    nodes = {o: n for n in after.graph.node for o in n.output}
    value = {}
    for n in after.graph.node:
        if n.op_type == "Constant":
            value[n.output[0]] = onnx.numpy_helper.to_array(n.attribute[0].t)
        elif n.op_type == "Shape":
            assert list(n.input) == ["q4"] and not n.attribute
            value[n.output[0]] = np.array([2, 5, 3, 8])
        elif n.op_type == "Gather":
            value[n.output[0]] = value[n.input[0]][value[n.input[1]]]
        elif n.op_type == "Slice":
            value[n.output[0]] = value[n.input[0]][int(value[n.input[1]][0]) : int(value[n.input[2]][0])]
    assert nodes["n"].op_type == "Slice" and list(value["n"]) == [5]
