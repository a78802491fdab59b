"""The declarations (``ortwrap/ops/``): kernels and ops declared once, kernels checked against the C
table, every table derived from the declarations; gradients ORT lacks applied by ``TorchGradientsPass``."""

from __future__ import annotations

import onnx
import pytest
from onnx_text import run_pass

from ortwrap import kernels
from ortwrap.bridge.aten import NATIVE_PREFIX
from ortwrap.ops import (
    ATEN_GRADIENTS,
    GRADIENTS,
    KERNELS,
    OPS,
    OPS_NAMESPACE,
    KernelTableError,
    check_kernel_table,
    kernel,
    parse_signature,
)
from ortwrap.passes import kernel_patterns
from ortwrap.passes.native_cpu_kernels import _REWRITES, _RULES, NativeCPUKernelsPass
from ortwrap.passes.torch_gradients import TorchGradientsPass


def test_compiled_table_matches_declarations():
    lib = kernels.install()
    table = kernels.compiled_table(lib)
    assert table == {k.name: k.signature for k in KERNELS}


def test_drift_is_reported_by_name():
    table = {k.name: k.signature for k in KERNELS}
    table["gelu"] = "ff>f"
    del table["softmax_backward"]
    table["new_kernel"] = "f>f"
    with pytest.raises(KernelTableError) as e:
        check_kernel_table(table)
    msg = str(e.value)
    assert "gelu: _cpu.c says 'ff>f'" in msg
    assert "softmax_backward: declared in ortwrap/ops/kernels.py but not in _cpu.c" in msg
    assert "new_kernel: in _cpu.c's kOps but not declared" in msg


def test_every_forward_kernel_has_a_declared_backward_and_a_rewrite():
    for k in KERNELS:
        if k.gradient is None:
            continue
        back = kernel(k.gradient.backward)
        assert back.gradient is None
        if k.variant_of is not None:  # written in place of its kernel's nodes (passes/half_values.py)
            assert not k.replaces and (kernel(k.variant_of).replaces or kernel(k.variant_of).replaces_ops), k.name
        elif k.replaces_ops:  # written in place of some of ortwrap's PyTorch ops (passes/native_attention.py)
            for replaced in k.replaces_ops:
                namespace, op = replaced.split("::")
                assert not k.replaces and namespace == OPS_NAMESPACE and op in {o.name for o in OPS}, k.name
        else:
            assert k.replaces and hasattr(NativeCPUKernelsPass, k.rewrite)
        for op in k.replaces:
            assert k.rewrite in _REWRITES[op]
        # a rewrite written as onnxscript rules is named where the pass looks and defined where it imports
        assert (k.rewrite in _RULES) == (k.rewrite in kernel_patterns.RULES), k.name
        n_in = len(k.inputs)
        for ref in k.gradient.inputs:
            kind, index = ref[:-1].split("(")
            assert int(index) < {"GO": len(k.outputs), "I": n_in, "O": len(k.outputs)}[kind], (k.name, ref)
        assert len(k.gradient.inputs) == len(back.inputs), k.name


def test_signature_parsing():
    assert parse_signature("fff?FI>fff") == (
        [("f", False), ("f", False), ("f", True), ("F", False), ("I", False)],
        list("fff"),
    )
    with pytest.raises(ValueError):
        parse_signature("fx>f")


def test_wrong_input_count_is_refused_by_the_kernel(monkeypatch):
    """The C runner checks a node's input count against the kernel's signature."""
    import ctypes

    lib = kernels.install()
    err = ctypes.create_string_buffer(256)
    outs = (ctypes.c_void_p * 1)()
    ins = (ctypes.c_void_p * 3)()
    rc = lib.ortwrap_cpu_run(b"gelu", b"", ctypes.c_size_t(3), ins, ctypes.c_size_t(1), outs, err, ctypes.c_size_t(256))
    assert rc != 0
    assert b"the node has 3 inputs, the kernel takes 1 to 1" in err.value


def _run_pass(body: str) -> tuple[onnx.ModelProto, TorchGradientsPass]:
    p = TorchGradientsPass("cpu")
    _, model = run_pass(p, body, opset=18)
    return model, p


