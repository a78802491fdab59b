"""Autocast's bfloat16/float16 graphs on onnxruntime's CPU provider: each op computes in float32
between Casts, its result rounded to the half type, as eager's CPU kernels do.

Under ``torch.autocast`` AOTAutograd writes autocast's casts into the forward and backward graphs:
a Linear's GEMM, a convolution, attention's matmuls run in bfloat16 (float16), and the ops that read
their results (GELU, tanh, adds, the gradients' sums) too. onnxruntime 1.32's CPU provider has
almost no bfloat16 kernels (``Cast`` and data movement; no MatMul, Gemm, Conv, Add, Tanh, ...: the
session refuses the graph), and runs a float16 node that lacks a kernel through Casts it inserts
itself around *groups* of such nodes (``InsertCastTransformer``), which drops the float16 rounding
between them: numbers that are not autocast's.

:func:`compute_in_float32` rewrites the ONNX graph before the session: every node that reads or
writes a half value, other than data movement (:data:`EXACT`: a Reshape or a Gather of bfloat16
values is the same in any type) and ``Cast``, reads its half inputs through a ``Cast`` to float32,
computes in float32 and writes each half output through a ``Cast`` back. So every value the graph
holds in bfloat16 is rounded once, where eager rounds it: a GEMM accumulates in float32 (MLAS)
and rounds its result, as PyTorch's bfloat16 GEMM (oneDNN) does; an elementwise op computes in
float32 and rounds, as PyTorch's bfloat16 kernels do. onnxruntime keeps a ``Cast`` to bfloat16 followed by a
``Cast`` back to float32 (the rounding is not optimized away: ``test_autocast_rounding_is_kept``).
What differs from eager is the order of float32 sums, and ops that the trace decomposes (autocast's
SDPA as its math composite, a backward's decomposition), whose parts round one by one.

Data movement ops stay in the half type where the provider has the kernel (probed once per op and
types, :func:`_has_kernel`), else they are computed in float32 too (exact either way).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

#: half element types (ONNX numbers)
HALF = (TensorProto.BFLOAT16, TensorProto.FLOAT16)
#: ops whose result is exact in any element type (they move or select values, compute none)
EXACT = frozenset(
    {
        "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice", "Gather", "GatherElements",
        "GatherND", "Expand", "Identity", "Flatten", "Tile", "Where", "ScatterND", "ScatterElements", "Pad",
        "Shape", "Size", "ConstantOfShape", "Constant",
    }
)  # fmt: skip
_CAST = frozenset({"Cast", "CastLike"})


def _elem(v: onnx.ValueInfoProto) -> int:
    return v.type.tensor_type.elem_type if v.type.HasField("tensor_type") else 0


def compute_in_float32(model: bytes, provider: str = "CPUExecutionProvider") -> tuple[bytes, int]:
    """``model`` with its half-precision compute in float32 between Casts (module docstring); returns the
    model and how many nodes were rewritten (0: the model as it was)."""
    m = onnx.load_from_string(model)
    g = m.graph
    types: dict[str, int] = {}
    for v in (*g.input, *g.output, *g.value_info):
        types[v.name] = _elem(v)
    for t in g.initializer:
        types[t.name] = t.data_type
    if any(n.output and n.output[0] and n.output[0] not in types for n in g.node):
        inferred = onnx.shape_inference.infer_shapes(m)
        for v in (*inferred.graph.value_info, *inferred.graph.output):
            types.setdefault(v.name, _elem(v))
    opsets = tuple((o.domain, o.version) for o in m.opset_import)
    nodes: list[onnx.NodeProto] = []
    rewritten = 0
    fresh = 0
    for node in g.node:
        ins = [types.get(x, 0) if x else 0 for x in node.input]
        outs = [types.get(x, 0) if x else 0 for x in node.output]
        if not any(t in HALF for t in (*ins, *outs)) or node.op_type in _CAST:
            nodes.append(node)
            continue
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            nodes.append(node)  # (control flow: its subgraphs are not rewritten)
            continue
        if (
            node.domain in ("", "ai.onnx")
            and node.op_type in EXACT
            and not any(a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute)  # (scatter-add)
            and _has_kernel(provider, opsets, node, tuple(ins), tuple(outs))
        ):
            nodes.append(node)
            continue
        rewritten += 1
        for i, (name, t) in enumerate(zip(list(node.input), ins)):
            if t in HALF:
                fresh += 1
                wide = f"{name}__f32_{fresh}"
                nodes.append(helper.make_node("Cast", [name], [wide], to=TensorProto.FLOAT, name=f"{wide}_cast"))
                node.input[i] = wide
        if node.op_type == "ConstantOfShape":
            for a in node.attribute:
                if a.name == "value" and a.t.data_type in HALF:
                    a.t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(a.t).astype("float32")))
        after = []
        for i, (name, t) in enumerate(zip(list(node.output), outs)):
            if t in HALF:
                fresh += 1
                wide = f"{name}__f32_{fresh}"
                node.output[i] = wide
                after.append(helper.make_node("Cast", [wide], [name], to=t, name=f"{wide}_round"))
        nodes.append(node)
        nodes.extend(after)
    if not rewritten:
        return model, 0
    del g.node[:]
    g.node.extend(nodes)
    # (the half value_info of rewritten outputs still names the Cast's output: correct)
    return m.SerializeToString(), rewritten


def _attrs(node: onnx.NodeProto) -> bytes:
    return b"".join(a.SerializeToString() for a in node.attribute)


#: (provider, opsets, domain, op, input types, output types, attributes) -> the provider has the kernel
_PROBED: dict[tuple, bool] = {}


def _has_kernel(provider: str, opsets: tuple, node: onnx.NodeProto, ins: tuple, outs: tuple) -> bool:
    """Whether ``provider`` has a kernel for ``node``'s op with these element types (a one-node
    session, once per op, types and attributes)."""
    key = (provider, opsets, node.domain, node.op_type, ins, outs, _attrs(node))
    if key not in _PROBED:
        _PROBED[key] = _probe(provider, opsets, node, ins, outs)
    return _PROBED[key]


def _probe(provider: str, opsets: tuple, node: onnx.NodeProto, ins: tuple, outs: tuple) -> bool:
    from ..._ort import ort

    probe = onnx.NodeProto()
    probe.op_type, probe.domain = node.op_type, node.domain
    probe.input.extend(f"i{i}" if t else "" for i, t in enumerate(ins))
    probe.output.extend(f"o{i}" for i in range(len(outs)))
    probe.attribute.extend(node.attribute)
    graph = helper.make_graph(
        [probe],
        "probe",
        [helper.make_tensor_value_info(f"i{i}", t, None) for i, t in enumerate(ins) if t],
        [helper.make_tensor_value_info(f"o{i}", t or TensorProto.FLOAT, None) for i, t in enumerate(outs)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=[provider])
    except Exception:
        return False
    return True
