"""Every table the stages read about ortwrap's ops and kernels, derived from their declarations
(``ops/kernels.py``'s :data:`~ortwrap.ops.kernels.KERNELS`, ``ops/torch_ops.py``'s
:data:`~ortwrap.ops.torch_ops.OPS`) by :func:`derive`. Nothing writes them: sets are frozensets and
mappings read-only views, so a stage cannot change them at run time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .declare import OPS_NAMESPACE, ZERO3_MAX_ARITY, ZERO3_NAMESPACE, Gradient, Kernel, Op
from .kernels import KERNELS
from .torch_ops import ATEN_GRADIENTS, OPS

__all__ = [
    "DTYPE_ARGUMENT_OPS",
    "DTYPE_OPERANDS",
    "HEAVY_OPERATORS",
    "OPERATORS",
    "OPTIONAL_GRADIENT_OPS",
    "OWN_GRADIENT_OPS",
    "TABLES",
    "TORCH_OP_GRADIENTS",
    "WEIGHT_COPY_INPUT",
    "WEIGHT_COPY_OUTPUT",
    "Tables",
    "derive",
]


@dataclass(frozen=True)
class Tables:
    """What the stages read, by operator (an ATen node's ``operator``: ``ortwrap_ops::linear``).

    Attributes:
        operators: every declared kernel and op (deterministic, no state: ``grad/recompute.py``
            may copy their nodes).
        heavy: GEMMs and attention (``heavy``): ``recompute="cheap"`` does not recompute them.
        dtype_argument_ops: the ops with a dtype argument (``Op.dtype_operands``): the native bf16
            route's GEMMs; ``passes/half_precision.py`` and ``passes/half_values.py`` read them, and
            a session of a graph with one runs without ORT's CPU arena (``runtime/session.py``).
        dtype_operands: op -> how many of its first inputs its ``dtypes`` names (``passes/half_values.py``).
        torch_op_gradients: op -> its explicit backward (:class:`Gradient`, ``backward`` the full
            operator); the ATen gradient build registers these instead of a vjp (``grad/aten.py``).
            Also PyTorch's own ops of ``aten_gradients`` (keyed by their bare name, as ATen nodes
            name them), whose backward is one of ``ops``.
        optional_gradient_ops: backward ops whose output gradients may be absent (``Op.optional_gradients``).
        weight_copy_output: op -> the output that is its weight's copy (``grad/recompute.py``).
        weight_copy_input: backward op -> the input that reads that copy (from the forward's gradient wiring).
        own_gradient_ops: ops whose gradient definition their owner registers (ZeRO-3's fetch ops,
            ``integrations/zero3_layers.py``): the ATen bridge registers no vjp for them.
    """

    operators: frozenset[str]
    heavy: frozenset[str]
    dtype_argument_ops: frozenset[str]
    dtype_operands: Mapping[str, int]
    torch_op_gradients: Mapping[str, Gradient]
    optional_gradient_ops: frozenset[str]
    weight_copy_output: Mapping[str, int]
    weight_copy_input: Mapping[str, int]
    own_gradient_ops: frozenset[str]


def derive(
    kernels: Iterable[Kernel], ops: Iterable[Op], aten_gradients: Mapping[str, Gradient] = MappingProxyType({})
) -> Tables:
    """The tables of these declarations (``aten_gradients``: PyTorch ops -> a backward op of ``ops``)."""
    kernels, ops = tuple(kernels), tuple(ops)
    declared = (*kernels, *ops)
    seen: set[str] = set()
    for d in declared:
        if d.operator in seen:
            raise ValueError(f"{d.operator} is declared twice (one declaration per op and kernel)")
        seen.add(d.operator)
    gradients = {
        o.operator: dataclasses.replace(o.gradient, backward=f"{OPS_NAMESPACE}::{o.gradient.backward}")
        for o in ops
        if o.gradient is not None
    }
    names = {o.name for o in ops}
    for aten_op, g in aten_gradients.items():
        if g.backward not in names:
            raise ValueError(f"the gradient of {aten_op} names {g.backward}, which no op declares")
        if "::" in aten_op or aten_op in gradients:
            raise ValueError(f"aten_gradients: {aten_op!r} is not a bare PyTorch op name, or is declared twice")
        gradients[aten_op] = dataclasses.replace(g, backward=f"{OPS_NAMESPACE}::{g.backward}")
    copy_input: dict[str, int] = {}
    for o in ops:
        if o.weight_copy_output is not None and o.gradient is not None:
            backward = gradients[o.operator].backward
            index = o.gradient.inputs.index(f"O({o.weight_copy_output})")
            if copy_input.setdefault(backward, index) != index:
                raise ValueError(f"{backward} reads the weight copy at input {copy_input[backward]} and at {index}")
    return Tables(
        operators=frozenset(d.operator for d in declared),
        heavy=frozenset(d.operator for d in declared if d.heavy),
        dtype_argument_ops=frozenset(o.operator for o in ops if o.dtype_operands is not None),
        dtype_operands=MappingProxyType({o.operator: o.dtype_operands for o in ops if o.dtype_operands is not None}),
        torch_op_gradients=MappingProxyType(gradients),
        optional_gradient_ops=frozenset(o.operator for o in ops if o.optional_gradients),
        weight_copy_output=MappingProxyType(
            {o.operator: o.weight_copy_output for o in ops if o.weight_copy_output is not None}
        ),
        weight_copy_input=MappingProxyType(copy_input),
        own_gradient_ops=frozenset(f"{ZERO3_NAMESPACE}::fetch_{n}" for n in range(1, ZERO3_MAX_ARITY + 1)),
    )


#: The tables of ortwrap's declarations.
TABLES = derive(KERNELS, OPS, ATEN_GRADIENTS)
OPERATORS = TABLES.operators
HEAVY_OPERATORS = TABLES.heavy
DTYPE_ARGUMENT_OPS = TABLES.dtype_argument_ops
DTYPE_OPERANDS = TABLES.dtype_operands
TORCH_OP_GRADIENTS = TABLES.torch_op_gradients
OPTIONAL_GRADIENT_OPS = TABLES.optional_gradient_ops
WEIGHT_COPY_OUTPUT = TABLES.weight_copy_output
WEIGHT_COPY_INPUT = TABLES.weight_copy_input
OWN_GRADIENT_OPS = TABLES.own_gradient_ops
