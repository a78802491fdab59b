"""The aggressive CPU fallback: splitting shape computations into a host program, and training with it.

Hand-built graphs check the split itself: the main graph fed by the host program must compute
exactly what the original graph computes, for several input shapes and values. Whole models check
training parity with eager PyTorch with the flag on, over changing batch sizes and sequence
lengths, and that nodes really left the graph.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx.parser
import onnx_text
import onnxruntime as ort
import pytest
import torch
from parity import check_parity
from tiny_gpt import GPTConfig, TinyGPT
from tiny_llama import LlamaBlock, LlamaConfig

from ortwrap import Options, ORTWrap, PassError, SessionError
from ortwrap.passes.host_shapes import HostFeed, HostShapeSplit, split_host_shapes
from ortwrap.runtime.host_shapes import HostShapeRunner

# ---------------------------------------------------------------------------------------------- helpers


def _model(body: str, opset: int = 18) -> onnx.ModelProto:
    return onnx_text.parse(body, opset, check=True)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def _split_and_compare(
    model: onnx.ModelProto, cases: list[dict[str, np.ndarray]], user_inputs: set[str] | None = None
) -> tuple[onnx.ModelProto, HostShapeSplit]:
    """Split ``model``; for every case, assert main(host(inputs)) == original(inputs), exactly."""
    main, split = split_host_shapes(model, user_inputs)
    onnx.checker.check_model(main)
    names = [i.name for i in model.graph.input]
    runner = HostShapeRunner(split, {n: i for i, n in enumerate(names) if user_inputs is None or n in user_inputs})
    for case in cases:
        expected = _run(model, case)
        leaves = [torch.from_numpy(case[n]) for n in names]
        host = runner(leaves)
        assert len(host) == len(split.feeds)
        feeds = {**case, **{f.name: t.numpy() for f, t in zip(split.feeds, host)}}
        actual = _run(main, feeds)
        assert len(actual) == len(expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert a.shape == e.shape, f"output {i}: shape {a.shape} != {e.shape} for {case.keys()}"
            np.testing.assert_array_equal(a, e, err_msg=f"output {i}")
    return main, split


def _node_names(model: onnx.ModelProto) -> set[str]:
    return {n.name for n in model.graph.node}


def _placement(split: HostShapeSplit) -> dict[str, str]:
    return {name: p.placement for name, p in split.placements.items()}


# ---------------------------------------------------------------------------------------------- hand-built graphs


def test_upstream_example_reshape_of_concat_of_dims_fed_as_inputs() -> None:
    # ORT PR #19769: Reshape(x, Concat(dim0, dim0 + dim1)) with the dims as graph inputs.
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
    x = np.arange(12, dtype=np.float32)
    cases = [
        {"x": x, "dim0": np.array(2, np.int64), "dim1": np.array(4, np.int64)},
        {"x": x, "dim0": np.array(3, np.int64), "dim1": np.array(1, np.int64)},
        {"x": x[:6], "dim0": np.array(1, np.int64), "dim1": np.array(5, np.int64)},
    ]
    main, split = _split_and_compare(model, cases)
    assert _node_names(main) == {"reshape"}
    assert _placement(split) == {
        "unsq0": "host",
        "add": "host",
        "unsq1": "host",
        "concat": "host",
        "zero": "constant",
    }
    assert _node_names(split.program) == {"zero", "unsq0", "add", "unsq1", "concat"}
    assert split.feeds == (HostFeed("shape", "program", index=0),)
    assert [(f.name, f.kind) for f in split.program_inputs] == [("dim0", "value"), ("dim1", "value")]
    # The new graph input keeps the crossing value's name and inferred type.
    new_input = main.graph.input[-1]
    assert new_input.name == "shape"
    assert new_input.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert [d.dim_value for d in new_input.type.tensor_type.shape.dim] == [2]
    assert split.placements["concat"].reasons == ("reshape input 1 (shape)",)


def test_shape_gather_unsqueeze_concat_of_a_graph_input_becomes_a_python_feed() -> None:
    model = _model("""
        g (float[N, K] x) => (float[P, Q] y) {
          [shape] s = Shape(x)
          [idx] i0 = Constant<value_int = 0>()
          [gather] n = Gather<axis = 0>(s, i0)
          [axes] ax = Constant<value_ints = [0]>()
          [unsq] n1 = Unsqueeze(n, ax)
          [minus1] m1 = Constant<value_ints = [-1]>()
          [concat] shape = Concat<axis = 0>(n1, m1)
          [reshape] y = Reshape(x, shape)
        }
    """)
    cases = [{"x": np.random.default_rng(0).random((n, k), dtype=np.float32)} for n, k in ((2, 3), (5, 1), (1, 7))]
    main, split = _split_and_compare(model, cases)
    assert _node_names(main) == {"reshape"}
    placement = _placement(split)
    assert placement["shape"] == "python"
    assert {placement[n] for n in ("gather", "unsq", "concat")} == {"host"}
    assert split.program_inputs == (HostFeed("s", "shape", "x", 0, None),)
    assert "Shape" not in {n.op_type for n in split.program.graph.node}


def test_shape_start_end_and_size_are_honoured() -> None:
    model = _model(
        """
        g (float[A, B, C] x) => (float[P, Q] y, float[S] z) {
          [tail] t = Shape<start = 1>(x)
          [mid] m = Shape<start = -3, end = -2>(x)
          [prod] p = ReduceProd<keepdims = 1>(t)
          [concat] shape = Concat<axis = 0>(m, p)
          [reshape] y = Reshape(x, shape)
          [size] n = Size(x)
          [axes] ax = Constant<value_ints = [0]>()
          [unsq] n1 = Unsqueeze(n, ax)
          [flat] z = Reshape(x, n1)
        }
        """,
        opset=18,
    )
    rng = np.random.default_rng(1)
    # y reshapes (A, B, C) to (A, B * C); z flattens x.
    cases = [{"x": rng.random((a, b, c), dtype=np.float32)} for a, b, c in ((1, 2, 3), (3, 4, 1), (2, 1, 5))]
    main, split = _split_and_compare(model, cases)
    assert _node_names(main) == {"reshape", "flat"}
    inputs = {f.name: f for f in split.program_inputs}
    assert inputs["t"] == HostFeed("t", "shape", "x", 1, None)
    assert inputs["m"] == HostFeed("m", "shape", "x", -3, -2)
    assert inputs["n"] == HostFeed("n", "size", "x")


def test_shape_of_an_intermediate_value_stays_with_its_reason() -> None:
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
    main, split = split_host_shapes(model)
    assert split.moved == {} and split.program is None and split.feeds == ()
    assert _node_names(main) == _node_names(model)
    assert "intermediate value 'h'" in split.placements["shape"].why
    assert "'shape'" in split.placements["gather"].why and "stays in the main graph" in split.placements["gather"].why
    assert split.placements["idx"].placement == "constant"


def test_slice_range_constant_of_shape() -> None:
    model = _model("""
        g (float[N, K] x, int64 limit) => (float[P, K] s, float[M] r, float[A, B] z) {
          [shape] sh = Shape(x)
          [start] st = Constant<value_ints = [1]>()
          [two] st2 = Constant<value_ints = [2]>()
          [end] en = Slice(sh, st, st2)
          [slice] s = Slice(x, st, en)
          [zero] r0 = Constant<value_float = 0.0>()
          [one] r1 = Constant<value_float = 1.0>()
          [twice] lim2 = Add(limit, limit)
          [cast] limf = Cast<to = 1>(lim2)
          [range] r = Range(r0, limf, r1)
          [cos] z = ConstantOfShape<value = float[1] {2.5}>(sh)
        }
    """)
    rng = np.random.default_rng(2)
    cases = [
        {"x": rng.random((n, k), dtype=np.float32), "limit": np.array(lim, np.int64)}
        for n, k, lim in ((3, 2, 2), (6, 4, 5), (2, 3, 0))
    ]
    main, split = _split_and_compare(model, cases)
    assert _node_names(main) == {"slice", "range", "cos", "start", "zero", "one"}
    placement = _placement(split)
    assert placement["shape"] == "python" and placement["end"] == "host"
    assert placement["twice"] == "host" and placement["cast"] == "host"
    # `start` feeds both the host Slice and the main one: copied into the program, kept for ORT.
    assert placement["start"] == "constant" and "start" in _node_names(split.program)
    # Shape(x) feeds ConstantOfShape directly: it crosses as a python feed, not a program output.
    assert HostFeed("sh", "shape", "x", 0, None) in split.feeds


def test_if_branch_reading_a_moved_value_from_the_outer_scope() -> None:
    # The If stays (its output is data); the Concat it reads implicitly moves, and the branch
    # then reads the new graph input of the same name.
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
    x = np.arange(12, dtype=np.float32)
    cases = [
        {"x": x, "c": np.array(flag), "rows": np.array(rows, np.int64)} for flag in (True, False) for rows in (3, 4, 6)
    ]
    main, split = _split_and_compare(model, cases)
    assert _node_names(main) == {"if"}
    assert _placement(split)["concat"] == "host"
    assert split.placements["if|else_branch|inner_const"].placement == "subgraph"
    assert [f.name for f in split.feeds] == ["shape"]


def test_if_computing_a_shape_moves_whole() -> None:
    model = _model("""
        g (float[N] x, int64 n) => (float[A, B] y) {
          [two] two = Constant<value = int64 {2}>()
          [gt] big = Greater(n, two)
          [if] shape = If(big) <
            then_branch = then_g () => (int64[2] a) {
              [axes] ax = Constant<value_ints = [0]>()
              [then_unsq] a0 = Unsqueeze(n, ax)
              [then_m1] m1 = Constant<value_ints = [-1]>()
              [then_concat] a = Concat<axis = 0>(a0, m1)
            },
            else_branch = else_g () => (int64[2] b) { [else_const] b = Constant<value_ints = [-1, 2]>() }
          >
          [reshape] y = Reshape(x, shape)
        }
    """)
    x = np.arange(12, dtype=np.float32)
    cases = [{"x": x, "n": np.array(n, np.int64)} for n in (1, 2, 3, 4, 6)]
    main, split = _split_and_compare(model, cases)
    assert _node_names(main) == {"reshape"}
    assert _placement(split)["if"] == "host"
    assert split.placements["if|then_branch|then_unsq"].placement == "host"
    assert "if" in _node_names(split.program)


def test_mixed_node_moves_and_feeds_both_consumers() -> None:
    model = _model("""
        g (float[N] x, int64[2] dims, float[2] w) => (float[A, B] y, float[2] z) {
          [abs] shape = Abs(dims)
          [reshape] y = Reshape(x, shape)
          [cast] f = Cast<to = 1>(shape)
          [add] z = Add(f, w)
        }
    """)
    x = np.arange(12, dtype=np.float32)
    w = np.array([0.5, -1.0], np.float32)
    cases = [{"x": x, "dims": np.array(d, np.int64), "w": w} for d in ([3, 4], [-2, 6], [12, 1])]
    main, split = _split_and_compare(model, cases)
    assert split.placements["abs"].placement == "host"
    assert split.placements["abs"].device_uses == ("cast input 0",)
    assert _node_names(main) == {"reshape", "cast", "add"}
    consumers = {n.name for n in main.graph.node if "shape" in n.input}
    assert consumers == {"reshape", "cast"}
    assert "mixed, device uses: cast input 0" in split.summary()


def test_device_data_and_parameters_are_not_read_on_the_host() -> None:
    model = _model("""
        g (float[N] x, float limf, int64[2] p, float[3] w) => (float[M] r, float[A, B] y, float[C] z) {
          [zero] r0 = Constant<value_float = 0.0>()
          [one] r1 = Constant<value_float = 1.0>()
          [double] lim2 = Add(limf, limf)
          [range] r = Range(r0, lim2, r1)
          [abs] shape = Abs(p)
          [reshape] y = Reshape(x, shape)
          [wshape] ws = Shape(w)
          [wz] z = ConstantOfShape<value = float[1] {1.0}>(ws)
        }
    """)
    main, split = split_host_shapes(model, user_inputs={"x", "limf"})
    placement = _placement(split)
    assert placement["double"] == "kept"
    assert "FLOAT input 'limf' by value (device data)" in split.placements["double"].why
    assert placement["abs"] == "kept"
    assert "parameter/buffer 'p' by value" in split.placements["abs"].why
    # Shape of a parameter with a static shape is a constant: ORT folds it.
    assert placement["wshape"] == "constant"
    assert split.moved == {} and _node_names(main) == _node_names(model)


def test_random_and_graph_output_nodes_stay() -> None:
    model = _model("""
        g (float[N] x, int64 n) => (float[A, B] y, int64[2] shape, float[C] z) {
          [axes] ax = Constant<value_ints = [0]>()
          [unsq] n1 = Unsqueeze(n, ax)
          [minus1] m1 = Constant<value_ints = [-1]>()
          [concat] shape = Concat<axis = 0>(n1, m1)
          [reshape] y = Reshape(x, shape)
          [rnd] r = RandomUniform<shape = [1], low = 1.0, high = 1.5, seed = 1.0>()
          [floor] f = Floor(r)
          [cast] c = Cast<to = 7>(f)
          [add] c2 = Add(c, n1)
          [cos] z = ConstantOfShape<value = float[1] {1.0}>(c2)
        }
    """)
    x = np.arange(6, dtype=np.float32)
    main, split = _split_and_compare(model, [{"x": x, "n": np.array(k, np.int64)} for k in (2, 3)])
    assert split.placements["concat"].placement == "kept"
    assert split.placements["concat"].why == "its output is a graph output"
    assert split.placements["unsq"].placement == "host"
    assert split.placements["rnd"].placement == "kept"
    assert "draws random numbers" in split.placements["rnd"].why
    assert split.placements["add"].placement == "kept"
    assert {"rnd", "floor", "cast", "add", "concat"} <= _node_names(main)


def test_split_names_bad_arguments() -> None:
    model = _model("""
        g (float[N] x, int64 n) => (float[A] y) {
          [axes] ax = Constant<value_ints = [0]>()
          [u] n1 = Unsqueeze(n, ax)
          [u] y = Reshape(x, n1)
        }
    """)
    with pytest.raises(PassError, match=r"user input\(s\) \['nope'\] are not inputs of the graph"):
        split_host_shapes(model, user_inputs={"x", "nope"})
    with pytest.raises(PassError, match="two nodes are named 'u'"):
        split_host_shapes(model)


def test_runner_caches_by_shape_and_value_and_names_bad_sources() -> None:
    model = _model("""
        g (float[N] x, int64 dim0) => (float[A, B] y) {
          [shape] s = Shape(x)
          [zero] z = Constant<value_ints = [0]>()
          [unsq] d0 = Unsqueeze(dim0, z)
          [div] d1 = Div(s, d0)
          [concat] shape = Concat<axis = 0>(d0, d1)
          [reshape] y = Reshape(x, shape)
        }
    """)
    _, split = split_host_shapes(model)
    runner = HostShapeRunner(split, {"x": 0, "dim0": 1})
    x = torch.arange(12.0)
    a = runner([x, torch.tensor(3)])
    assert a[0].tolist() == [3, 4] and a[0].device.type == "cpu"
    assert runner([x, torch.tensor(3)]) is a and runner.runs == 1  # cached
    assert runner([x, torch.tensor(4)])[0].tolist() == [4, 3] and runner.runs == 2  # a new value
    assert runner([torch.arange(8.0), torch.tensor(4)])[0].tolist() == [4, 2] and runner.runs == 3  # a new shape
    with pytest.raises(SessionError, match="computed from 'dim0', which is not a user input"):
        HostShapeRunner(split, {"x": 0})


# ---------------------------------------------------------------------------------------------- option


def test_option_is_off_by_default_and_read_from_both_environment_names(monkeypatch) -> None:
    monkeypatch.delenv("ORT_AGGRESSIVE_CPU_FALLBACK", raising=False)
    assert Options.resolve().aggressive_cpu_fallback is False
    assert Options.resolve(aggressive_cpu_fallback=True).aggressive_cpu_fallback is True
    monkeypatch.setenv("ORT_AGGRESSIVE_CPU_FALLBACK", "1")
    assert Options.resolve().aggressive_cpu_fallback is True
    assert Options.resolve(aggressive_cpu_fallback=False).aggressive_cpu_fallback is False
    monkeypatch.setenv("ORTWRAP_AGGRESSIVE_CPU_FALLBACK", "0")  # ortwrap's own name wins
    assert Options.resolve().aggressive_cpu_fallback is False
    monkeypatch.delenv("ORTWRAP_AGGRESSIVE_CPU_FALLBACK")
    monkeypatch.setenv("ORT_AGGRESSIVE_CPU_FALLBACK", "sometimes")
    with pytest.raises(ValueError, match="ORT_AGGRESSIVE_CPU_FALLBACK='sometimes' is invalid"):
        Options.resolve()


def test_flag_off_builds_no_host_program(monkeypatch) -> None:
    monkeypatch.delenv("ORT_AGGRESSIVE_CPU_FALLBACK", raising=False)
    w = ORTWrap(LlamaBlock(_LLAMA), fallback=False)
    w(torch.randn(2, 5, _LLAMA.d)).sum().backward()
    assert w.last_artifacts.host_shapes is None
    assert "HostShapeSplitPass" not in {r.name for r in w.last_artifacts.passes}
    program = next(iter(w.programs()))
    assert program.host_shapes_runner is None  # nothing added per step


# ---------------------------------------------------------------------------------------------- whole models

_LLAMA = LlamaConfig(d=32, heads=4, hidden=64, max_len=16)
_SEQ = {4: 8, 7: 5, 3: 11, 2: 16}  # batch size -> sequence length: both change every step


def _llama_inputs(b: int, g: torch.Generator):
    return (torch.randn(b, _SEQ[b], _LLAMA.d, generator=g),), {}


def _moved_ops(w: ORTWrap) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in w.last_artifacts.host_shapes.moved.values():
        counts[p.op_type] = counts.get(p.op_type, 0) + 1
    return counts


def test_llama_block_training_parity_with_changing_batch_and_sequence(tmp_path) -> None:
    w = check_parity(
        lambda: LlamaBlock(_LLAMA),
        _llama_inputs,
        batch_sizes=(4, 7, 3, 2),
        lr=0.01,  # at 0.05 the block's float32 gradients drift past the tolerance, with the flag on or off
        wrap_options={"aggressive_cpu_fallback": True, "debug_dir": str(tmp_path)},
    )
    assert w.export_count == 1, "a new sequence length must not re-export"
    art = w.last_artifacts
    split = art.host_shapes
    # x.shape (b, t, d) is read three times: every Shape of the input is now a python feed, and the
    # Reshape shapes, the rotary table's Slice ends and the causal mask's ConstantOfShape input
    # are computed by the shape program.
    moved = _moved_ops(w)
    assert moved.get("Shape") == 3 and moved.get("Concat", 0) >= 4 and moved.get("Gather", 0) >= 3, moved
    assert not any(n.op_type == "Shape" and n.input[0] == "input:x" for n in art.pre_grad.graph.node)
    # rotate_half's q.shape/k.shape: intermediate values, kept (LinearToGemmPass's reshapes of
    # intermediate activations add their own Shape nodes on CPU, not counted here)
    kept = [n for n in art.pre_grad.graph.node if n.op_type == "Shape" and "/ortwrap/" not in n.name]
    assert len(kept) == 2, [n.name for n in kept]
    reasons = {r for p in split.moved.values() for r in p.reasons}
    assert any("ConstantOfShape input 0 (input)" in r for r in reasons)
    assert any("Slice input 2 (ends)" in r for r in reasons)
    assert any("Reshape input 1 (shape)" in r for r in reasons)
    feed_names = {f.name for f in split.feeds}
    assert feed_names <= {i.name for i in art.pre_grad.graph.input}
    assert feed_names <= set(art.graph.feed_names)
    # The debug files say what moved and why.
    report = (tmp_path / "build01_train_host_shapes.txt").read_text()
    assert "moved into the shape program" in report and "because /module/Reshape input 1 (shape)" in report
    program = onnx.load(str(tmp_path / "build01_train_host_shapes.onnx"))
    assert {n.name for n in program.graph.node} >= {p.name for p in split.moved.values() if p.placement == "host"}
    # The program ran once per distinct (batch, sequence) shape, not once per step.
    runner = next(iter(w.programs())).host_shapes_runner
    assert runner.runs == 4


def test_flag_on_and_off_give_identical_numerics() -> None:
    torch.manual_seed(0)
    base = LlamaBlock(_LLAMA)
    results = []
    for flag in (False, True):
        model = ORTWrap(LlamaBlock(_LLAMA), fallback=False, aggressive_cpu_fallback=flag)
        model.module.load_state_dict(base.state_dict())
        gen = torch.Generator().manual_seed(3)
        outs, grads = [], []
        for b in (2, 4):
            x = torch.randn(b, _SEQ[b], _LLAMA.d, generator=gen)
            y = model(x)
            (y * y).sum().backward()
            outs.append(y.detach())
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad()
        results.append((outs, grads, model.last_artifacts.host_shapes))
    (outs_off, grads_off, none), (outs_on, grads_on, split) = results
    assert none is None and split.moved
    for a, b in zip(outs_on, outs_off):
        assert torch.equal(a, b)
    for ga, gb in zip(grads_on, grads_off):
        for a, b in zip(ga, gb):
            assert torch.equal(a, b)


def test_gpt_lm_training_parity_with_changing_sequence_length() -> None:
    cfg = GPTConfig(vocab=97, d=32, heads=4, layers=2, max_len=16)

    def inputs(b, g):
        data = torch.randint(0, cfg.vocab, (b, _SEQ[b] - 1 if _SEQ[b] > 12 else _SEQ[b] + 1), generator=g)
        return (data[:, :-1], data[:, 1:]), {}

    w = check_parity(
        lambda: TinyGPT(cfg),
        inputs,
        batch_sizes=(2, 3, 4),
        loss_fn=lambda out: out[0],
        wrap_options={"aggressive_cpu_fallback": True},
    )
    assert w.export_count == 1
    split = w.last_artifacts.host_shapes
    # arange(t) of the position embedding: Range's limit comes from ids.shape[1].
    assert _moved_ops(w) == {"Shape": 1, "Gather": 1, "Cast": 1}
    assert all("Range input 1 (limit)" in r for p in split.moved.values() for r in p.reasons)
    # The blocks' x.shape are shapes of activations: kept, with the reason.
    assert any("intermediate value" in p.why for p in split.kept.values())


def test_inference_with_the_flag(monkeypatch) -> None:
    monkeypatch.setenv("ORT_AGGRESSIVE_CPU_FALLBACK", "1")
    torch.manual_seed(0)
    eager = LlamaBlock(_LLAMA).eval()
    w = ORTWrap(LlamaBlock(_LLAMA), fallback=False).eval()
    w.module.load_state_dict(eager.state_dict())
    assert w.options.aggressive_cpu_fallback
    with torch.no_grad():
        for b in (2, 3):
            x = torch.randn(b, _SEQ[b] if b in _SEQ else 6, _LLAMA.d)
            torch.testing.assert_close(w(x), eager(x), atol=1e-5, rtol=1e-4)
    assert not w.last_artifacts.with_backward and w.last_artifacts.host_shapes.moved
    assert w.export_count == 1


def _dynamo_available() -> str | None:
    path = os.path.join(os.path.dirname(__file__), "..", "ortwrap", "export", "dynamo.py")
    if not os.path.exists(path):
        return "ortwrap/export/dynamo.py does not exist yet"
    try:
        Options.resolve(exporter="dynamo")
    except ValueError as e:
        return f"exporter='dynamo' is not accepted yet: {e}"
    return None


@pytest.mark.skipif(_dynamo_available() is not None, reason=str(_dynamo_available()))
def test_llama_block_dynamo_capture_with_the_flag() -> None:
    w = check_parity(
        lambda: LlamaBlock(_LLAMA),
        _llama_inputs,
        batch_sizes=(4, 7, 3, 2),
        lr=0.01,  # at 0.05 the block's float32 gradients drift past the tolerance, with the flag on or off
        wrap_options={"aggressive_cpu_fallback": True, "exporter": "dynamo"},
    )
    split = w.last_artifacts.host_shapes
    assert split is not None and split.moved, split.summary() if split else "no split"
    assert w.export_count == 1, "a new sequence length must not re-export"
    # The capture reads the dims as Shape slices of x; the Reshape/Expand shapes built from them
    # move into the shape program.
    moved = _moved_ops(w)
    assert moved.get("Shape", 0) >= 1 and moved.get("Concat", 0) >= 1, moved
    assert any(f.kind == "shape" and f.source == "input:x" for f in (*split.feeds, *split.program_inputs))
    assert not any(n.op_type == "Shape" and n.input[0] == "input:x" for n in w.last_artifacts.pre_grad.graph.node)


@pytest.mark.gpu
def test_llama_block_on_cuda_feeds_shapes_from_the_host() -> None:
    # Skipped without a GPU (conftest.py). The shape program's outputs are CPU tensors fed to a
    # CUDA session: ORT's CUDA kernels take shape inputs from CPU memory.
    w = check_parity(
        lambda: LlamaBlock(_LLAMA),
        _llama_inputs,
        batch_sizes=(4, 7, 3, 2),
        lr=0.01,
        atol=1e-4,
        device="cuda",
        wrap_options={"aggressive_cpu_fallback": True},
    )
    assert w.export_count == 1 and w.last_artifacts.host_shapes.moved
    program = next(iter(w.programs()))
    host = program.host_shapes_runner([torch.randn(2, 5, _LLAMA.d, device="cuda")])
    assert host and all(t.device.type == "cpu" for t in host)
