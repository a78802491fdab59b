"""PyTorch ops inside the ORT graph: ops without an ONNX export, and ``Options.aten_ops``, run
as ATen nodes with PyTorch's own kernels, and PyTorch's own backward as their gradient."""

from __future__ import annotations

import re

import onnx
import pytest
import torch
import torch.nn.functional as F
from parity import check_parity, seq_len
from torch import nn

import ortwrap
from ortwrap import ORTWrap


def aten_ops_in(wrapper: ORTWrap, raw: bool = False) -> list[str]:
    """The operators of the built graph's ATen nodes (without the used-outputs mark unless ``raw``)."""
    graph = wrapper.last_artifacts.graph.model().graph
    ops = (
        next(a.s.decode() for a in n.attribute if a.name == "operator")
        for n in graph.node
        if n.domain == "org.pytorch.aten" and n.op_type == "ATen"
    )
    return sorted(op if raw else re.sub(r"used=[01]+\|", "", op) for op in ops)


def vec(b, g):
    return (torch.randn(b, 4, generator=g),), {}


class NoExport(nn.Module):
    """Ops the TorchScript exporter cannot translate to ONNX at opset 17."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)
        self.op = op

    def forward(self, x):
        h = self.a(x)
        if self.op == "matrix_exp":
            h = torch.linalg.matrix_exp(0.3 * h.reshape(-1, 2, 2)).reshape(h.shape)
        elif self.op == "digamma":
            h = torch.digamma(torch.sigmoid(h) + 0.5)
        elif self.op == "logcumsumexp":
            h = torch.logcumsumexp(h, dim=1)  # a constant int argument
        return self.b(h)


@pytest.mark.parametrize("op", ["matrix_exp", "digamma", "logcumsumexp"])
def test_op_without_onnx_export_runs_as_aten_with_torch_gradient(op):
    w = check_parity(lambda: NoExport(op), vec)
    names = aten_ops_in(w)
    assert len(names) == 2 and names[1] == "ortwrap_vjp::" + names[0], names
    assert w.export_count == 1


class GeluMLP(nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)
        self.approximate = approximate

    def forward(self, x):
        return self.b(F.gelu(self.a(x), approximate=self.approximate))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_aten_ops_option_runs_gelu_with_torch_kernels(approximate):
    # A string argument ('tanh') crosses as bytes.
    w = check_parity(lambda: GeluMLP(approximate), vec, wrap_options={"aten_ops": ("gelu",)})
    assert aten_ops_in(w) == ["gelu", "ortwrap_ops::aten_gelu_backward"]  # its declared backward (ops.ATEN_GRADIENTS)


class Overloaded(nn.Module):
    """Ops with several overloads, called with int arguments: softmax(x, dim) (``softmax.int``),
    squeeze(x, 1) (``squeeze.dim``), sum(x, dims) (``sum.dim_IntList``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)

    def forward(self, x):
        h = self.a(x).reshape(x.shape[0], 1, 6)
        return torch.softmax(h, -1).squeeze(1) * h.sum([1, 2]).unsqueeze(-1)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("op", ["softmax", "squeeze", "sum"])
def test_aten_ops_option_picks_the_overload_the_arguments_fit(op, exporter):
    # Under TorchScript the exporter can leave a node without its schema: softmax(x, -1) named no
    # overload (type inference refused it), squeeze(x, 1) ran as the one-argument squeeze(). Both
    # exporters in one process: their nodes of one op share ORT's one gradient definition (dynamo
    # drops softmax's trailing dtype=None, TorchScript writes it).
    w = check_parity(Overloaded, vec, wrap_options={"aten_ops": (op,), "exporter": exporter})
    assert op in aten_ops_in(w)