def test_pass_rewrites_ops_without_gradients():
    model, p = _run_pass(
        """
        g (float[2, 3] x, float[3] s) => (float[2, 3] y, float[2, 1] m) {
            h = HardSwish(x)
            e = Elu<alpha = 0.5>(h)
            y = PRelu(e, s)
            axes = Constant<value = int64[1] {1}>()
            m = ReduceMax<keepdims = 1>(y, axes)
        }
        """
    )
    assert p.rewritten == {"HardSwish": 1, "Elu": 1, "PRelu": 1, "ReduceMax": 1}
    ops = [
        onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "operator")).decode()
        for n in model.graph.node
        if n.op_type == "ATen"
    ]
    assert ops == ["ortwrap_ops::hardswish", "elu", "ortwrap_ops::prelu", "amax"]
    assert [o.name for o in model.graph.output] == ["y", "m"]


def test_pass_leaves_non_constant_axes_to_ort():
    _, p = _run_pass(
        """
        g (float[2, 3] x, int64[1] axes) => (float[2, 1] m) {
            m = ReduceMax<keepdims = 1>(x, axes)
        }
        """
    )
    assert p.rewritten == {}


def test_conv_transpose_only_on_cpu():
    assert GRADIENTS["ConvTranspose"].devices == ("cpu",)
    assert all(not op.startswith(NATIVE_PREFIX) for op in GRADIENTS)


def test_integer_cumsum_stays_ort_and_float_cumsum_keeps_its_type():
    """An integer CumSum (RoBERTa's position ids) has nothing to differentiate: ORT's kernel."""
    _, p = _run_pass(
        """
        g (int32[2, 5] m, float[2, 5] x) => (int32[2, 5] c, float[2, 5] y) {
            axis = Constant<value = int64 {1}>()
            c = CumSum(m, axis)
            y = CumSum<exclusive = 1, reverse = 1>(x, axis)
        }
        """
    )
    assert p.rewritten == {"CumSum": 1}


def test_rewrite_returning_another_type_is_refused(monkeypatch):
    """ORT reads an ATen node's result as the type the graph declares (torch's cumsum of an int32
    tensor, int64, gave RoBERTa wrong position ids instead of an error): a registry entry whose op
    returns another type is refused when the graph is built."""
    from ortwrap.errors import PassError
    from ortwrap.ops import OnnxViaTorch

    entry = OnnxViaTorch("Softplus", "_cast_Double", lambda n, v, b: [v(0), False])
    monkeypatch.setitem(GRADIENTS, "Softplus", entry)
    with pytest.raises(PassError, match=r"_cast_Double returns torch\.float64 where the graph has torch\.float32"):
        _run_pass(
            """
            g (float[2, 5] x) => (float[2, 5] y) {
                y = Softplus(x)
            }
            """
        )


def test_squeeze_ones_refuses_a_size_that_is_not_one():
    """TorchScript's squeeze(dim) of a dim ONNX lost the size of (LocalResponseNorm) runs as
    ``ortwrap_ops::squeeze_ones``: the graph after it was traced for the squeezed rank."""
    import torch

    from ortwrap.ops import define_ops

    define_ops()
    x = torch.randn(2, 1, 3)
    assert torch.ops.ortwrap_ops.squeeze_ones(x, [1]).shape == (2, 3)
    with pytest.raises(RuntimeError, match=r"squeeze\(0\) was exported for a size-1 dimension"):
        torch.ops.ortwrap_ops.squeeze_ones(x, [0])


def test_integer_reduce_made_by_an_earlier_pass_stays_ort():
    """BatchNormRunningStatsPass counts elements with ReduceProd(Shape(x)), values without an
    inferred type yet: still integer, still ORT's (an ATen ``reduce`` there left every float
    ``prod``/L1-norm gradient zero later in the process, one gradient definition per op)."""
    import onnx_ir as ir
    from onnx_text import parse

    from ortwrap.passes.batchnorm_running_stats import BatchNormRunningStatsPass

    model = ir.serde.deserialize_model(
        onnx.shape_inference.infer_shapes(
            parse(
                """
                g (float[N, 2, 4] x, float[2] s, float[2] b, float[2] m, float[2] v) => (float[N, 2, 4] y, float[2] vo) {
                    y, mo, vn = BatchNormalization<training_mode = 1, momentum = 0.9>(x, s, b, m, v)
                    vo = Identity(v)
                }
                """
            )
        )
    )
    BatchNormRunningStatsPass()(model)
    p = TorchGradientsPass("cpu")
    p(model)
    assert p.rewritten == {}
    assert any(n.op_type == "ReduceProd" for n in model.graph)


