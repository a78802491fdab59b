"""Rewrite ``Einsum`` into MatMul and reshaping ops that ORT differentiates.

ORT 1.19.2 has no gradient builder for ``Einsum``. Operands are folded left to right; for each
pair ``acc, x`` (labels needed later = output labels + labels of the operands still to come)::

    ReduceSum the labels only one side has and nothing later needs
    batch  = shared labels needed later      -> leading MatMul batch dims
    K      = shared labels not needed later  -> merged into one axis (Reshape [0, .., 0, -1])
    L / R  = labels of acc / x only          -> batch dims broadcast against size-1 Unsqueezes;
                                                the last of each is MatMul's M / N
    A = Transpose/Unsqueeze(acc) -> [batch, L[:-1], 1.., M|1, K]
    B = Transpose/Unsqueeze(x)   -> [batch, 1.., R[:-1], K, N|1]
    acc = Squeeze(MatMul(A, B))     labelled batch + L + R

then ``ReduceSum`` what the output lacks and ``Transpose`` to the output order. Reshape targets
only use 0 (copy) and -1, so symbolic batch/sequence dimensions work. A MatMul with no batch dim
gets a unit one: ORT lowers a 2-D MatMul's gradient to Gemm, and its GemmTransposeFusion fails
("GEMM: Dimension mismatch") when a dimension is symbolic. A single operand is only reduced and
transposed. An ellipsis (``...``) is spelled out in unused letters from the input ranks. Unsupported: a
label repeated within one operand (diagonals).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir

from ..errors import PassError
from ._build import NodeBuilder

# One axis of a target layout: a label, None for a new size-1 axis, or a tuple of labels merged
# into one axis (only as the last axis).
_Slot = str | tuple[str, ...] | None


def _expand_ellipsis(node: ir.Node, eq: str, where: str) -> str:
    """``eq`` with each ``...`` spelled out in letters the equation does not use, from the ranks of
    the inputs (right-aligned, as einsum broadcasts them: ``...ij->...ji`` of a rank-4 input is
    ``ABij->ABji``); PassError where a rank is unknown."""
    lhs, arrow, out = eq.partition("->")
    operands = lhs.split(",")
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    widths = []
    for x, labels in zip(node.inputs, operands):
        if "..." not in labels:
            widths.append(0)
            continue
        if x is None or x.shape is None:
            raise PassError(f"{where}: ellipsis ('...') of an input of unknown rank")
        widths.append(len(x.shape) - len(labels.replace("...", "")))
    width = max(widths, default=0)
    if width > len(free) or any(w < 0 for w in widths):
        raise PassError(f"{where}: ellipsis ('...') the rewrite cannot spell out")
    letters = "".join(free[:width])
    operands = [labels.replace("...", letters[width - w :]) for labels, w in zip(operands, widths)]
    if arrow:
        out = out.replace("...", letters)
    elif "..." in lhs:  # implicit output: the broadcast dims first, then the labels used once
        counts = Counter("".join(operands))
        out = letters + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in letters))
    return ",".join(operands) + "->" + out


def _parse(node: ir.Node, equation: str) -> tuple[list[str], str]:
    """Operand labels and output labels of ``equation``; raise PassError for unsupported forms."""
    eq = equation.replace(" ", "")
    where = f"node {node.name!r}: Einsum equation {equation!r}"
    if "." in eq:
        eq = _expand_ellipsis(node, eq, where)
    lhs, arrow, out = eq.partition("->")
    operands = lhs.split(",")
    if len(operands) != len(node.inputs):
        raise PassError(f"{where}: {len(operands)} operand(s) in the equation, {len(node.inputs)} input(s)")
    for labels in operands:
        if len(set(labels)) != len(labels):
            raise PassError(f"{where}: a label repeated within operand {labels!r} (a diagonal) is not supported")
        if labels and not labels.isalpha():
            raise PassError(f"{where}: operand {labels!r} has labels that are not letters")
    counts = Counter("".join(operands))
    if not arrow:
        out = "".join(sorted(c for c, k in counts.items() if k == 1))
    if len(set(out)) != len(out) or any(c not in counts for c in out):
        raise PassError(f"{where}: output {out!r} repeats a label or names one no operand has")
    for x, labels in zip(node.inputs, operands):
        if x is not None and x.shape is not None and len(x.shape) != len(labels):
            raise PassError(f"{where}: input {x.name!r} has rank {len(x.shape)}, the equation gives it {len(labels)}")
    return operands, out


class _Rewriter:
    """Builds the replacement of one Einsum node; a term is ``(value, labels)``."""

    def __init__(self, b: NodeBuilder) -> None:
        self.b = b

    def axes(self, axes: list[int]) -> ir.Value:
        return self.b.const(np.array(axes, dtype=np.int64))

    def sum_out(self, term: tuple[ir.Value, str], drop: set[str]) -> tuple[ir.Value, str]:
        value, labels = term
        axes = [i for i, c in enumerate(labels) if c in drop]
        if not axes:
            return term
        return self.b.op("ReduceSum", value, self.axes(axes), keepdims=0), "".join(c for c in labels if c not in drop)

    def transpose(self, term: tuple[ir.Value, str], order: str) -> ir.Value:
        value, labels = term
        perm = [labels.index(c) for c in order]
        return value if perm == list(range(len(perm))) else self.b.op("Transpose", value, perm=perm)

    def arrange(self, term: tuple[ir.Value, str], slots: list[_Slot]) -> ir.Value:
        """Lay ``term`` out as ``slots``: transpose, insert size-1 axes, merge the last tuple slot."""
        flat: list[str | None] = []
        for s in slots:
            flat.extend(s if isinstance(s, tuple) else [s])
        value = self.transpose(term, "".join(c for c in flat if c is not None))
        units = [i for i, c in enumerate(flat) if c is None]
        if units:
            value = self.b.op("Unsqueeze", value, self.axes(units))
        if slots and isinstance(slots[-1], tuple) and len(slots[-1]) > 1:
            value = self.b.op("Reshape", value, self.axes([0] * (len(slots) - 1) + [-1]))
        return value

    def contract(self, left: tuple[ir.Value, str], right: tuple[ir.Value, str], later: str) -> tuple[ir.Value, str]:
        """One MatMul of two terms whose one-sided labels are all needed ``later``."""
        la, ra = left[1], right[1]
        batch = [c for c in la if c in ra and c in later]
        k = tuple(c for c in la if c in ra and c not in later)
        lonly = [c for c in la if c not in ra]
        ronly = [c for c in ra if c not in la]
        m, n = lonly[-1:], ronly[-1:]
        lb, rb = lonly[:-1], ronly[:-1]
        k_slot: _Slot = k if k else None
        a = self.arrange(left, [*batch, *lb, *[None] * len(rb), m[0] if m else None, k_slot])
        if len(k) > 1:
            # The merged K must be the last axis to reshape with [0, .., -1]: lay B out as
            # [.., N|1, K] and swap the last two axes.
            b = self.arrange(right, [*batch, *[None] * len(lb), *rb, n[0] if n else None, k_slot])
            rank = len(batch) + len(lb) + len(rb) + 2
            b = self.b.op("Transpose", b, perm=[*range(rank - 2), rank - 1, rank - 2])
        else:
            b = self.arrange(right, [*batch, *[None] * len(lb), *rb, k_slot, n[0] if n else None])
        dims = batch + lb + rb
        lead = 0 if dims else 1
        if lead:
            a = self.b.op("Unsqueeze", a, self.axes([0]))
            b = self.b.op("Unsqueeze", b, self.axes([0]))
        result = self.b.op("MatMul", a, b)
        squeeze = list(range(lead))
        if not m:
            squeeze.append(lead + len(dims))
        if not n:
            squeeze.append(lead + len(dims) + 1)
        if squeeze:
            result = self.b.op("Squeeze", result, self.axes(squeeze))
        return result, "".join(dims + m + n)


class EinsumToMatMulPass(ir.passes.InPlacePass):
    """Replace ``Einsum`` (no repeated label within an operand) by MatMuls."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "Einsum" or node.domain not in ("", "ai.onnx"):
                continue
            operands, out = _parse(node, node.attributes["equation"].as_string())
            b = NodeBuilder(node.name or "einsum")
            r = _Rewriter(b)
            terms = list(zip(node.inputs, operands))
            acc = r.sum_out(terms[0], {c for c in operands[0] if c not in out + "".join(operands[1:])})
            for i in range(1, len(terms)):
                later = out + "".join(operands[i + 1 :])
                x = r.sum_out(terms[i], {c for c in operands[i] if c not in acc[1] and c not in later})
                acc = r.sum_out(acc, {c for c in acc[1] if c not in x[1] and c not in later})
                acc = r.contract(acc, x, later)
            acc = r.sum_out(acc, {c for c in acc[1] if c not in out})
            result = r.transpose(acc, out)
            if any(result is v for v in node.inputs):
                result = b.op("Identity", result)
            b.replace(graph, node, [result])
            modified = True
        return ir.passes.PassResult(model, modified=modified)
