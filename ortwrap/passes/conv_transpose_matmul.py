"""Rewrite a ``ConvTranspose`` whose kernel equals its stride (no padding, no dilation, one group: a
UNet's 2x2 up-convolution) as one ``Gemm`` and a pixel shuffle of fast transposes.

ORT 1.19.2 has no CPU ``ConvTransposeGrad``, so a ConvTranspose in a CPU training graph runs as
PyTorch's transposed convolution (``TorchGradientsPass``), whose oneDNN deconvolution costs ~155 us
forward and ~180-265 us backward on a UNet's 4x16x10x10 -> 4x16x20x20 however small the problem
(AMD EPYC Zen 5 class, 1 thread). With kernel == stride the output windows do not overlap: every
input pixel writes its own k1 x ... x kr block, ``y[n, o, s*k + a] = sum_c x[n, c, s] W[c, o, a] + b[o]``,
a GEMM over the channels and a reshuffle. In ``x``'s channels-last layout the GEMM's result is
``[N, S1..Sr, k1..kr, O]``; ``y`` is ``[N, O, S1, k1, ..., Sr, kr]``. ORT's generic N-d Transpose does
that in one step slowly (~205 us for 4x16x40x40, as slow as ``DepthToSpace``), but its transposes that
keep the last axis (block copies) or move one axis (NCHW <-> NHWC) are fast (~3-5 us). So::

    z = Gemm(Reshape(Transpose(x, NCHW->NHWC), [-1, C]), Reshape(Transpose(W, [0, 2..r+1, 1]), [C, K*O]),
             Expand(b, [K, O]))                       # rows (n, S1..Sr), columns (k1..kr, O)
    for t in 1..r-1:  move k_t after S_t:
        z = Transpose(Reshape(z, [N*S1*k1*..*S_t, S_{t+1}*..*S_r, k_t, k_{t+1}*..*k_r*O]), [0, 2, 1, 3])
    y = Reshape(Transpose(Reshape(z, [N, S1*k1*..*Sr*kr, O]), [0, 2, 1]), [N, O, S1*k1, ..., Sr*kr])

ORT differentiates all of it (Gemm, Transpose, Reshape, Expand), each transpose's gradient being a fast
transpose again. A bf16 one (autocast) becomes a bf16 Gemm that the half-precision passes treat like
every other GEMM. Needs the weight's shape (a parameter's is known) and the input's rank; sizes may be
dynamic (read from ``Shape(x)`` at run time where the export left them symbolic). Other ConvTransposes
are left as they were.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._build import NodeBuilder, ints_attr


def matmul_form(node: ir.Node) -> tuple[int, int, list[int]] | None:
    """(C, O, kernel) of a ConvTranspose this pass rewrites, or None."""
    if node.op_type != "ConvTranspose" or node.domain not in ("", "ai.onnx"):
        return None
    x, w = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    if x is None or w is None or x.shape is None or w.shape is None or len(x.shape) < 3:
        return None
    r = len(x.shape) - 2
    k = ints_attr(node, "kernel_shape", [])
    dims = list(w.shape)
    if len(dims) != r + 2 or not all(isinstance(d, int) for d in dims):
        return None
    k = k or dims[2:]
    attrs = node.attributes
    if "output_shape" in attrs or ("auto_pad" in attrs and attrs["auto_pad"].as_string() not in ("NOTSET", "")):
        return None
    if (
        list(k) != dims[2:]
        or ints_attr(node, "strides", [1] * r) != list(k)
        or any(ints_attr(node, "pads", [0] * (2 * r)))
        or any(d != 1 for d in ints_attr(node, "dilations", [1] * r))
        or any(ints_attr(node, "output_padding", [0] * r))
        or ("group" in attrs and attrs["group"].as_int() != 1)
    ):
        return None
    return dims[0], dims[1], list(k)


def _shape(b: NodeBuilder, x: ir.Value, entries: list, cache: dict) -> ir.Value:
    """A Reshape target: each entry an int, or a list of factors (ints and ``("x", axis)``, a size of
    ``x``) to multiply; a constant where every factor is known, else read from ``Shape(x)`` (one per
    ``cache``)."""
    dims = list(x.shape)
    sizes = []  # per entry: (the known factors' product, the axes of x read at run time)
    for entry in entries:
        known, axes = 1, []
        for f in [entry] if isinstance(entry, int) else entry:
            d = f if isinstance(f, int) else dims[f[1]]
            if isinstance(d, int):
                known *= d
            else:
                axes.append(f[1])
        sizes.append((known, axes))
    if not any(axes for _, axes in sizes):
        return b.const(np.array([known for known, _ in sizes], np.int64))
    if "shape" not in cache:
        cache["shape"] = b.op("Shape", x)
    parts = []
    for known, axes in sizes:
        value = None
        for axis in axes:
            d = b.op("Gather", cache["shape"], b.const(np.array([axis], np.int64)), axis=0)
            value = d if value is None else b.op("Mul", value, d)
        if value is None or known != 1:
            k = b.const(np.array([known], np.int64))
            value = k if value is None else b.op("Mul", value, k)
        parts.append(value)
    return b.op("Concat", *parts, axis=0)


def _rewrite(graph: ir.Graph, node: ir.Node, c: int, o: int, k: list[int], zeros: dict) -> None:
    r = len(k)
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    b = NodeBuilder(node.name or "conv_transpose")
    cache: dict = {}

    def i64(v: list[int]) -> ir.Value:
        return b.const(np.array(v, np.int64))

    def reshape(v: ir.Value, entries: list) -> ir.Value:
        # every size spelled out (no -1, no 0 for "copy"): an empty batch reshapes too
        return b.op("Reshape", v, _shape(b, x, entries, cache), **zeros)

    def spatial(upto: int) -> list:
        return [f for u in range(upto) for f in (("x", 2 + u), k[u])]

    big_k = int(np.prod(k))
    last = [0, *range(2, r + 2), 1]  # channels last
    rows = b.op("Reshape", b.op("Transpose", x, perm=last), i64([-1, c]))
    weight = b.op("Reshape", b.op("Transpose", w, perm=last), i64([c, big_k * o]))
    if bias is None:
        z = b.op("MatMul", rows, weight)
    else:
        tiled = b.op("Reshape", b.op("Expand", b.op("Reshape", bias, i64([1, o])), i64([big_k, o])), i64([-1]))
        z = b.op("Gemm", rows, weight, tiled)
    # (n, S1..Sr, k1..kr, O) -> (n, S1, k1, ..., Sr, kr, O): move k_t after S_t, one at a time
    for t in range(r - 1):
        before = [("x", 0), *spatial(t), ("x", 2 + t)]
        after = [("x", 2 + u) for u in range(t + 1, r)]
        z = reshape(z, [before, after, k[t], int(np.prod(k[t + 1 :])) * o])
        z = b.op("Transpose", z, perm=[0, 2, 1, 3])
    z = reshape(z, [[("x", 0)], spatial(r), o])
    y = b.op("Transpose", z, perm=[0, 2, 1])  # (n, O, S1 k1 ... Sr kr)
    if r > 1:
        y = reshape(y, [[("x", 0)], o] + [[("x", 2 + u), k[u]] for u in range(r)])
    b.replace(graph, node, [y])


class ConvTransposeToMatMulPass(ir.passes.InPlacePass):
    """Replace each ConvTranspose of :func:`matmul_form` with a GEMM and a pixel shuffle."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        # Reshape's allowzero (opset 14): a computed size of 0 (an empty batch) is a size, not "copy"
        zeros = {"allowzero": 1} if graph.opset_imports.get("", 0) >= 14 else {}
        for node in list(graph):
            form = matmul_form(node)
            if form is not None:
                _rewrite(graph, node, *form, zeros)
                modified = True
        return ir.passes.PassResult(model, modified=modified)
