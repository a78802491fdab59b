"""The ATen nodes' part of the gradient build (moved here from ``bridge/aten.py``, which keeps the
runner): the fix-ups before ORT's gradient builder runs (:func:`declare_output_types`,
:func:`mark_bool_inputs`), the gradient definitions ORT's builder writes for ATen nodes
(:func:`register_gradients`: PyTorch's vjp of the op, or its explicit backward op), and the fix-ups of
the built graph (:func:`mark_used_outputs`, :func:`drop_missing_gradients`).
"""

from __future__ import annotations

import json
from typing import Any

import onnx
import torch

from .._compat import torch as compat
from .._ort import C
from ..bridge.aten import NO_GRADIENT_OPS, resolve
from ..export.type_inference import value_types
from ..graph.names import ATEN_BOOL_MARK, ATEN_DOMAIN, NATIVE_PREFIX, OUTS_MARK, USED_MARK, VJP_PREFIX
from ..ops import OWN_GRADIENT_OPS  # ops whose gradient definition their owner registers: no vjp

__all__ = [
    "declare_output_types",
    "drop_missing_gradients",
    "mark_bool_inputs",
    "mark_used_outputs",
    "register_gradient",
    "register_gradients",
]


# ---------------------------------------------------------------------------- before the build
def declare_output_types(model: onnx.ModelProto) -> None:
    """Copy the types of graph outputs produced by ATen nodes into ``value_info``.

    The gradient builder turns graph outputs into inputs of its ``YieldOp``; an ATen output then
    loses the type that ``graph.output`` declared, and ORT has no type inference for ATen.
    """
    produced = {o for n in model.graph.node if n.domain == ATEN_DOMAIN for o in n.output}
    known = {v.name for v in model.graph.value_info}
    for out in model.graph.output:
        if out.name in produced and out.name not in known:
            model.graph.value_info.append(out)


def mark_bool_inputs(model: onnx.ModelProto) -> None:
    """Name the bool tensor inputs of each ATen node in its ``overload_name`` (``ATEN_BOOL_MARK``), so the
    executor can give the op bool tensors again (see :func:`_restore_bools`). A node whose gradient
    is an explicit backward op, or ortwrap's own kernels, is left alone."""
    from ..ops import TORCH_OP_GRADIENTS

    elem = {}
    for v in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        if v.type.tensor_type.elem_type:
            elem[v.name] = v.type.tensor_type.elem_type
    for t in model.graph.initializer:
        elem[t.name] = t.data_type
    for node in model.graph.node:
        if node.op_type == "Constant" and not node.domain:
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    elem[node.output[0]] = a.t.data_type
    for node in model.graph.node:
        if node.domain != ATEN_DOMAIN or node.op_type != "ATen":
            continue
        attrs = {a.name: a for a in node.attribute}
        op = attrs["operator"].s.decode()
        if op.startswith((VJP_PREFIX, NATIVE_PREFIX)) or op in TORCH_OP_GRADIENTS or op in OWN_GRADIENT_OPS:
            continue
        bools = [str(i) for i, name in enumerate(node.input) if name and elem.get(name) == onnx.TensorProto.BOOL]
        if not bools:
            continue
        overload = attrs["overload_name"].s.decode() if "overload_name" in attrs else ""
        if ATEN_BOOL_MARK in overload:
            continue
        marked = f"{overload}{ATEN_BOOL_MARK}{','.join(bools)}"
        if "overload_name" in attrs:
            attrs["overload_name"].s = marked.encode()
        else:
            node.attribute.append(onnx.helper.make_attribute("overload_name", marked))


# -------------------------------------------------------------------------------------- gradients
#: key -> (inputs, outputs, output gradients) of the definition registered for it
_gradient_arity: dict[str, tuple[int, int, tuple[str, ...]]] = {}
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def _gradient_attribute(name: str, value: str):
    """A string attribute of a node in an ORT gradient definition."""
    a = C.GradientNodeAttributeDefinition()
    a.name = name
    a.value_json = json.dumps(value)
    a.dtype = "string"
    a.is_tensor = False
    return a