class Norms(nn.Module):
    """nn.RMSNorm (no ONNX export at opset 17: an ATen node under TorchScript) and a LayerNorm whose
    weight is frozen (its gradient is an unnamed output of the gradient node)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.rms = nn.RMSNorm(8, eps=1e-6)
        self.ln = nn.LayerNorm(8)
        self.ln.weight.requires_grad_(False)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(self.ln(self.rms(self.a(x))))


@pytest.mark.usefixtures("exporter")
def test_rms_norm_and_aten_layer_norm_with_a_frozen_weight():
    # Static dims reach the ATen type inference (rms_norm checks its weight against them), and the
    # gradient builder's unnamed outputs are left unset (grad.aten.mark_used_outputs).
    import parity

    torchscript = parity.EXPORTER == "torchscript"  # aten_ops is a TorchScript option
    w = check_parity(Norms, vec, wrap_options={"aten_ops": ("layer_norm",)} if torchscript else {})
    if torchscript:
        ops = aten_ops_in(w, raw=True)
        assert "rms_norm" in ops and "layer_norm" in ops, ops
        assert any(op.startswith("ortwrap_vjp::used=") for op in ops), ops


def test_aten_embedding_with_padding_idx():
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(20, 8, padding_idx=0)
            self.head = nn.Linear(8, 20)

        def forward(self, ids):
            return self.head(torch.tanh(self.emb(ids)))

    def inputs(b, g):
        ids = torch.randint(0, 20, (b, seq_len(b, 5)), generator=g)
        ids[:, -2:] = 0
        return (ids,), {}

    w = check_parity(LM, inputs, wrap_options={"aten_ops": ("embedding",)})
    assert "embedding" in aten_ops_in(w)


def test_exception_in_aten_op_keeps_its_type_and_wrapper_keeps_working():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(2, 2)

        def forward(self, x):
            return torch.linalg.matrix_exp(self.l(x))

    m = M()
    # TorchScript: the graph has no shape guard, so the bad input reaches ORT and the ATen node.
    w = ORTWrap(m, fallback=False, exporter="torchscript")
    w(torch.randn(3, 2, 2)).sum().backward()
    bad = torch.randn(3, 3, 2)  # not square: torch's kernel raises
    with pytest.raises(Exception) as eager:
        m(bad)
    with pytest.raises(type(eager.value), match="square") as info:
        w(bad)
    # eager's own exception (issue 13: the failed ORT run is followed by an eager run of the input)
    assert "square" in str(eager.value) and str(info.value) == str(eager.value)
    x = torch.randn(5, 2, 2)
    torch.testing.assert_close(w(x), m(x))


def test_type_inference_keeps_types_ahead_of_refined_slices():
    """Type inference through ATen nodes refines Slice outputs and drops the dims ONNX invented
    after them for the next round; the values in between (a Pad with computed pads, TorchScript's
    reflection padding) must still have a type when it stops (ORT cannot type an ATen node's output)."""
    import onnx_text

    from ortwrap.export.type_inference import infer_types

    model = onnx_text.parse(
        """
        g (float[N, T, 8] x, int64[6] pads) => (float[N, T, M] y) {
            p = Pad<mode = "reflect">(x, pads)
            one = Constant<value = int64[1] {1}>()
            two = Constant<value = int64[1] {2}>()
            shape = Shape(x)
            e = Slice(shape, two, one)
            s = Slice(p, one, e, two)
            y = Mul(s, s)
        }
        """
    )
    typed = {v.name: v.type.tensor_type for v in infer_types(model).graph.value_info}
    assert typed["p"].elem_type == onnx.TensorProto.FLOAT and len(typed["p"].shape.dim) == 3
    assert typed["s"].elem_type == onnx.TensorProto.FLOAT


# NOTE: ORT owns the buffers of an ATen node's inputs; its memory planner reuses an input's buffer
# for a later value once the node has run. A result that is a view of an input (the vjp of a
# reshape, an unsqueeze, ``squeeze_ones``, a clone's identity gradient) would be overwritten while
# a later node still reads it: recompute="cheap" gave LocalResponseNorm gradients off by tens that
# way (tests/test_recompute.py::test_recompute_pooled_normalization_torchscript).
_VJP_CASES = {
    "squeeze_ones": ("ortwrap_vjp::used=10|ortwrap_ops::squeeze_ones", "", [(2, 4, 3), (2, 1, 4, 3), [1]], 2),
    "unsqueeze": ("ortwrap_vjp::used=10|unsqueeze", "", [(2, 1, 4), (2, 4), 1], 2),
    "reshape": ("ortwrap_vjp::used=10|reshape", "", [(8,), (2, 4), [8]], 2),
    "clone": ("ortwrap_vjp::used=1|clone", "", [(4, 2), (4, 2)], 1),
    "transpose": ("ortwrap_vjp::used=100|transpose", "int", [(4, 2), (2, 4), 0, 1], 3),
}


@pytest.mark.parametrize("case", sorted(_VJP_CASES))
def test_aten_vjp_results_never_share_an_input_buffer(case):
    """The ATen executor, called as ORT calls it (DLPack in, DLPack out), returns gradients in memory
    of their own, with PyTorch's values."""
    from torch.utils.dlpack import from_dlpack, to_dlpack

    from ortwrap.bridge import aten

    op, overload, specs, n_out = _VJP_CASES[case]
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen) if isinstance(s, tuple) else torch.tensor(s) for s in specs]
    out = aten._execute(op, overload, tuple(to_dlpack(t) for t in tensors), n_out)
    assert out is not None
    grads = [from_dlpack(c) for c in out if c is not None]
    assert len(grads) == 1
    inputs = {t.untyped_storage().data_ptr() for t in tensors}
    assert grads[0].untyped_storage().data_ptr() not in inputs
    # The values are PyTorch's: the output gradient brought back to the input's shape.
    torch.testing.assert_close(grads[0], tensors[0].reshape(grads[0].shape) if case != "transpose" else tensors[0].t())


_wrong_dtype_lib = None


def _wrong_dtype_op():
    """``ortwrap_test::wrong_dtype(x)``: its Meta kernel says float32, its CPU kernel returns float64."""
    global _wrong_dtype_lib
    if _wrong_dtype_lib is None:
        lib = torch.library.Library("ortwrap_test", "DEF")
        lib.define("wrong_dtype(Tensor x) -> Tensor")
        lib.impl("wrong_dtype", lambda x: (x * 2).double(), "CPU")
        lib.impl("wrong_dtype", lambda x: torch.empty_like(x), "Meta")
        _wrong_dtype_lib = lib
    return torch.ops.ortwrap_test.wrong_dtype


class WrongDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return _wrong_dtype_op()(self.a(x))


@pytest.mark.parametrize("fallback", [False, True])
def test_an_aten_node_returning_another_dtype_than_inferred_is_not_silent(fallback):
    # An ATen node (an op without a translation) whose kernel returns float64 where type inference
    # found float32: the first run says so (a fallback with a warning, or the error), instead of
    # handing the user a tensor of a dtype the graph does not declare.
    model = WrongDtype()
    w = ORTWrap(model, fallback=fallback, exporter="dynamo")
    x = torch.randn(3, 4)
    with torch.no_grad():
        if fallback:
            with pytest.warns(ortwrap.FallbackWarning, match=r"came back as torch\.float64 where the graph declares"):
                out = w(x)
            assert out.dtype == torch.float64 and w.fallback_reason is not None
        else:
            with pytest.raises(ortwrap.RuntimeRunError, match=r"came back as torch\.float64 where the graph declares"):
                w(x)