# ------------------------------------------------------------------------------ derived tables
def _new_gemm():
    """A new bf16 GEMM op declared with every property a declaration has."""
    from ortwrap.ops import Op, gradient

    forward = Op(
        "scaled_linear(Tensor x, Tensor w, Tensor? b, int[] dtypes) -> (Tensor, Tensor, Tensor)",
        lambda x, w, b, dtypes: (x, x, w),
        gradient(
            "scaled_linear_backward", ["GO(0)", "GO(2)", "O(1)", "O(2)", "I(3)"], ["GI(0)", "GI(1)", "GI(2)"], [3]
        ),
        dtype_operands=3,
        float32_form="linear_f32",
        weight_copy_output=2,
        heavy=True,
    )
    backward = Op(
        "scaled_linear_backward(Tensor? grad, Tensor? grad2, Tensor xc, Tensor wc, int[] dtypes, bool[3] output_mask) "
        "-> (Tensor, Tensor, Tensor)",
        lambda *a: a[:3],
        optional_gradients=True,
        heavy=True,
    )
    return forward, backward


def test_a_new_declaration_shows_up_in_every_derived_table():
    """Adding an op is one declaration: every table the stages read is derived from the declarations."""
    from ortwrap.ops import Kernel, derive

    forward, backward = _new_gemm()
    new_kernel = Kernel("dot", "ff>f", "x . y", heavy=True)
    t = derive((*KERNELS, new_kernel), (*OPS, forward, backward))
    fw, bw = "ortwrap_ops::scaled_linear", "ortwrap_ops::scaled_linear_backward"
    assert {fw, bw, "ortwrap_cpu::dot"} <= t.operators  # recompute may copy them
    assert {fw, bw, "ortwrap_cpu::dot"} <= t.heavy  # "cheap" recompute does not
    assert fw in t.dtype_argument_ops and t.dtype_operands[fw] == 3  # half_precision, half_values, session's arena
    assert t.torch_op_gradients[fw].backward == bw  # the ATen bridge registers it (no vjp)
    assert t.torch_op_gradients[fw].inputs == ("GO(0)", "GO(2)", "O(1)", "O(2)", "I(3)")
    assert bw in t.optional_gradient_ops
    assert t.weight_copy_output[fw] == 2 and t.weight_copy_input[bw] == 3  # recompute's weight copies
    assert forward.n_outputs == 3 and forward.operator == fw
    with pytest.raises(ValueError, match="ortwrap_ops::scaled_linear is declared twice"):
        derive(KERNELS, (*OPS, forward, backward, forward))
    # and none of it is in the tables without the declaration
    plain = derive(KERNELS, OPS)
    assert not {fw, bw, "ortwrap_cpu::dot"} & (plain.operators | plain.heavy | plain.dtype_argument_ops)


def test_the_stages_read_the_derived_tables_and_cannot_change_them():
    import dataclasses

    from ortwrap import ops
    from ortwrap.grad import aten, recompute
    from ortwrap.passes import half_precision, half_values
    from ortwrap.runtime import session

    assert ops.TABLES == ops.derive(KERNELS, OPS, ATEN_GRADIENTS)
    assert half_values._OPERANDS is ops.DTYPE_OPERANDS
    assert half_values.DTYPE_ARGUMENT_OPS is half_precision.DTYPE_ARGUMENT_OPS is session.DTYPE_ARGUMENT_OPS
    assert recompute._WEIGHT_COPY_OUTPUT is ops.WEIGHT_COPY_OUTPUT
    assert recompute._WEIGHT_COPY_INPUT is ops.WEIGHT_COPY_INPUT
    assert aten.OWN_GRADIENT_OPS is ops.OWN_GRADIENT_OPS
    for f in dataclasses.fields(ops.TABLES):
        table = getattr(ops.TABLES, f.name)
        with pytest.raises((TypeError, AttributeError)):
            table["x"] = 1
        assert not hasattr(table, "add"), f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        OPS[0].heavy = True


