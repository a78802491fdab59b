"""Run the erf GELU, LayerNorm, cross-entropy, max pooling and embedding lookups on ortwrap's CPU kernels (``ortwrap.kernels``).

Rewrites, float32 only, each into one ``org.pytorch.aten::ATen`` node (``operator="ortwrap_cpu::*"``)
whose gradient definition pairs it with its backward kernel:

* ``0.5 * x * (1 + Erf(x * 1/sqrt(2)))`` (both exporters' ``F.gelu``; also with ``Div(x,
  sqrt(2))``, the form before ``UnfuseErfGeluPass``), the 0.5 anywhere -> ``gelu(x)``. The
  intermediate values must have no other consumer.
* The tanh GELU, ``0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))`` (``F.gelu(x,
  approximate="tanh")`` from either exporter, transformers' ``gelu_new`` with ``Pow``), the 0.5
  anywhere -> ``gelu_tanh(x)``.

The two GELUs are onnxscript rewrite rules (the GroupNorm below is one too; all three in
``passes/kernel_patterns.py``, imported on first use): ``passes/fusion_patterns.py``'s patterns (every operand order),
with this pass's check (float32; the constants as written, or rounded to half precision) and
replacement (the kernel's ATen node). The other rewrites start at one node each.
* ``LayerNormalization(X, Scale, B)`` with all three outputs (``RestoreOptionalOutputsPass`` adds
  them), a bias and ``stash_type=1`` -> ``layer_norm(X, Scale, B, epsilon, axis)``: the same three
  outputs, mean and inverse standard deviation in the same shapes.
* Both exporters' affine ``nn.GroupNorm`` (``Reshape`` to ``[0, G, -1]``, ``InstanceNormalization``
  with scale ones and bias zeros, ``Reshape`` back, ``Mul`` gamma, ``Add`` beta), and the SiLU's
  ``Mul(z, Sigmoid(z))`` after it where nothing else reads ``z`` -> ``group_norm(x, gamma, beta,
  epsilon, groups, silu)``: an onnxscript rewrite rule (``kernel_patterns._GroupNormKernel``) tried at each
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

import math

import numpy as np
import onnx_ir as ir

from ..graph.names import ATEN_DOMAIN
from ..ops import KERNELS, OPS_NAMESPACE
from ._build import NodeBuilder, constant_value, ints_attr
from .gather_to_gathernd import parameter_lookup
from .kernel_nodes import ONNX_DOMAINS, kernel_node, scalar_constant

#: The rewrites that are onnxscript rewrite rules (``passes/kernel_patterns.py``'s ``RULES``, imported
#: on first use): ``Kernel.rewrite`` names.
_RULES = ("_gelu", "_gelu_tanh", "_group_norm")


def _rule_patterns():
    from . import kernel_patterns

    return kernel_patterns


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
        present = {n.op_type for n in graph if n.domain in ONNX_DOMAINS}
        if self.ops is not None:
            present &= set(self.ops)
        for k in KERNELS:
            if k.rewrite in _RULES and set(k.replaces) <= present:
                self.rewritten[k.name] += _rule_patterns().RULES[k.rewrite](model, k.replaces)
        for node in list(graph):
            if node.graph is None or (node.domain not in ONNX_DOMAINS and node.op_type != "ATen"):
                continue  # removed by an earlier rewrite
            if self.ops is not None and node.op_type not in self.ops:
                continue
            for method in _REWRITES.get(node.op_type, ()):
                if node.graph is None:
                    break
                if method not in _RULES:
                    getattr(self, method)(graph, node)
        return ir.passes.PassResult(model, modified=any(self.rewritten.values()))

    # The GELUs and the GroupNorm: rewrite rules (:data:`_RULES`), applied first; these give their rule sets.
    @staticmethod
    def _gelu():
        return _rule_patterns()._gelu_rules()

    @staticmethod
    def _gelu_tanh():
        return _rule_patterns()._gelu_tanh_rules()

    @staticmethod
    def _group_norm():
        return _rule_patterns()._group_norm_rules()

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
            alpha, beta = scalar_constant(node.inputs[1]), scalar_constant(node.inputs[2])
            if alpha is None or beta is None or abs(alpha - 1 / 6) >= 1e-7 or beta != 0.5:
                return
            name = "hardsigmoid"
        else:
            return
        b = NodeBuilder(node.name or f"{name}_{id(node):x}")
        y = kernel_node(b, name, x)
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
        y = kernel_node(b, "clamp", x, lo, hi)
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
        ln = kernel_node(b, "layer_norm", *node.inputs, eps_value, axis_value, outputs=3)
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
        inorm = kernel_node(b, "instance_norm", *node.inputs, eps_value)
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
        pool = kernel_node(b, "max_pool", x, params)
        pool.outputs[0].shape = node.outputs[0].shape
        b.replace(graph, node, list(pool.outputs))  # (the indices, where written, are read by nothing)
        self.rewritten["max_pool"] += 1

    def _embedding(self, graph: ir.Graph, node: ir.Node) -> None:
        lookup = parameter_lookup(node, {ir.DataType.FLOAT})
        if lookup is None:
            return
        table, indices = lookup
        b = NodeBuilder(node.name or f"embedding_{id(node):x}")
        lookup = kernel_node(b, "embedding", table, indices)
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
        ce = kernel_node(b, "cross_entropy", scores, labels, ignore_value, mode_value, outputs=2)
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
        sm = kernel_node(b, "softmax", x)
        b.replace(graph, node, list(sm.outputs))
        self.rewritten["softmax"] += 1


#: ONNX op type -> the rewrites that start there (``Kernel.replaces``, ``Kernel.rewrite``).
_REWRITES: dict[str, tuple[str, ...]] = {}
for _k in KERNELS:
    for _op in _k.replaces:
        if _k.rewrite not in _REWRITES.get(_op, ()):
            _REWRITES[_op] = (*_REWRITES.get(_op, ()), _k.rewrite)
