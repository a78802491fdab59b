"""The onnxscript rewrite rules of :class:`~.fusions.StandardOpFusionPass` (GELU, LayerNorm,
RMSNorm; the patterns, checks and replacements that ``passes/fusions.py``'s docstring lists), and
how they are applied.

NOTE: a module of its own so that onnxscript is imported by a build that runs a pass, not by
``import ortwrap``: a build from the build cache runs none, and onnxscript's import costs ~0.1 s and
~22 MiB of RSS (docs/performance.md, "The fixed cost of a process"). ``passes/kernel_patterns.py``
derives ortwrap's GELU kernel rules from the GELU rules here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

_SQRT2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)
_ONNX = ("", "ai.onnx")


def _scalar(value: ir.Value | None) -> float | None:
    """The value of a scalar (or one-element) constant, else None."""
    if value is None:
        return None
    const = value.const_value
    if const is None:
        producer = value.producer()
        if producer is None or producer.op_type != "Constant":
            return None
        attr = producer.attributes.get("value") or producer.attributes.get("value_float")
        if attr is None:
            return None
        if attr.type == ir.AttributeType.FLOAT:
            return float(attr.as_float())
        const = attr.as_tensor()
    array = np.asarray(const.numpy(), dtype=np.float64)
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _close(value: ir.Value | None, expected: float, rtol: float = 1e-4) -> bool:
    v = _scalar(value)
    return v is not None and abs(v - expected) <= rtol * abs(expected)


def _axes(node_value: ir.Value, axes_input: ir.Value | None) -> list[int] | None:
    """The axes of the ReduceMean producing ``node_value`` (attribute, or constant input at 18+)."""
    node = node_value.producer()
    if node is None:
        return None
    if "axes" in node.attributes:
        return list(node.attributes["axes"].as_ints())
    axes = axes_input if axes_input is not None else (node.inputs[1] if len(node.inputs) > 1 else None)
    if axes is None:
        return None
    const = axes.const_value
    if const is None:
        producer = axes.producer()
        if producer is None or producer.op_type != "Constant" or "value" not in producer.attributes:
            return None
        const = producer.attributes["value"].as_tensor()
    return [int(a) for a in np.asarray(const.numpy()).reshape(-1)]


def _last_axis(axes: list[int] | None, rank: int | None) -> bool:
    if axes is None or len(axes) != 1:
        return False
    return axes[0] == -1 or (rank is not None and axes[0] == rank - 1)


def _is_affine_tail(context) -> bool:
    """Whether the matched normalization (the context's root node output) goes on to ``* w + b``."""
    root = getattr(context, "root", None)
    if root is None or not root.outputs:
        return False
    uses = root.outputs[0].uses()
    if len(uses) != 1 or uses[0][0].op_type != "Mul":
        return False
    mul = uses[0][0]
    other = mul.inputs[1] if mul.inputs[0] is root.outputs[0] else mul.inputs[0]
    after = mul.outputs[0].uses()
    return (
        other is not None
        and other.shape is not None
        and len(other.shape) == 1
        and len(after) == 1
        and after[0][0].op_type == "Add"
    )


def _centered(x: ir.Value) -> bool:
    """Whether ``x`` is ``y - ReduceMean(y)``."""
    sub = x.producer()
    if sub is None or sub.op_type != "Sub" or len(sub.inputs) != 2:
        return False
    mean = sub.inputs[1].producer() if sub.inputs[1] is not None else None
    return mean is not None and mean.op_type == "ReduceMean" and mean.inputs[0] is sub.inputs[0]


def _rank(value: ir.Value) -> int | None:
    return len(value.shape) if value.shape is not None else None


# ------------------------------------------------------------------------------------------ GELU


class GeluErfRule(pattern.RewriteRuleClassBase):
    """``0.5 * x * (1 + erf(x / sqrt(2)))``, the 0.5 at ``outer`` (0: ``(x * t) * 0.5``, 1: ``(0.5 * x)
    * t``, 2: ``x * (t * 0.5)``; commuted) -> the standard op. Also the base of the rule that writes
    ortwrap's own GELU kernel (``passes/native_cpu_kernels.py``), which overrides the check and the
    replacement."""

    def __init__(self, opset: int, outer: int, name: str = "GeluErf") -> None:
        super().__init__(f"{name}{outer}")
        self.opset, self.outer = opset, outer

    def pattern(self, op, x, c, half, one):
        inner = pattern.OrValue([op.Div(x, c), op.Mul(x, c)], tag_var="scaled_by", tag_values=("Div", "Mul"))
        t = op.Add(op.Erf(inner), one)
        if self.outer == 0:  # (x * t) * 0.5
            return op.Mul(op.Mul(x, t), half)
        if self.outer == 1:  # (0.5 * x) * t
            return op.Mul(op.Mul(half, x), t)
        return op.Mul(x, op.Mul(t, half))  # x * (t * 0.5)

    def check(self, context, x, c, half, one, scaled_by, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.dtype not in _FLOATS:
            return result.fail("not a float input", x)
        if not (_close(c, _SQRT2) or _close(c, 1 / _SQRT2)) or not _close(half, 0.5) or not _close(one, 1.0):
            return result.fail("constants are not GELU's")
        if (scaled_by == "Div") != _close(c, _SQRT2):
            return result.fail("x / (1/sqrt 2) or x * sqrt 2 is not GELU")
        return result

    def rewrite(self, op, x, **_):
        if self.opset >= 20:
            return op.Gelu(x)
        return op.Gelu(x, _domain="com.microsoft")


class GeluTanhRule(pattern.RewriteRuleClassBase):
    """``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``, the 0.5 placed as in
    :class:`GeluErfRule`, the cube ``Pow(x, 3)`` (``cube=0``) or ``x * (x * x)`` -> the standard op
    (or ORT's FastGelu). The base of the rule that writes ortwrap's tanh GELU kernel."""

    def __init__(self, opset: int, training: bool, outer: int, cube: int, name: str = "GeluTanh") -> None:
        super().__init__(f"{name}{outer}{cube}")
        self.opset, self.training, self.outer, self.cube = opset, training, outer, cube

    def pattern(self, op, x, c3, k, half, one, three):
        cube = op.Pow(x, three) if self.cube == 0 else op.Mul(x, op.Mul(x, x))
        t = op.Add(op.Tanh(op.Mul(k, op.Add(x, op.Mul(c3, cube)))), one)
        if self.outer == 0:
            return op.Mul(op.Mul(x, t), half)
        if self.outer == 1:
            return op.Mul(op.Mul(half, x), t)
        return op.Mul(x, op.Mul(t, half))

    def check(self, context, x, c3, k, half, one, three=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.dtype not in _FLOATS:
            return result.fail("not a float input", x)
        if not (_close(c3, 0.044715) and _close(k, _SQRT_2_OVER_PI) and _close(half, 0.5) and _close(one, 1.0)):
            return result.fail("constants are not the tanh GELU's")
        if three is not None and not _close(three, 3.0):
            return result.fail("not a cube")
        return result

    def rewrite(self, op, x, **_):
        if self.opset >= 20 and not self.training:
            return op.Gelu(x, approximate="tanh")
        return op.FastGelu(x, _domain="com.microsoft")


# ------------------------------------------------------------------------------------- LayerNorm


class _LayerNorm(pattern.RewriteRuleClassBase):
    def __init__(self, affine: bool) -> None:
        super().__init__(f"LayerNorm{'Affine' if affine else ''}")
        self.affine = affine

    def pattern(self, op, x, two, eps, w, b):
        mean = op.ReduceMean(x, _allow_other_inputs=True, _outputs=["mean"])
        d = op.Sub(x, mean)
        var = op.ReduceMean(op.Pow(d, two), _allow_other_inputs=True, _outputs=["var"])
        norm = op.Div(d, op.Sqrt(op.Add(var, eps)))
        if self.affine:
            return op.Add(op.Mul(norm, w), b)
        return norm

    def check(self, context, x, two, eps, mean, var, w=None, b=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.dtype not in _FLOATS:
            return result.fail("not a float input", x)
        if not _close(two, 2.0) or _scalar(eps) is None:
            return result.fail("not a variance")
        rank = _rank(x)
        if not (_last_axis(_axes(mean, None), rank) and _last_axis(_axes(var, None), rank)):
            return result.fail("not a reduction over the last axis")
        for n in (mean.producer(), var.producer()):
            if "keepdims" in n.attributes and n.attributes["keepdims"].as_int() != 1:
                return result.fail("keepdims=0")
        if self.affine and (w.shape is None or len(w.shape) != 1 or b.shape is None or len(b.shape) != 1):
            return result.fail("the scale and bias are not vectors over the last axis")
        if not self.affine and _is_affine_tail(context):
            return result.fail("an affine LayerNorm: fused whole by the affine rule")
        return result

    def rewrite(self, op, x, eps, w=None, b=None, **_):
        epsilon = float(_scalar(eps))
        if not self.affine:
            shape = op.Slice(op.Shape(x), op.Constant(value_ints=[-1]), op.Constant(value_ints=[2**62]))
            w = op.Expand(op.Cast(op.Constant(value_float=1.0), to=int(x.dtype)), shape)
            b = op.Expand(op.Cast(op.Constant(value_float=0.0), to=int(x.dtype)), shape)
        # All three outputs: ORT's gradient of LayerNormalization reads the mean and 1/std.
        y, _mean, _inv_std = op.LayerNormalization(x, w, b, axis=-1, epsilon=epsilon, stash_type=1, _outputs=3)
        return y


# --------------------------------------------------------------------------------------- RMSNorm


class _RMSNorm(pattern.RewriteRuleClassBase):
    def __init__(self, reciprocal: int, weight_first: bool) -> None:
        super().__init__(f"RMSNorm{reciprocal}{int(weight_first)}")
        self.reciprocal, self.weight_first = reciprocal, weight_first

    def pattern(self, op, x, p, eps, w, numer, back):
        # ``x`` is what is squared: after Llama's cast to float32, which is left outside the pattern
        # because the residual branch reads it too. (tag_var names: onnxscript 0.7 cannot commute an
        # OrValue without one.)
        square = pattern.OrValue([op.Pow(x, p), op.Mul(x, x)], tag_var="square_form")
        ms = op.ReduceMean(square, _allow_other_inputs=True, _outputs=["ms"])
        rms = op.Sqrt(op.Add(ms, eps))
        if self.reciprocal == 0:
            norm = op.Mul(x, op.Reciprocal(rms))
        elif self.reciprocal == 1:
            norm = op.Div(x, rms)
        else:
            norm = op.Mul(x, op.Div(numer, rms))
        norm = pattern.OrValue([op.Cast(norm, to=back), norm], tag_var="cast_out")
        return op.Mul(w, norm) if self.weight_first else op.Mul(norm, w)

    def check(self, context, x, eps, w, ms, p=None, numer=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.dtype not in _FLOATS or w.dtype not in _FLOATS:
            return result.fail("not float")
        if p is not None and not _close(p, 2.0):
            return result.fail("not a square")
        if self.reciprocal == 2 and not _close(numer, 1.0):
            return result.fail("not 1 / rms")
        if _scalar(eps) is None:
            return result.fail("epsilon is not a constant")
        if not _last_axis(_axes(ms, None), _rank(x)):
            return result.fail("not a mean over the last axis")
        if w.shape is None or len(w.shape) != 1:
            return result.fail("the weight is not a vector over the last axis")
        if _centered(x):
            return result.fail("x - mean(x): a LayerNorm, fused by its own rule")
        return result

    def rewrite(self, op, x, eps, w, **_):
        # ORT's kernels take the scale in the input's dtype; the result has the weight's dtype, as
        # the matched ``w * norm`` has (Llama casts the normalized value back before the weight).
        scale = w if w.dtype == x.dtype else op.Cast(w, to=int(x.dtype))
        # Both outputs: ORT's gradient of SimplifiedLayerNormalization reads 1/rms.
        y, _inv_rms = op.SimplifiedLayerNormalization(
            x, scale, axis=-1, epsilon=float(_scalar(eps)), stash_type=1, _outputs=2
        )
        return y if w.dtype == x.dtype else op.Cast(y, to=int(w.dtype))


#: The op types each family's patterns need: a graph without them skips the family (matching
#: commuted patterns costs about a second per family on a GPT-sized graph).
_ANCHORS = {
    "gelu_erf": {"Erf"},
    "gelu_tanh": {"Tanh"},
    "layer_norm": {"ReduceMean", "Sub", "Sqrt"},
    "rms_norm": {"ReduceMean", "Sqrt"},
}


@functools.cache
def _rule_set(opset: int, training: bool, families: tuple[str, ...]) -> pattern.RewriteRuleSet:
    rules = []
    if "gelu_erf" in families:
        rules += [GeluErfRule.rule(opset, outer) for outer in range(3)]
    if "gelu_tanh" in families:
        rules += [GeluTanhRule.rule(opset, training, outer, cube) for outer in range(3) for cube in range(2)]
    if "layer_norm" in families:
        rules += [_LayerNorm.rule(True), _LayerNorm.rule(False)]
    if "rms_norm" in families:
        rules += [_RMSNorm.rule(r, first) for r in range(3) for first in (False, True)]
    return pattern.RewriteRuleSet(rules, commute=True)


def fusion_rules(
    opset: int, *, training: bool, gelu: bool = True, norms: bool = True, op_types: set[str] | None = None
) -> pattern.RewriteRuleSet | None:
    """The rule set for a graph of ``opset``; ``gelu``/``norms`` choose the families, and
    ``op_types`` (the graph's op types, if given) leaves out families that cannot match."""
    families = [
        f for f, on in (("gelu_erf", gelu), ("gelu_tanh", gelu), ("layer_norm", norms), ("rms_norm", norms)) if on
    ]
    if op_types is not None:
        families = [f for f in families if _ANCHORS[f] <= op_types]
    return _rule_set(opset, training, tuple(families)) if families else None


def forget_matches(rules: pattern.RewriteRuleSet) -> None:
    """Drop what the matchers of ``rules`` hold of the last graph they matched in.

    NOTE: onnxscript's ``SimplePatternMatcher`` keeps, after a match, the graph it matched in, the
    match's bindings and the node it stopped at, until its next match. The rule sets here are
    cached for the process (the commuted tanh GELU patterns take ~0.35 CPU s and ~8 MiB to build),
    so without this each keeps the whole onnx_ir model of the last build that ran it alive. The
    attributes are onnxscript's (0.7); a matcher without them has nothing to drop."""
    for rule in rules.rules:
        state = vars(getattr(rule, "_matcher", None) or object())
        for attr in ("_graph", "_match", "_current_node", "_tracer"):
            if attr in state:
                state[attr] = None


def apply_at_gelus(rules: pattern.RewriteRuleSet, model: ir.Model, cores: Iterable[str]) -> int:
    """Apply GELU ``rules`` only where a GELU can end: a Mul one or two steps after the ``Add``
    that reads a node of the ``cores`` op types (its Erf or Tanh), in the graph and its subgraphs.
    (``RewriteRuleSet.apply_to_model`` tries each commuted pattern, 960 for the tanh GELU, at every
    node: seconds on a GPT graph.) The rule that matched is tried first at the next core, as a
    graph writes its GELUs alike. Returns the number of GELUs rewritten."""
    order = list(rules.rules)
    count = 0
    for core in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        graph = core.graph
        if graph is None or core.op_type not in cores or core.domain not in _ONNX:
            continue
        roots = [mul for add, _ in core.outputs[0].uses() for mul, _ in add.outputs[0].uses()]
        roots += [after for mul in roots for after, _ in mul.outputs[0].uses()]
        roots = [r for r in roots if r.op_type == "Mul" and r.domain in _ONNX and r.graph is graph]
        for i, rule in enumerate(order):
            for root in roots:
                delta = rule.try_rewrite(model, graph, root)
                if delta is not None:
                    ir.convenience.replace_nodes_and_values(
                        graph, root, delta.match.nodes, delta.new_nodes, delta.match.outputs, delta.new_outputs
                    )
                    break
            else:
                continue
            order.insert(0, order.pop(i))
            count += 1
            break
    forget_matches(rules)
    return count


def apply_fusions(model: ir.Model, *, training: bool, gelu: bool, norms: bool) -> int:
    """:class:`~.fusions.StandardOpFusionPass`'s work: the GELU families only where a GELU can end
    (:func:`apply_at_gelus`), then the norm rules over the graph. Returns the number of fusions."""
    opset = model.opset_imports.get("", 17)
    op_types = {n.op_type for n in model.graph if n.domain in _ONNX}
    count = 0
    if gelu:
        for family in ("gelu_erf", "gelu_tanh"):
            if _ANCHORS[family] <= op_types:
                count += apply_at_gelus(_rule_set(opset, training, (family,)), model, _ANCHORS[family])
    rules = fusion_rules(opset, training=training, gelu=False, norms=norms, op_types=op_types)
    if rules is not None:
        count += rules.apply_to_model(model)
        forget_matches(rules)
    if count and any(n.domain == "com.microsoft" for n in model.graph):
        model.opset_imports.setdefault("com.microsoft", 1)
    return count