def register_gradient(
    forward: str, overload: str, inputs: list[str], outputs: list[str], backward: str, stop: set[int]
) -> str:
    """Register with ORT that the gradient of ``ATen(operator=forward, overload_name=overload)`` is one
    ``ATen(operator=backward, overload_name=overload)`` node reading ``inputs`` (``GO(j)``, ``I(i)``,
    ``O(k)``) and writing ``outputs`` (``GI(i)``); ``stop``: forward inputs that get no gradient.
    Returns ORT's key of the definition."""
    key = f"{ATEN_DOMAIN}::ATen::{forward}::{overload}"
    d = C.GradientNodeDefinition()
    d.op_type, d.domain = "ATen", ATEN_DOMAIN
    d.inputs, d.outputs = inputs, outputs
    d.attributes = [_gradient_attribute("operator", backward), _gradient_attribute("overload_name", overload)]
    C.register_gradient_definition(key, [d])
    if stop:
        C.register_custom_stop_gradient_edges(key, stop)
    return key


def register_gradients(model: onnx.ModelProto) -> list[str]:
    """Register the vjp gradient definition of every ATen op in ``model``; return their keys.

    ORT keys a gradient definition by ``(operator, overload)`` and reads inputs ``I(i)`` by
    position, so all nodes of one op must have the same number of inputs.
    """
    from ..ops import TORCH_OP_GRADIENTS

    keys = []
    types = value_types(model)
    constants: dict[str, Any] | None = None  # (read when a random op needs them)
    for node in model.graph.node:
        if node.domain != ATEN_DOMAIN or node.op_type != "ATen":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        op = attrs["operator"].decode()
        overload = attrs.get("overload_name", b"").decode()
        if op.startswith((VJP_PREFIX, NATIVE_PREFIX)) or op in OWN_GRADIENT_OPS:  # they register their own
            continue
        grad = TORCH_OP_GRADIENTS.get(op)
        if grad is not None:  # one explicit backward op (no recompute)
            if "::" not in op:  # PyTorch's own op (ops.ATEN_GRADIENTS): every input its gradient may read
                # (an absent trailing argument is one the backward op's schema defaults as the forward's)
                node.input.extend([""] * (resolve(op, overload).n_args - len(node.input)))
            keys.append(
                register_gradient(op, overload, list(grad.inputs), list(grad.outputs), grad.backward, set(grad.stop))
            )
            continue
        key = f"{ATEN_DOMAIN}::ATen::{op}::{overload}"
        plan = resolve(op, overload)
        if len(node.input) < plan.n_args:
            # NOTE: every node of an op gets the schema's full argument list (absent trailing
            # arguments take their defaults): ORT keeps one gradient definition per op and
            # overload per process, and the exporters differ in which trailing defaults they
            # write (dynamo drops softmax's dtype=None, TorchScript writes it as an empty input).
            node.input.extend([""] * (plan.n_args - len(node.input)))
        n_in, n_out = len(node.input), len(node.output)
        # An integer output (indices) has no gradient for any node to compute: an absent input.
        grads_out = [
            "" if types.get(o, (onnx.TensorProto.FLOAT,))[0] not in _FLOAT_TYPES else f"GO({j})"
            for j, o in enumerate(node.output)
        ]
        if not any(grads_out):
            # NOTE: a node with no floating output (an integer clamp beside a floating one: dynamo picks
            # ATen nodes by op, not by call) is never differentiated -- ORT's gradient builder follows
            # only float/half/double edges -- so it needs no definition, and registering its
            # no-gradient one first would leave a later floating node of the same op without one.
            continue
        known = _gradient_arity.get(key)
        if known is not None and known[:2] != (n_in, n_out):
            raise RuntimeError(
                f"ATen op {op} appears with {known[0]} inputs and {known[1]} outputs, and with {n_in} and {n_out}; "
                "ORT allows one gradient definition per op"
            )
        if known is not None and known[2] != tuple(grads_out):
            # NOTE: the definition registered first stays for the process: one that leaves out an
            # output's gradient (it was an integer there) would make every later float node's
            # gradient zero, silently.
            raise RuntimeError(
                f"ATen op {op} has float outputs {_float_flags(known[2])} in one graph and {_float_flags(grads_out)} "
                "in another; ORT allows one gradient definition per op (run the integer one as an ONNX op)"
            )
        schema_args = compat.op_schema(plan.fn).arguments
        draws_only = op.rpartition("::")[2] in _DRAWS_ONLY
        zero_gradient = op.rpartition("::")[2] in _ZERO_GRADIENT_DRAWS
        if torch.Tag.nondeterministic_seeded in plan.fn.tags and not draws_only and not zero_gradient:
            # NOTE: a vjp recomputes the op: a random op would draw again, and a gradient that
            # depends on the draw (rrelu's slopes, a dropout mask) would be silently wrong. Checked on
            # every node (the first node's definition stays for the process): one whose constant
            # arguments make it deterministic here (dropout_p=0, train=False) is differentiated.
            if constants is None:
                constants = _constant_values(model)
            if _draws(node, schema_args, constants):
                raise RuntimeError(
                    f"ATen op {op} is random: its gradient would recompute it with another draw than its "
                    "forward's. Run it outside the wrapped module, or the module without ORTWrap"
                )
        if known is None:
            stop = {i for i in range(n_in) if i >= len(schema_args) or not _is_tensor(schema_args[i].type)}
            if draws_only:
                # Ops whose result does not depend on their inputs' values take no gradient at all.
                stop = set(range(n_in))
            # An ``out=`` overload (``div.out``: spectral_norm's power iteration, run under no_grad in
            # eager, which refuses out= with inputs that need grad): no gradient flows through it.
            if op in NO_GRADIENT_OPS or any(
                a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in schema_args
            ):
                stop = set(range(n_in))
            register_gradient(
                op,
                overload,
                grads_out + [f"I({i})" for i in range(n_in)],
                [f"GI({i})" for i in range(n_in)],
                VJP_PREFIX + (op if n_out == plan.n_returns else f"{OUTS_MARK}{n_out}|{op}"),
                stop,
            )
            _gradient_arity[key] = (n_in, n_out, tuple(grads_out))
        keys.append(key)
    return keys


