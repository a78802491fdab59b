"""ortwrap's CPU kernels that :class:`~.native_cpu_kernels.NativeCPUKernelsPass` writes with
onnxscript rewrite rules: the two GELUs (``passes/fusion_patterns.py``'s patterns with this
module's check and replacement) and the affine GroupNorm (+ SiLU).

NOTE: imported when the pass first applies a rule, not by ``import ortwrap`` (onnxscript's import:
~0.1 s, ~22 MiB; a build from the build cache needs none), as ``passes/fusion_patterns.py``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from ._build import constant_value
from .fusion_patterns import GeluErfRule, GeluTanhRule, apply_at_gelus, forget_matches
from .kernel_nodes import ONNX_DOMAINS, constant_dtype, is_constant, kernel_node, scalar_constant


class _GeluKernel(GeluErfRule):
    """:class:`~.fusion_patterns.GeluErfRule`'s pattern -> ``gelu(x)``."""

    def __init__(self, outer: int) -> None:
        super().__init__(0, outer, name="GeluKernel")

    def check(self, context, x, c, half, one, scaled_by, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        want = math.sqrt(2) if scaled_by == "Div" else 1 / math.sqrt(2)
        if not is_constant(c, want, 1e-6) or scalar_constant(half) != 0.5 or scalar_constant(one) != 1.0:
            return result.fail("constants are not GELU's")
        # Mul and Div take one type T: x has the constant's type when inference left it unknown.
        if (x.dtype or constant_dtype(c)) != ir.DataType.FLOAT:
            return result.fail("not float32", x)
        return result

    def rewrite(self, op, x, **_):
        return kernel_node(op, "gelu", x)


class _GeluTanhKernel(GeluTanhRule):
    """:class:`~.fusion_patterns.GeluTanhRule`'s pattern -> ``gelu_tanh(x)``."""

    def __init__(self, outer: int, cube: int) -> None:
        super().__init__(0, True, outer, cube, name="GeluTanhKernel")

    def check(self, context, x, c3, k, half, one, three=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if not (is_constant(k, math.sqrt(2 / math.pi), 1e-6) and is_constant(c3, 0.044715, 1e-7)):
            return result.fail("constants are not the tanh GELU's")
        if scalar_constant(half) != 0.5 or scalar_constant(one) != 1.0:
            return result.fail("constants are not the tanh GELU's")
        power = constant_value(three) if three is not None else None
        if three is not None and (power is None or power.size != 1 or float(power.reshape(-1)[0]) != 3.0):
            return result.fail("not a cube")
        if (x.dtype or constant_dtype(k)) != ir.DataType.FLOAT:
            return result.fail("not float32", x)
        return result

    def rewrite(self, op, x, **_):
        return kernel_node(op, "gelu_tanh", x)


@functools.cache
def _gelu_rules() -> pattern.RewriteRuleSet:
    return pattern.RewriteRuleSet([_GeluKernel.rule(outer) for outer in range(3)], commute=True)


@functools.cache
def _gelu_tanh_rules() -> pattern.RewriteRuleSet:
    return pattern.RewriteRuleSet(
        [_GeluTanhKernel.rule(outer, cube) for outer in range(3) for cube in range(2)], commute=True
    )


class _GroupNormKernel(pattern.RewriteRuleClassBase):
    """Both exporters' ``nn.GroupNorm`` with its affine -- ``Reshape(x, [0, G, -1])``,
    ``InstanceNormalization`` with scale ones and bias zeros, ``Reshape`` back to ``Shape(x)``, ``Mul``
    by the unsqueezed gamma, ``Add`` of the unsqueezed beta -- and with ``silu`` the ``Mul(z,
    Sigmoid(z))`` after it -> ``group_norm(x, gamma, beta, eps, groups, silu)``."""

    def __init__(self, silu: bool) -> None:
        super().__init__(f"GroupNormKernel{'Silu' if silu else ''}")
        self.silu = silu

    def pattern(self, op, x, shape, ones, zeros, gamma, axes_g, beta, axes_b):
        grouped = op.Reshape(x, shape)
        normed = op.InstanceNormalization(grouped, ones, zeros, _outputs=["normed"])
        z = op.Add(op.Mul(op.Reshape(normed, op.Shape(x)), op.Unsqueeze(gamma, axes_g)), op.Unsqueeze(beta, axes_b))
        return op.Mul(z, op.Sigmoid(z)) if self.silu else z

    def check(self, context, x, shape, ones, zeros, gamma, axes_g, beta, axes_b, normed, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        # Mul/Add/InstanceNormalization take one type T: x has gamma's when inference left it unknown.
        if any((v.dtype or gamma.dtype) != ir.DataType.FLOAT for v in (x, gamma, beta)):
            return result.fail("not float32", x)
        dims = None if x.shape is None else list(x.shape)
        if dims is None or len(dims) < 3 or not isinstance(dims[1], int):
            return result.fail("x's rank or channels are unknown", x)
        s = constant_value(shape)
        if s is None or s.size != 3 or int(s.reshape(-1)[2]) != -1:
            return result.fail("not a reshape to [N, G, -1]", shape)
        batch, groups = (int(v) for v in s.reshape(-1)[:2])
        if groups < 1 or dims[1] % groups or not (batch == 0 or batch == dims[0]):
            return result.fail("not a reshape to [N, G, -1]", shape)
        for v, want in ((ones, 1.0), (zeros, 0.0)):
            c = constant_value(v)
            if c is None or c.size != groups or not np.all(c == want):
                return result.fail("the InstanceNormalization is not bare (scale ones, bias zeros)", v)
        for v, axes in ((gamma, axes_g), (beta, axes_b)):
            a = constant_value(axes)
            if (
                v.shape is None
                or list(v.shape) != [dims[1]]
                or a is None
                or a.reshape(-1).tolist() != list(range(1, len(dims) - 1))
            ):
                return result.fail("the affine is not per channel", v)
        return result

    def rewrite(self, op, x, shape, gamma, beta, normed, **_):
        eps = normed.producer().attributes.get("epsilon")
        eps = eps.as_float() if eps is not None else 1e-5
        groups = int(constant_value(shape).reshape(-1)[1])
        scalars = (
            np.array(eps, dtype=np.float32),
            np.array(groups, dtype=np.int64),
            np.array(int(self.silu), dtype=np.int64),
        )
        y = kernel_node(op, "group_norm", x, gamma, beta, *(op.Constant(value=ir.tensor(v)) for v in scalars))
        y.shape = x.shape
        return y


@functools.cache
def _group_norm_rules() -> tuple[pattern.RewriteRuleSet, pattern.RewriteRuleSet]:
    """(the GroupNorm + SiLU rules, the GroupNorm rules), every operand order of the Mul/Add."""
    return tuple(pattern.RewriteRuleSet([_GroupNormKernel.rule(silu)], commute=True) for silu in (True, False))


def _apply_group_norms(model: ir.Model, cores: Any = None) -> int:
    """:class:`_GroupNormKernel` at each ``InstanceNormalization`` (in the graph and its subgraphs)
    whose output a ``Reshape``, ``Mul`` and ``Add`` follow: with the SiLU after it where one is,
    else without. Returns the number of GroupNorms rewritten."""
    with_silu, plain = _group_norm_rules()
    count = 0
    for core in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        graph = core.graph
        if graph is None or core.op_type != "InstanceNormalization" or core.domain not in ONNX_DOMAINS:
            continue
        adds = [
            add
            for back, _ in core.outputs[0].uses()
            for mul, _ in back.outputs[0].uses()
            for add, _ in mul.outputs[0].uses()
            if (back.op_type, mul.op_type, add.op_type) == ("Reshape", "Mul", "Add") and add.graph is graph
        ]
        silus = [
            m
            for add in adds
            for sig, _ in add.outputs[0].uses()
            for m, _ in sig.outputs[0].uses()
            if sig.op_type == "Sigmoid" and m.op_type == "Mul"
        ]
        tries = [(rule, root) for root in silus for rule in with_silu.rules] + [
            (rule, root) for root in adds for rule in plain.rules
        ]
        for rule, root in tries:
            delta = rule.try_rewrite(model, graph, root)
            if delta is not None:
                ir.convenience.replace_nodes_and_values(
                    graph, root, delta.match.nodes, delta.new_nodes, delta.match.outputs, delta.new_outputs
                )
                count += 1
                break
    for rules in (with_silu, plain):
        forget_matches(rules)
    return count


#: ``Kernel.rewrite`` -> how the rules that write that kernel are applied: ``f(model, cores)`` -> how
#: many it wrote (built on first use: the 960 commuted tanh patterns take about half a second).
RULES = {
    "_gelu": lambda model, cores: apply_at_gelus(_gelu_rules(), model, cores),
    "_gelu_tanh": lambda model, cores: apply_at_gelus(_gelu_tanh_rules(), model, cores),
    "_group_norm": _apply_group_norms,
}