def test_zero3_registration_leaves_the_declarations_alone():
    """ZeRO-3's per-layer fetch ops register their own gradient (a ``grads_<n>`` node): the ATen
    bridge registers no vjp for them, read from the declarations, which nothing changes."""
    import dataclasses

    from onnx import helper

    from ortwrap import ops
    from ortwrap.grad import aten
    from ortwrap.integrations import zero3_layers

    before = {f.name: getattr(ops.TABLES, f.name) for f in dataclasses.fields(ops.TABLES)}
    snapshot = {k: (set(v) if isinstance(v, frozenset) else dict(v)) for k, v in before.items()}
    zero3_layers.define_ops()
    zero3_layers.register_gradient(2)
    assert zero3_layers.MAX_ARITY == ops.ZERO3_MAX_ARITY and zero3_layers.NAMESPACE == ops.ZERO3_NAMESPACE
    assert {k: (set(v) if isinstance(v, frozenset) else dict(v)) for k, v in before.items()} == snapshot
    assert aten.OWN_GRADIENT_OPS is ops.OWN_GRADIENT_OPS and "ortwrap_zero3::fetch_2" in ops.OWN_GRADIENT_OPS
    fetch = helper.make_node(
        "ATen", ["p0", "p1", "a", "l"], ["q0", "q1"], domain="org.pytorch.aten",
        operator="ortwrap_zero3::fetch_2", overload_name="",
    )  # fmt: skip
    graph = helper.make_graph(
        [fetch],
        "g",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2]) for n in ("p0", "p1", "a")]
        + [helper.make_tensor_value_info("l", onnx.TensorProto.INT64, [])],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2]) for n in ("q0", "q1")],
    )
    assert aten.register_gradients(helper.make_model(graph)) == []  # no vjp definition of its own


def test_cpu_arena_is_decided_by_the_declared_operators():
    """A session runs without ORT's CPU arena where a graph has an op with a dtype argument (the
    native bf16 route's GEMMs), by exact operator: a float32 ``linear_f32`` (the torch-GEMM route)
    keeps the arena. (A byte search of the serialized graph for ``ortwrap_ops::linear`` also found
    ``linear_f32``, ``linear_backward`` and any node or value whose name held those bytes.)"""
    from onnx import helper

    from ortwrap.bridge.aten import ATEN_DOMAIN
    from ortwrap.runtime.session import uses_cpu_arena

    def model(operator: str, name: str = "n"):
        node = helper.make_node(
            "ATen", ["x", "w", "b"], ["y"], name=name, domain=ATEN_DOMAIN, operator=operator, overload_name=""
        )
        graph = helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2, 2]) for n in ("x", "w", "b")],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2])],
        )
        return helper.make_model(graph)

    assert not uses_cpu_arena(model("ortwrap_ops::linear"))
    assert not uses_cpu_arena(model("ortwrap_ops::matmul"))
    assert uses_cpu_arena(model("ortwrap_ops::linear_f32"))
    assert uses_cpu_arena(model("ortwrap_ops::linear_backward"))
    assert uses_cpu_arena(model("aten::relu", name="after ortwrap_ops::linear"))


def test_ops_imports_no_stage():
    """``ops/`` is under every stage: passes, export, grad, bridge and runtime import it, not the reverse.
    It may read the names every stage shares (``graph/names.py``, which imports nothing of ortwrap)."""
    import ast
    import pathlib

    import ortwrap.ops

    allowed = {"ortwrap.errors", "ortwrap._compat.torch", "ortwrap._compat", "ortwrap.graph.names"}
    for path in pathlib.Path(ortwrap.ops.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = "ortwrap." + ("ops." if node.level == 1 else "") + (node.module or "")
                assert target.startswith("ortwrap.ops.") or target.rstrip(".") in allowed, (path.name, target)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.startswith("ortwrap") for n in names), (path.name, names)


def test_mappers_name_declared_ops():
    """Every ``ortwrap_ops::`` op a mapper runs is declared (``ops/torch_ops.py``)."""
    from ortwrap.ops import DOUBLE_PRECISION, OPERATORS

    named = {e.torch_op for e in (*GRADIENTS.values(), *DOUBLE_PRECISION.values())}
    ours = {n for n in named if n.startswith(OPS_NAMESPACE + "::")}
    assert ours and ours <= OPERATORS, ours - OPERATORS