def _is_tensor(t: Any) -> bool:
    """A ``Tensor`` or ``Tensor?`` argument: one that takes a gradient (``clamp.Tensor``'s bounds,
    ``convolution``'s bias; an absent one stays absent)."""
    if t.kind() == "OptionalType":
        t = t.getElementType()
    return t.kind() == "TensorType"


#: Random ops whose results do not depend on their inputs' values (PyTorch gives them zero or no
#: gradient): as ATen nodes they take no gradient, and are never recomputed.
_DRAWS_ONLY = frozenset(
    {"exponential", "uniform", "random", "cauchy", "log_normal", "geometric", "rand_like",
     "randn_like", "randint_like"}
)  # fmt: skip

#: Random ops whose gradient PyTorch defines as zeros whatever the draw (derivatives.yaml:
#: ``bernoulli``'s probabilities, ``normal``'s mean and std, no reparametrization). Their vjp draws
#: again, but the gradient it returns is those zeros, as eager's (a gradient, not None).
_ZERO_GRADIENT_DRAWS = frozenset({"bernoulli", "normal"})


#: Arguments whose constant value makes a random op deterministic: a drop probability of 0, or a
#: training flag that is False.
_NO_DRAW = {"dropout_p": 0.0, "p": 0.0, "train": False, "training": False}


