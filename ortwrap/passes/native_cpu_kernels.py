"""Run the erf GELU, LayerNorm, cross-entropy, max pooling and embedding lookups on ortwrap's CPU kernels (``ortwrap.kernels``).

Rewrites, float32 only, each into one ``org.pytorch.aten::ATen`` node (``operator="ortwrap_cpu::*"``)
whose gradient definition pairs it with its backward kernel:

* ``0.5 * x * (1 + Erf(x * 1/sqrt(2)))`` (both exporters' ``F.gelu``; also with ``Div(x,
  sqrt(2))``, the form before ``UnfuseErfGeluPass``), the 0.5 anywhere -> ``gelu(x)``. The
  intermediate values must have no other consumer.
* The tanh GELU, ``0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))`` (``F.gelu(x,
  approximate="tanh")`` from either exporter, transformers' ``gelu_new`` with ``Pow``), the 0.5
  anywhere -> ``gelu_tanh(x)``.

The two GELUs are onnxscript rewrite rules (the GroupNorm below is one too): ``passes/fusions.py``'s patterns (every operand order),
with this pass's check (float32; the constants as written, or rounded to half precision) and
replacement (the kernel's ATen node). The other rewrites start at one node each.
* ``LayerNormalization(X, Scale, B)`` with all three outputs (``RestoreOptionalOutputsPass`` adds
  them), a bias and ``stash_type=1`` -> ``layer_norm(X, Scale, B, epsilon, axis)``: the same three
  outputs, mean and inverse standard deviation in the same shapes.
* Both exporters' affine ``nn.GroupNorm`` (``Reshape`` to ``[0, G, -1]``, ``InstanceNormalization``
  with scale ones and bias zeros, ``Reshape`` back, ``Mul`` gamma, ``Add`` beta), and the SiLU's
  ``Mul(z, Sigmoid(z))`` after it where nothing else reads ``z`` -> ``group_norm(x, gamma, beta,
  epsilon, groups, silu)``: an onnxscript rewrite rule (:class:`_GroupNormKernel`) tried at each
  ``InstanceNormalization`` first, then the next rewrite takes what it leaves.
* ``InstanceNormalization(x, scale, bias)`` in float32 (both exporters' ``nn.GroupNorm`` and
  ``nn.InstanceNorm*d``) -> ``instance_norm(x, scale, bias, epsilon)``: one node each way instead
  of ``DecomposeInstanceNormPass``'s ~60 (the pipeline runs this rewrite alone before that pass).
* ``SoftmaxCrossEntropyLoss(scores, labels)`` on 2-D float scores without class weights, whose
  ``log_prob`` output nothing else reads -> ``cross_entropy(scores, labels, ignore_index,
  reduction)``, same two outputs.
* ``ortwrap_ops::hardswish(x)`` and ``ortwrap_ops::hard_sigmoid(x, 1/6, 1/2)`` (what
  ``TorchGradientsPass`` made of ``HardSwish`` and PyTorch's ``HardSigmoid``) -> ``hardswish(x)``,
  ``hardsigmoid(x)``: PyTorch's formulas in C, without a Python call per node and step.
* The ATen nodes ``hardtanh``/``relu6`` and (torch 2.14: ``ops.ATEN_OPS``) ``clamp``/``clip``/
  ``clamp_min``/``clamp_max`` with number bounds -> ``clamp(x, lo, hi)``:
  gradient 0 at a bound as eager's, without a Python call per node and step.
* ``Softmax`` over the last dimension (opset 13 and later; float) -> ``softmax(x)``.
* ``MaxPool`` over 1 or 2 spatial dimensions of a float32 input in floor mode (``ceil_mode=0``,
  ``storage_order=0``, explicit pads or ``VALID``), its indices unread -> ``max_pool(x, params)``,
  without the int64 indices ORT's gradient adds (~9x the pooling's cost), and sized at run time (ORT's
  ``MaxPoolGrad`` sizes its result from the inferred shape). Runs early (stage ``NativeEarly``, with
  the ``InstanceNormalization`` rewrites), before ``TorchGradientsPass`` routes what it leaves where
  sizes are unknown to PyTorch's op.
* ``Gather(table, indices, axis=0)`` with a graph-input table (a parameter) and int64 indices not
  produced by ``Range`` (ORT makes those a ``Slice``) -> ``embedding(table, indices)``; negative
  indices count from the end, as in ``Gather``.

Values keep their inferred types and shapes. Where inference left an input's type unknown (after
an op ONNX cannot infer), the op's type constraint gives it: ``Mul``'s and ``LayerNormalization``'s
inputs share one type with the constant or the scale. CPU training graphs only: ORT's CUDA kernels for
these ops are fast, and an inference graph gets ORT's own fusions.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from ..graph.names import ATEN_DOMAIN, NATIVE_PREFIX
from ..ops import KERNELS, OPS_NAMESPACE, kernel
from ._build import NodeBuilder, constant_value, ints_attr
from .fusions import GeluErfRule, GeluTanhRule, apply_at_gelus, forget_matches
from .gather_to_gathernd import parameter_lookup

_ONNX = ("", "ai.onnx")


def _scalar(value: ir.Value | None) -> float | None:
    v = constant_value(value)
    if v is None or v.size != 1 or v.dtype.kind != "f":
        return None
    return float(v.reshape(-1)[0])


def _half_rounded(value: float) -> tuple[float, float]:
    """``value`` rounded to bfloat16 (to nearest even) and to float16."""
    bits = int(np.array(value, dtype=np.float32).view(np.uint32))
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return float(np.array(bits, dtype=np.uint32).view(np.float32)), float(np.float16(value))


def _is_constant(value: ir.Value | None, want: float, tol: float) -> bool:
    """``value`` is the constant ``want``, or ``want`` rounded to half precision: a graph exported
    under autocast, or from a bf16/fp16 model, holds its GELU's constants in half precision, and
    ``HalfPrecisionOnCPUPass`` makes them float32 as they are (eager's GELU kernel computes with
    the exact constants, as ortwrap's does)."""
    k = _scalar(value)
    return k is not None and (abs(k - want) < tol or k in _half_rounded(want))


def _const_dtype(value: ir.Value | None) -> ir.DataType | None:
    v = constant_value(value)
    return None if v is None else ir.DataType.from_numpy(v.dtype)


class _GeluKernel(GeluErfRule):
    """:class:`~.fusions.GeluErfRule`'s pattern -> ``gelu(x)``."""

    def __init__(self, outer: int) -> None:
        super().__init__(0, outer, name="GeluKernel")

    def check(self, context, x, c, half, one, scaled_by, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        want = math.sqrt(2) if scaled_by == "Div" else 1 / math.sqrt(2)
        if not _is_constant(c, want, 1e-6) or _scalar(half) != 0.5 or _scalar(one) != 1.0:
            return result.fail("constants are not GELU's")
        # Mul and Div take one type T: x has the constant's type when inference left it unknown.
        if (x.dtype or _const_dtype(c)) != ir.DataType.FLOAT:
            return result.fail("not float32", x)
        return result

    def rewrite(self, op, x, **_):
        return _aten(op, "gelu", x)


class _GeluTanhKernel(GeluTanhRule):
    """:class:`~.fusions.GeluTanhRule`'s pattern -> ``gelu_tanh(x)``."""

    def __init__(self, outer: int, cube: int) -> None:
        super().__init__(0, True, outer, cube, name="GeluTanhKernel")

    def check(self, context, x, c3, k, half, one, three=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if not (_is_constant(k, math.sqrt(2 / math.pi), 1e-6) and _is_constant(c3, 0.044715, 1e-7)):
            return result.fail("constants are not the tanh GELU's")
        if _scalar(half) != 0.5 or _scalar(one) != 1.0:
            return result.fail("constants are not the tanh GELU's")
        power = constant_value(three) if three is not None else None
        if three is not None and (power is None or power.size != 1 or float(power.reshape(-1)[0]) != 3.0):
            return result.fail("not a cube")
        if (x.dtype or _const_dtype(k)) != ir.DataType.FLOAT:
            return result.fail("not float32", x)
        return result

    def rewrite(self, op, x, **_):
        return _aten(op, "gelu_tanh", x)


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
        y = _aten(op, "group_norm", x, gamma, beta, *(op.Constant(value=ir.tensor(v)) for v in scalars))
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
        if graph is None or core.op_type != "InstanceNormalization" or core.domain not in _ONNX:
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
_RULES = {
    "_gelu": lambda model, cores: apply_at_gelus(_gelu_rules(), model, cores),
    "_gelu_tanh": lambda model, cores: apply_at_gelus(_gelu_tanh_rules(), model, cores),
    "_group_norm": _apply_group_norms,
}


_OUTPUT_TYPES = {
    "f": ir.DataType.FLOAT,
    "h": ir.DataType.BFLOAT16,
    "F": ir.DataType.FLOAT,
    "i": ir.DataType.INT64,
    "I": ir.DataType.INT64,
}


def _declared(name: str, inputs: int, outputs: int) -> list[str]:
    """The output types of kernel ``name``, which must take ``inputs`` and write ``outputs``."""
    declared = kernel(name)
    if outputs != len(declared.outputs) or inputs != len(declared.inputs):
        raise AssertionError(f"ortwrap_cpu::{name} is declared as {declared.signature!r}")
    return declared.outputs


def _aten(b: NodeBuilder | Any, name: str, *inputs: ir.Value | None, outputs: int = 1) -> ir.Node | ir.Value:
    """The ATen node calling kernel ``name``, its outputs typed from the declaration. ``b``: a
    NodeBuilder (returns the node), or a rule's op builder (returns its one output)."""
    types = _declared(name, len(inputs), outputs)
    attrs = {"operator": NATIVE_PREFIX + name, "overload_name": ""}
    if isinstance(b, NodeBuilder):
        node = b.node("ATen", list(inputs), domain=ATEN_DOMAIN, outputs=outputs, **attrs)
        values = list(node.outputs)
    else:
        node = b.ATen(*inputs, _domain=ATEN_DOMAIN, **attrs)
        values = [node]
    for v, t in zip(values, types):  # ORT cannot infer the outputs of ATen nodes
        v.dtype = _OUTPUT_TYPES[t]
    return node


class NativeCPUKernelsPass(ir.passes.InPlacePass):
    """Replace erf GELUs, LayerNormalizations, cross-entropies and parameter lookups with ortwrap's CPU kernels."""

    def __init__(self, ops: tuple[str, ...] | None = None) -> None:
        """``ops``: only the rewrites that start at these op types (``InstanceNormalization``, before
        ``DecomposeInstanceNormPass``); None: all of them."""
        super().__init__()
        self.ops = ops
        self.rewritten: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.rewritten = {k.name: 0 for k in KERNELS if k.gradient is not None and k.replaces}  # per rewrite
        present = {n.op_type for n in graph if n.domain in _ONNX}
        if self.ops is not None:
            present &= set(self.ops)
        for k in KERNELS:
            apply = _RULES.get(k.rewrite)
            if apply is not None and set(k.replaces) <= present:
                self.rewritten[k.name] += apply(model, k.replaces)
        for node in list(graph):
            if node.graph is None or (node.domain not in _ONNX and node.op_type != "ATen"):
                continue  # removed by an earlier rewrite
            if self.ops is not None and node.op_type not in self.ops:
                continue
            for method in _REWRITES.get(node.op_type, ()):
                if node.graph is None:
                    break
                if method not in _RULES:
                    getattr(self, method)(graph, node)
        return ir.passes.PassResult(model, modified=any(self.rewritten.values()))

    # The GELUs: rewrite rules (:data:`_RULES`), applied first.
    _gelu = staticmethod(_gelu_rules)
    _gelu_tanh = staticmethod(_gelu_tanh_rules)
    _group_norm = staticmethod(_group_norm_rules)

    def _hard_activation(self, graph: ir.Graph, node: ir.Node) -> None:
        """``ortwrap_ops::hardswish(x)`` -> ``hardswish(x)``; ``ortwrap_ops::hard_sigmoid(x, 1/6, 1/2)``
        (PyTorch's hardsigmoid; other alpha and beta stay PyTorch ops) -> ``hardsigmoid(x)``."""
        if node.domain != ATEN_DOMAIN or node.attributes.get("operator") is None or not node.inputs:
            return
        op = node.attributes["operator"].as_string()
        x = node.inputs[0]
        if x is None or x.dtype != ir.DataType.FLOAT or len(node.outputs) != 1:
            return
        if op == f"{OPS_NAMESPACE}::hardswish" and len(node.inputs) == 1:
            name = "hardswish"
        elif op == f"{OPS_NAMESPACE}::hard_sigmoid" and len(node.inputs) == 3:
            alpha, beta = _scalar(node.inputs[1]), _scalar(node.inputs[2])
            if alpha is None or beta is None or abs(alpha - 1 / 6) >= 1e-7 or beta != 0.5:
                return
            name = "hardsigmoid"
        else:
            return
        b = NodeBuilder(node.name or f"{name}_{id(node):x}")
        y = _aten(b, name, x)
        y.outputs[0].shape = x.shape
        b.replace(graph, node, list(y.outputs))
        self.rewritten[name] += 1

    def _clamp(self, graph: ir.Graph, node: ir.Node) -> None:
        """The ATen nodes ``hardtanh``/``relu6`` (always: ``ops.ATEN_OPS``) and ``clamp``/``clip``/
        ``clamp_min``/``clamp_max`` with number bounds (ATen nodes only where the installed torch's
        clamp gives 0 at a bound, torch 2.14) -> ``clamp(x, lo, hi)``, an absent bound NaN. Same values and gradients (0 at a bound), no Python call per node and step."""
        if node.domain != ATEN_DOMAIN or node.attributes.get("operator") is None or not node.inputs:
            return
        op = node.attributes["operator"].as_string()
        overload = node.attributes.get("overload_name")
        if overload is not None and overload.as_string() not in ("", "default"):
            return  # clamp.Tensor (tensor bounds): another convention
        x = node.inputs[0]
        if x is None or x.dtype != ir.DataType.FLOAT or len(node.outputs) != 1:
            return
        defaults = {"relu6": (0.0, 6.0), "hardtanh": (-1.0, 1.0)}
        if op in defaults:
            bounds = list(defaults[op])
        elif op in ("clamp", "clip", "clamp_min", "clamp_max"):
            from ..ops.torch_ops import clamp_passes_gradient_at_bounds

            if clamp_passes_gradient_at_bounds():  # (an ATen clamp there has tensor bounds)
                return
            bounds = [math.nan, math.nan]
        else:
            return
        args = list(node.inputs[1:])
        if op == "clamp_max":
            args = [None, *args]
        if (op == "relu6" and args) or len(args) > 2:
            return
        for i, v in enumerate(args):
            if v is None:
                if op in defaults:
                    return
                continue
            c = constant_value(v)
            if c is None or c.size != 1 or c.dtype.kind not in "fiu":
                return
            bounds[i] = float(c.reshape(-1)[0])
        b = NodeBuilder(node.name or f"clamp_{id(node):x}")
        lo, hi = (b.const(np.array(v, dtype=np.float32)) for v in bounds)
        y = _aten(b, "clamp", x, lo, hi)
        y.outputs[0].shape = x.shape
        b.replace(graph, node, list(y.outputs))
        self.rewritten["clamp"] += 1

    def _layer_norm(self, graph: ir.Graph, node: ir.Node) -> None:
        if len(node.inputs) != 3 or len(node.outputs) != 3 or any(v is None for v in node.inputs):
            return
        # X, Scale and B share one type T: X has the scale's when inference left it unknown.
        if any((v.dtype or node.inputs[1].dtype) != ir.DataType.FLOAT for v in node.inputs):
            return
        stash = node.attributes.get("stash_type")
        if stash is not None and stash.as_int() != 1:
            return
        axis = node.attributes.get("axis")
        eps = node.attributes.get("epsilon")
        b = NodeBuilder(node.name or f"layer_norm_{id(node):x}")
        eps_value = b.const(np.array(eps.as_float() if eps is not None else 1e-5, dtype=np.float32))
        axis_value = b.const(np.array(axis.as_int() if axis is not None else -1, dtype=np.int64))
        ln = _aten(b, "layer_norm", *node.inputs, eps_value, axis_value, outputs=3)
        x = node.inputs[0]
        for stat in ln.outputs[1:]:  # mean and rstd: shape[:axis] + 1s
            if x.shape is not None:
                k = axis.as_int() if axis is not None else -1
                k = k + len(x.shape) if k < 0 else k
                stat.shape = ir.Shape([d if i < k else 1 for i, d in enumerate(x.shape)])
        b.replace(graph, node, list(ln.outputs))
        self.rewritten["layer_norm"] += 1

    def _instance_norm(self, graph: ir.Graph, node: ir.Node) -> None:
        """``InstanceNormalization(x, scale, bias)`` (both exporters' ``nn.GroupNorm`` on ``x``
        reshaped to ``[N, G, -1]``, and ``nn.InstanceNorm*d``), float32 -> ``instance_norm(x, scale,
        bias, epsilon)``."""
        if len(node.inputs) != 3 or len(node.outputs) != 1 or any(v is None for v in node.inputs):
            return
        # the three inputs share one type T: x has the scale's when inference left it unknown.
        if any((v.dtype or node.inputs[1].dtype) != ir.DataType.FLOAT for v in node.inputs):
            return
        x = node.inputs[0]
        if x.shape is not None and len(x.shape) < 2:
            return
        eps = node.attributes.get("epsilon")
        b = NodeBuilder(node.name or f"instance_norm_{id(node):x}")
        eps_value = b.const(np.array(eps.as_float() if eps is not None else 1e-5, dtype=np.float32))
        inorm = _aten(b, "instance_norm", *node.inputs, eps_value)
        y = inorm.outputs[0]
        y.shape = node.outputs[0].shape or x.shape
        b.replace(graph, node, [y])
        self.rewritten["instance_norm"] += 1

    def _max_pool(self, graph: ir.Graph, node: ir.Node) -> None:
        """``MaxPool`` over the 1 or 2 spatial dimensions of a float32 ``x [N, C, (H,) W]`` in floor mode,
        its indices unread (ORT's gradient would add them) -> ``max_pool(x, params)``: a 1-D pool's
        params are a 2-D pool's over ``H = 1``."""
        x = node.inputs[0] if node.inputs else None
        if x is None or x.dtype != ir.DataType.FLOAT or x.shape is None or len(x.shape) not in (3, 4):
            return
        spatial = len(x.shape) - 2
        if any(v.uses() or v.is_graph_output() for v in node.outputs[1:]):
            return  # the indices are read: ORT's MaxPool writes them
        auto_pad = node.attributes.get("auto_pad")
        if auto_pad is not None and auto_pad.as_string() not in ("NOTSET", "VALID"):
            return
        for name in ("ceil_mode", "storage_order"):
            a = node.attributes.get(name)
            if a is not None and a.as_int() != 0:
                return
        kernel_shape = ints_attr(node, "kernel_shape", [])
        strides, dilations = ints_attr(node, "strides", [1] * spatial), ints_attr(node, "dilations", [1] * spatial)
        pads = ints_attr(node, "pads", [0] * 2 * spatial)
        if auto_pad is not None and auto_pad.as_string() == "VALID":
            pads = [0] * 2 * spatial
        if any(len(a) != n * spatial for a, n in ((kernel_shape, 1), (strides, 1), (dilations, 1), (pads, 2))):
            return
        if spatial == 1:  # [N, C, W] as [N, C, 1, W]
            kernel_shape, strides, dilations = [1, *kernel_shape], [1, *strides], [1, *dilations]
            pads = [0, pads[0], 0, pads[1]]
        b = NodeBuilder(node.name or f"max_pool_{id(node):x}")
        params = b.const(np.array([*kernel_shape, *strides, *pads, *dilations], dtype=np.int64))
        pool = _aten(b, "max_pool", x, params)
        pool.outputs[0].shape = node.outputs[0].shape
        b.replace(graph, node, list(pool.outputs))  # (the indices, where written, are read by nothing)
        self.rewritten["max_pool"] += 1

    def _embedding(self, graph: ir.Graph, node: ir.Node) -> None:
        lookup = parameter_lookup(node, {ir.DataType.FLOAT})
        if lookup is None:
            return
        table, indices = lookup
        b = NodeBuilder(node.name or f"embedding_{id(node):x}")
        lookup = _aten(b, "embedding", table, indices)
        if table.shape is not None and indices.shape is not None:
            lookup.outputs[0].shape = ir.Shape([*indices.shape, *table.shape[1:]])
        b.replace(graph, node, list(lookup.outputs))
        self.rewritten["embedding"] += 1

    def _cross_entropy(self, graph: ir.Graph, node: ir.Node) -> None:
        if len(node.inputs) != 2 or len(node.outputs) != 2:
            return  # class weights: ORT's kernel
        scores, labels = node.inputs
        if scores is None or labels is None or scores.dtype != ir.DataType.FLOAT or labels.dtype != ir.DataType.INT64:
            return
        if scores.shape is None or len(scores.shape) != 2:
            return
        log_prob = node.outputs[1]
        if log_prob.uses() or log_prob.is_graph_output():
            return  # the backward kernel takes no log_prob gradient
        reduction = node.attributes.get("reduction")
        mode = {"none": 0, "mean": 1, "sum": 2}.get(reduction.as_string() if reduction is not None else "mean")
        if mode is None:
            return
        ignore = node.attributes.get("ignore_index")
        b = NodeBuilder(node.name or f"cross_entropy_{id(node):x}")
        ignore_value = b.const(np.array(ignore.as_int() if ignore is not None else np.iinfo(np.int64).min))
        mode_value = b.const(np.array(mode, dtype=np.int64))
        ce = _aten(b, "cross_entropy", scores, labels, ignore_value, mode_value, outputs=2)
        ce.outputs[1].shape = scores.shape
        b.replace(graph, node, list(ce.outputs))
        self.rewritten["cross_entropy"] += 1

    def _softmax(self, graph: ir.Graph, node: ir.Node) -> None:
        x = node.inputs[0]
        if x is None or x.dtype != ir.DataType.FLOAT or x.shape is None or len(x.shape) == 0:
            return
        axis = node.attributes.get("axis")
        k = axis.as_int() if axis is not None else -1
        opset = node.version or graph.opset_imports.get("", 13)
        if opset < 13 and len(x.shape) > 1:
            return  # before opset 13, Softmax flattens from axis: not a last-dimension softmax
        if k not in (-1, len(x.shape) - 1):
            return
        b = NodeBuilder(node.name or f"softmax_{id(node):x}")
        sm = _aten(b, "softmax", x)
        b.replace(graph, node, list(sm.outputs))
        self.rewritten["softmax"] += 1


#: ONNX op type -> the rewrites that start there (``Kernel.replaces``, ``Kernel.rewrite``).
_REWRITES: dict[str, tuple[str, ...]] = {}
for _k in KERNELS:
    for _op in _k.replaces:
        if _k.rewrite not in _REWRITES.get(_op, ()):
            _REWRITES[_op] = (*_REWRITES.get(_op, ()), _k.rewrite)
