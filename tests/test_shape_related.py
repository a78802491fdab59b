"""Tests for ortwrap.passes.shape_related: which nodes compute values that kernels read on the host."""

from __future__ import annotations

import onnx
import onnx.defs
import onnx.parser
import onnx_text
import pytest

from ortwrap.passes import explain_shape_related_nodes, shape_related_nodes
from ortwrap.passes.shape_related import HOST_INPUTS, SCOPE_SEPARATOR, host_inputs


def _model(body: str, opset: int = 18) -> onnx.ModelProto:
    return onnx_text.parse(body, opset, check=True)


def test_upstream_example_reshape_of_concat_of_graph_inputs() -> None:
    # ORT PR #19769: the shape-producing nodes start at graph inputs, not at Shape.
    model = _model("""
        g (float[N] x, int64 dim0, int64 dim1) => (float[A, B] y) {
          [zero] zero = Constant<value_ints = [0]>()
          [unsq0] d0 = Unsqueeze(dim0, zero)
          [add] total = Add(dim0, dim1)
          [unsq1] d1 = Unsqueeze(total, zero)
          [concat] shape = Concat<axis = 0>(d0, d1)
          [reshape] y = Reshape(x, shape)
        }
    """)
    assert shape_related_nodes(model) == {"zero", "unsq0", "add", "unsq1", "concat"}


def test_walk_stops_at_shape() -> None:
    model = _model("""
        g (float[N, K] a, float[K, M] b) => (float[P, Q] y) {
          [matmul] h = MatMul(a, b)
          [shape] s = Shape(h)
          [idx] i0 = Constant<value_int = 0>()
          [gather] n = Gather<axis = 0>(s, i0)
          [axes] ax = Constant<value_ints = [0]>()
          [unsq] n1 = Unsqueeze(n, ax)
          [minus1] m1 = Constant<value_ints = [-1]>()
          [concat] shape = Concat<axis = 0>(n1, m1)
          [reshape] y = Reshape(h, shape)
        }
    """)
    assert shape_related_nodes(model) == {"shape", "idx", "gather", "axes", "unsq", "minus1", "concat"}


def test_slice_range_constant_of_shape() -> None:
    model = _model("""
        g (float[N, K] x, int64 limit) => (float[P, K] s, float[M] r, float[A, B] z) {
          [shape] sh = Shape(x)
          [start] st = Constant<value_ints = [1]>()
          [end] en = Slice(sh, st, st)
          [slice] s = Slice(x, st, en)
          [zero] r0 = Constant<value_float = 0.0>()
          [one] r1 = Constant<value_float = 1.0>()
          [twice] lim2 = Add(limit, limit)
          [cast] limf = Cast<to = 1>(lim2)
          [range] r = Range(r0, limf, r1)
          [cos] z = ConstantOfShape<value = float {0.0}>(sh)
        }
    """)
    report = explain_shape_related_nodes(model)
    assert set(report) == {"shape", "start", "end", "zero", "one", "twice", "cast"}
    assert report["end"].reasons == ("slice input 2 (ends)",)
    assert report["shape"].reasons == ("cos input 0 (input)", "slice input 2 (ends)")
    assert "range input 1 (limit)" in report["cast"].reasons
    assert "slice" not in report and "range" not in report and "cos" not in report


def test_implicit_outer_scope_input_of_if_branch() -> None:
    model = _model("""
        g (float[N] x, bool c, int64 rows) => (float[M, K] y) {
          [axes] ax = Constant<value_ints = [0]>()
          [unsq] r = Unsqueeze(rows, ax)
          [minus1] m1 = Constant<value_ints = [-1]>()
          [concat] shape = Concat<axis = 0>(r, m1)
          [if] y = If(c) <
            then_branch = then_g () => (float[M, K] ty) {
              [inner_reshape] ty = Reshape(x, shape)
            },
            else_branch = else_g () => (float[M, K] ey) {
              [inner_const] two = Constant<value_ints = [2, -1]>()
              [inner_reshape2] ey = Reshape(x, two)
            }
          >
        }
    """)
    report = explain_shape_related_nodes(model)
    inner_const = SCOPE_SEPARATOR.join(["if", "else_branch", "inner_const"])
    assert set(report) == {"axes", "unsq", "minus1", "concat", inner_const}
    reshape = SCOPE_SEPARATOR.join(["if", "then_branch", "inner_reshape"])
    assert report["concat"].reasons == (f"{reshape} input 1 (shape)",)


def test_explicit_loop_carried_input() -> None:
    # The body's Reshape reads a loop-carried shape; its initial value is computed outside.
    model = _model("""
        g (float[N] x, int64 trip, int64 rows) => (int64[S] final_shape, float[T, A, B] ys) {
          [axes] ax = Constant<value_ints = [0]>()
          [unsq] r = Unsqueeze(rows, ax)
          [cond] c = Constant<value = bool {1}>()
          [loop] final_shape, ys = Loop(trip, c, r) <
            body = body_g (int64 i, bool ci, int64[S] s_in) => (bool co, int64[S] s_out, float[A, B] y) {
              [keep] co = Identity(ci)
              [pass] s_out = Identity(s_in)
              [inner_reshape] y = Reshape(x, s_in)
            }
          >
        }
    """)
    loop = lambda name: SCOPE_SEPARATOR.join(["loop", "body", name])  # noqa: E731
    assert shape_related_nodes(model) == {"axes", "unsq", "cond", loop("keep"), loop("pass")}


