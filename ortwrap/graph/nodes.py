"""Node builders every stage shares.

:func:`aten_node` is the one way to write an ``org.pytorch.aten::ATen`` node (a PyTorch op inside the
graph). It types its outputs from what the caller passes: the op declarations (``ortwrap/ops/``) sit
above this layer (they import torch's op implementations and the bridges), so
a builder here cannot read them; the layer that knows an op's declaration passes its output types.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from .names import ATEN_DOMAIN

__all__ = ["aten_node"]


def aten_node(
    operator: str,
    inputs: Sequence[ir.Value | None],
    *,
    overload: str = "",
    outputs: int = 1,
    dtypes: Sequence[ir.DataType | None] = (),
    shapes: Sequence[ir.Shape | None] = (),
    name: str | None = None,
) -> ir.Node:
    """An ATen node running ``operator`` (``"detach"``, ``"ortwrap_ops::cat2"``, ``"ortwrap_cpu::gelu"``)
    with ``overload`` on ``inputs``, with ``outputs`` outputs, the first ones typed with ``dtypes`` and
    ``shapes``. ORT has no type inference through ATen nodes and reads an ATen node's output as the
    declared type: give the types wherever they are known. The node is not inserted anywhere.
    """
    node = ir.Node(
        ATEN_DOMAIN,
        "ATen",
        list(inputs),
        attributes=[ir.AttrString("operator", operator), ir.AttrString("overload_name", overload)],
        num_outputs=outputs,
        name=name,
    )
    for value, dtype in zip(node.outputs, dtypes):
        value.dtype = dtype
    for value, shape in zip(node.outputs, shapes):
        value.shape = shape
    return node