def _constant_values(model: onnx.ModelProto) -> dict[str, Any]:
    """The values of the graph's constants (Constant nodes' and initializers'), by name."""
    from onnx import numpy_helper

    out: dict[str, Any] = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and not n.domain:
            for a in n.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    out[n.output[0]] = numpy_helper.to_array(a.t)
    return out


def _draws(node: onnx.NodeProto, schema_args: Any, constants: dict[str, Any]) -> bool:
    """Whether a random ATen node draws in this graph: False when a constant argument rules the draw
    out (``dropout_p`` 0, ``train`` False); True when unknown."""
    for i, arg in enumerate(schema_args):
        if arg.name in _NO_DRAW and i < len(node.input) and node.input[i] in constants:
            value = constants[node.input[i]]
            if value.size == 1 and value.reshape(()).item() == _NO_DRAW[arg.name]:
                return False
    return True


def _float_flags(grads_out) -> str:
    return "".join("1" if g else "0" for g in grads_out)


# ----------------------------------------------------------------------------- after the build
def mark_used_outputs(model: onnx.ModelProto) -> bool:
    """Tell each ATen node of a built graph which of its outputs the graph uses; True if any changed.

    The gradient builder leaves the gradients nobody needs (a frozen weight, an input it does not
    differentiate) as unnamed outputs, and ORT's ATen kernel fails ("invalid index -1") when the
    executor hands it a value for one. The flags, ``used=`` and a 1 or 0 per output, go where the
    executor reads them: the ``overload_name`` of ortwrap's CPU kernels and of the backward ops of
    ``ops.TORCH_OP_GRADIENTS`` (whose ``output_mask`` argument they fill; neither has
    overloads), and into the operator of a vjp node (``ortwrap_vjp::used=101|<op>``). Outputs
    marked 0 are returned as nothing.
    """
    from ..ops import TORCH_OP_GRADIENTS

    masked = {g.backward for g in TORCH_OP_GRADIENTS.values()}
    changed = False
    for node in model.graph.node:
        if node.op_type != "ATen" or node.domain != ATEN_DOMAIN:
            continue
        attrs = {a.name: a for a in node.attribute}
        if "operator" not in attrs:
            continue
        op = attrs["operator"].s.decode()
        if all(node.output) and op not in masked:  # (a masked op always gets its flags)
            continue
        used = USED_MARK + "".join("1" if o else "0" for o in node.output)
        if op.startswith(NATIVE_PREFIX) or op in masked:
            if "overload_name" in attrs:
                attrs["overload_name"].s = used.encode()
            else:
                node.attribute.append(onnx.helper.make_attribute("overload_name", used))
        elif op.startswith(VJP_PREFIX):
            attrs["operator"].s = f"{VJP_PREFIX}{used}|{op[len(VJP_PREFIX) :]}".encode()
        else:
            continue
        changed = True
    return changed


def drop_missing_gradients(model: onnx.ModelProto) -> bool:
    """Make absent the inputs of ``ops.OPTIONAL_GRADIENT_OPS`` nodes and of vjp nodes that nothing
    produces (an output gradient the built graph lacks: no gradient reaches that output, as for the U
    and Vh of ``_linalg_svd`` under ``svdvals``; ``_vjp`` skips an absent one); True if any changed."""
    from ..ops import OPTIONAL_GRADIENT_OPS

    graph = model.graph
    nodes = [
        n
        for n in graph.node
        if n.domain == ATEN_DOMAIN
        and n.op_type == "ATen"
        and any(
            a.name == "operator" and (a.s.decode() in OPTIONAL_GRADIENT_OPS or a.s.decode().startswith(VJP_PREFIX))
            for a in n.attribute
        )
    ]
    if not nodes:
        return False
    known = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    known |= {o for n in graph.node for o in n.output}
    changed = False
    for node in nodes:
        for i, name in enumerate(node.input):
            if name and name not in known:
                node.input[i] = ""
                changed = True
    return changed