def test_mixed_node_is_returned_and_flagged() -> None:
    model = _model("""
        g (float[N] x, int64[2] dims, float[2] w) => (float[A, B] y, float[2] z) {
          [abs] shape = Abs(dims)
          [reshape] y = Reshape(x, shape)
          [cast] f = Cast<to = 1>(shape)
          [add] z = Add(f, w)
        }
    """)
    report = explain_shape_related_nodes(model)
    assert set(report) == {"abs"}
    assert report["abs"].mixed
    assert report["abs"].device_uses == ("cast input 0",)
    assert report["abs"].reasons == ("reshape input 1 (shape)",)


def test_pure_shape_node_is_not_mixed() -> None:
    model = _model("""
        g (float[N] x, int64[2] dims) => (float[A, B] y) {
          [abs] shape = Abs(dims)
          [neg] shape2 = Neg(shape)
          [reshape] y = Reshape(x, shape2)
        }
    """)
    report = explain_shape_related_nodes(model)
    assert set(report) == {"abs", "neg"}
    assert not report["abs"].mixed and not report["neg"].mixed


def test_pad_constant_value_is_not_walked() -> None:
    model = _model("""
        g (float[N] x, int64[2] pads) => (float[M] y) {
          [abs] p = Abs(pads)
          [reduce] v = ReduceMax<keepdims = 0>(x)
          [pad] y = Pad(x, p, v)
        }
    """)
    assert shape_related_nodes(model) == {"abs"}


def test_input_that_is_an_attribute_at_this_opset_is_not_shape_like() -> None:
    # Squeeze-11 has one input; axes is an attribute. A second input there is not a shape input.
    assert host_inputs("", "Squeeze", 11).shape == {}
    assert host_inputs("", "Squeeze", 13).shape == {1: "axes"}
    assert host_inputs("", "Slice", 9).shape == {}
    model = _model(
        """
        g (float[1, N] x) => (float[N] y) {
          [abs] x2 = Abs(x)
          [squeeze] y = Squeeze<axes = [0]>(x2)
        }
        """,
        opset=11,
    )
    assert shape_related_nodes(model) == set()
    # ReduceMax-17 takes axes as an attribute, ReduceSum-13 as an input.
    assert host_inputs("", "ReduceMax", 17).shape == {}
    assert host_inputs("", "ReduceSum", 13).shape == {1: "axes"}


def test_unnamed_nodes_are_reported_by_position() -> None:
    model = _model("""
        g (float[N] x, int64[2] dims) => (float[A, B] y) {
          shape = Abs(dims)
          y = Reshape(x, shape)
        }
    """)
    assert shape_related_nodes(model) == {"<Abs>#0"}


def _table_entries() -> list[tuple[str, str, int, str, int, str]]:
    rows = []
    for (domain, op), entries in HOST_INPUTS.items():
        for entry in entries:
            last = entry.until if entry.until is not None else onnx.defs.onnx_opset_version()
            for opset in sorted({entry.since, last}):
                for kind in ("shape", "host_data", "metadata"):
                    for index, name in getattr(entry, kind).items():
                        rows.append((domain, op, opset, kind, index, name))
    return rows


@pytest.mark.parametrize(
    ("domain", "op", "opset", "kind", "index", "name"),
    _table_entries(),
    ids=lambda v: str(v),
)
def test_table_matches_onnx_schema(domain: str, op: str, opset: int, kind: str, index: int, name: str) -> None:
    schema = onnx.defs.get_schema(op, opset, domain)
    assert index < len(schema.inputs), f"{op}-{schema.since_version} has {len(schema.inputs)} inputs"
    assert schema.inputs[index].name == name


def test_table_ranges_start_where_the_input_appears() -> None:
    # At the opset just before each first entry, the named input does not exist (it was an
    # attribute or the op did not exist), so the table does not start too late.
    for (domain, op), entries in HOST_INPUTS.items():
        first = entries[0]
        names = {**first.shape, **first.host_data, **first.metadata}
        if first.since <= 1:
            continue
        try:
            schema = onnx.defs.get_schema(op, first.since - 1, domain)
        except onnx.defs.SchemaError:
            continue
        previous = {i.name for i in schema.inputs}
        assert not set(names.values()) <= previous, f"{op}: inputs {names} already exist before {first.since}"


def test_loop_condition_is_read_on_the_host() -> None:
    model = _model("""
        g (float[N] x, int64 trip) => (float[N] y) {
          [cond] c = Constant<value = bool {1}>()
          [loop] y = Loop(trip, c, x) <
            body = body_g (int64 i, bool ci, float[N] v) => (bool co, float[N] w) {
              [limit] lim = Constant<value = int64 {3}>()
              [less] co = Less(i, lim)
              [double] w = Add(v, v)
            }
          >
        }
    """)
    report = explain_shape_related_nodes(model)
    less = SCOPE_SEPARATOR.join(["loop", "body", "less"])
    assert set(report) == {"cond", less, SCOPE_SEPARATOR.join(["loop", "body", "limit"])}
    assert report[less].reasons == ("loop body output 0 (cond)",)
    assert not report[less].mixed


def test_if_output_used_as_shape_collects_the_if_and_its_branches() -> None:
    model = _model("""
        g (float[N] x, bool c) => (float[A, B] y) {
          [if] shape = If(c) <
            then_branch = then_g () => (int64[2] a) { [then_const] a = Constant<value_ints = [2, -1]>() },
            else_branch = else_g () => (int64[2] b) { [else_const] b = Constant<value_ints = [-1, 2]>() }
          >
          [reshape] y = Reshape(x, shape)
        }
    """)
    assert shape_related_nodes(model) == {
        "if",
        SCOPE_SEPARATOR.join(["if", "then_branch", "then_const"]),
        SCOPE_SEPARATOR.join(["if", "else_branch", "else_const"]),
    }
