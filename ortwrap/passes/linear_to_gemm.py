"""``nn.Linear`` on N-d activations as one 2-D ``Gemm``, so ORT's CPU gradient needs no weight transposes.

Both exporters write ``nn.Linear(x)`` with ``x`` of rank > 2 (and a bias-free ``x @ W.t()``) as
``Add(MatMul(x, Transpose(W)), b)``. ORT 1.19.2 differentiates that as: ``dW^T = Gemm(x2d^T, dY2d)``
followed by a ``Transpose`` back to ``W``'s layout, a ``ReduceSum`` of ``dY`` over all leading axes
for ``db``, and in the forward a separate ``Add`` pass over the output. Written as::

    Reshape(Gemm(Reshape(x, [-1, K]), W, b, transB=1), [*x.shape[:-1], N])

the same function is one GEMM whose bias is the output's initial value, and ``GetGemmGradient``
gives ``dW = Gemm(dY2d^T, x2d)`` directly in ``W``'s layout, ``dx = Gemm(dY2d, W)`` and ``db`` as a
``ReduceSum`` over one axis. The reshapes only relabel contiguous memory. On the (b) GPT LM (2 CPU
cores) the bias ``Add``/``ReduceSum`` kernels drop from ~8 to ~3.5 ms per step and the step from
~154 to ~152 ms (``benchmarks/profile_lm.py``, ``benchmarks/bench_lm.py``).

Rewritten: ``MatMul(x, B)`` with ``x`` of known rank >= 2 and ``B`` a float matrix of static shape
``[K, N]``, when ``B`` is ``Transpose(W, perm=[1, 0])`` or the MatMul's only use is an ``Add`` of a
bias of shape ``[N]`` (otherwise there is nothing to gain). The new values get types and shapes (the
row count a named dimension): without them ORT's gradient builder falls back to shape-generic
``BroadcastGradientArgs`` subgraphs for the bias and everything downstream. Left alone: a result that
is, or is reshaped into, a graph output, since ORT 1.19.2 overwrites the buffer such an output shares
with the Gemm during the backward (an LM head whose logits are returned and fed to the loss). CPU
only, where it was measured.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._build import NodeBuilder

_FLOATS = {ir.DataType.FLOAT, ir.DataType.DOUBLE}


def _static_dims(value: ir.Value) -> list[int] | None:
    if value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return list(value.shape)


def _transposed_matrix(value: ir.Value) -> ir.Value | None:
    """``W`` when ``value`` is ``Transpose(W, perm=[1, 0])`` (or ``Transpose(W)`` of a matrix)."""
    node = value.producer()
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return None
    perm = node.attributes.get("perm")
    if perm is not None and list(perm.as_ints()) != [1, 0]:
        return None
    return node.inputs[0]


def _bias_add(out: ir.Value, n: int) -> tuple[ir.Node, ir.Value] | None:
    """The ``Add`` that is ``out``'s only use and adds a bias of shape ``[n]``, and that bias."""
    uses = list(out.uses())
    if out.is_graph_output() or len(uses) != 1:
        return None
    add = uses[0][0]
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
        return None
    bias = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    if bias is None or bias is out or bias.dtype != out.dtype or _static_dims(bias) != [n]:
        return None
    return add, bias


_ALIASING = {"Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Cast"}


def _aliased_by_graph_output(value: ir.Value) -> bool:
    """Whether ``value`` or a view of it (through reshaping ops and casts) is a graph output."""
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        if v.is_graph_output():
            return True
        for user, index in v.uses():
            if index == 0 and user.op_type in _ALIASING and id(user) not in seen:
                seen.add(id(user))
                todo.extend(user.outputs)
    return False


class LinearToGemmPass(ir.passes.InPlacePass):
    """Replace ``Add(MatMul(x, Transpose(W)), b)`` (and its bias-free or transpose-free forms) with a 2-D ``Gemm``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 17))
        modified = False
        count = 0
        for node in list(graph):
            if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
                continue
            x, b_mat = node.inputs
            if x is None or b_mat is None or b_mat.dtype not in _FLOATS or x.dtype != b_mat.dtype:
                continue
            kn = _static_dims(b_mat)
            if kn is None or len(kn) != 2 or x.shape is None or len(x.shape) < 2:
                continue
            k, n = kn
            if isinstance(x.shape[-1], int) and x.shape[-1] != k:
                continue
            w = _transposed_matrix(b_mat)
            bias = _bias_add(node.outputs[0], n)
            if w is None and bias is None:
                continue
            rank = len(x.shape)
            old = node.outputs[0] if bias is None else bias[0].outputs[0]
            if rank > 2 and _aliased_by_graph_output(old):
                # A graph output that is a Reshape (or a no-op Cast of one) aliases the Gemm's buffer,
                # which ORT 1.19.2 overwrites during the backward after the forward returned it
                # (LM heads whose logits are returned and fed to the loss).
                continue
            b = NodeBuilder(node.name or f"linear_{id(node):x}")
            x2 = x if rank == 2 else b.op("Reshape", x, b.const(np.array([-1, k], dtype=np.int64)))
            gemm_inputs = [x2, w if w is not None else b_mat] + ([bias[1]] if bias is not None else [])
            y = gemm = b.op("Gemm", *gemm_inputs, transB=1 if w is not None else 0)
            if rank > 2:
                if opset >= 15:
                    lead = b.op("Shape", x, start=0, end=rank - 1)
                else:
                    lead = b.op(
                        "Slice",
                        b.op("Shape", x),
                        b.const(np.array([0], dtype=np.int64)),
                        b.const(np.array([rank - 1], dtype=np.int64)),
                    )
                shape = b.op("Concat", lead, b.const(np.array([n], dtype=np.int64)), axis=0)
                y = b.op("Reshape", y, shape)
            # Types and shapes for ORT's gradient builder: without them it differentiates everything
            # downstream with shape-generic subgraphs (BroadcastGradientArgs + ReduceSum per Add/Mul).
            y.dtype, y.shape = old.dtype, old.shape
            if rank > 2:
                # A named row count: ORT's Gemm gradient reduces the bias statically only when every
                # dimension of dY has a value or a name.
                rows = ir.SymbolicDim(f"ortwrap_gemm_rows_{count}")
                count += 1
                x2.dtype, x2.shape = x.dtype, ir.Shape([rows, k])
                gemm.dtype, gemm.shape = old.dtype, ir.Shape([rows, n])
                lead.dtype, lead.shape = ir.DataType.INT64, ir.Shape([rank - 1])
                shape.dtype, shape.shape = ir.DataType.INT64, ir.Shape([rank])
            if bias is None:
                b.replace(graph, node, [y])
            else:  # the Add's output becomes the Gemm's; the MatMul is left without uses
                b.replace(graph, bias[0], [y])
                graph.remove(node, safe=True)
            if w is not None and not b_mat.uses() and not b_mat.is_graph_output():
                graph.remove(b_mat.producer(), safe=True)
            modified = True
        return ir.passes.PassResult(model, modified=modified)
