"""ortwrap's own ops and kernels: ONE declaration each, and every table derived from them.

==========================  =============================================================================
``ops/declare.py``          the declarations' types: :class:`Kernel` (a C kernel), :class:`Op` (a PyTorch
                            op), :class:`Gradient`; the namespaces
``ops/kernels.py``          :data:`KERNELS`: ortwrap's CPU kernels (``kernels/_cpu.c`` holds their C, and
                            ``kernels/`` builds and loads it)
``ops/torch_ops.py``        :data:`OPS`: ortwrap's PyTorch ops (``torch.ops.ortwrap_ops``), each one's
                            implementation next to its declaration; :data:`ATEN_GRADIENTS` (PyTorch ops
                            whose gradient is one of them); :func:`define_ops`
``ops/tables.py``           every table the stages read (``TORCH_OP_GRADIENTS``, ``DTYPE_ARGUMENT_OPS``,
                            ``HEAVY_OPERATORS``, ...), derived from :data:`KERNELS` and :data:`OPS`
``ops/mappers.py``          ONNX ops and ATen ops run as PyTorch ops (``GRADIENTS``, ``DOUBLE_PRECISION``,
                            ``ATEN_OPS``) and how each maps its arguments
``ops/values.py``           constants read from graphs and written as ATen node arguments
==========================  =============================================================================

Adding an op is its implementation and one :class:`Op` in :data:`OPS` (CONTRIBUTING.md, "Adding an
op"); adding a kernel, its C in ``_cpu.c`` and one :class:`Kernel` in :data:`KERNELS`. ``ops/``
imports no stage (passes, export, bridge, runtime): the stages import it.
"""

from .declare import (
    CPU_NAMESPACE,
    OPS_NAMESPACE,
    ZERO3_MAX_ARITY,
    ZERO3_NAMESPACE,
    Gradient,
    Kernel,
    KernelTableError,
    Op,
    gradient,
    parse_signature,
)
from .kernels import KERNELS, check_kernel_table, kernel
from .mappers import ATEN_OPS, DOUBLE_PRECISION, GRADIENTS, AtenViaTorch, OnnxViaTorch
from .tables import (
    DTYPE_ARGUMENT_OPS,
    DTYPE_OPERANDS,
    HEAVY_OPERATORS,
    OPERATORS,
    OPTIONAL_GRADIENT_OPS,
    OWN_GRADIENT_OPS,
    TABLES,
    TORCH_OP_GRADIENTS,
    WEIGHT_COPY_INPUT,
    WEIGHT_COPY_OUTPUT,
    Tables,
    derive,
)
from .torch_ops import ATEN_GRADIENTS, NO_WEIGHT_COPY, OPS, define_ops, op
from .values import constant_array, constant_value, written

__all__ = [
    "ATEN_GRADIENTS",
    "ATEN_OPS",
    "CPU_NAMESPACE",
    "DOUBLE_PRECISION",
    "DTYPE_ARGUMENT_OPS",
    "DTYPE_OPERANDS",
    "GRADIENTS",
    "HEAVY_OPERATORS",
    "KERNELS",
    "NO_WEIGHT_COPY",
    "OPERATORS",
    "OPS",
    "OPS_NAMESPACE",
    "OPTIONAL_GRADIENT_OPS",
    "OWN_GRADIENT_OPS",
    "TABLES",
    "TORCH_OP_GRADIENTS",
    "WEIGHT_COPY_INPUT",
    "WEIGHT_COPY_OUTPUT",
    "ZERO3_MAX_ARITY",
    "ZERO3_NAMESPACE",
    "AtenViaTorch",
    "Gradient",
    "Kernel",
    "KernelTableError",
    "OnnxViaTorch",
    "Op",
    "Tables",
    "check_kernel_table",
    "constant_array",
    "constant_value",
    "define_ops",
    "derive",
    "gradient",
    "kernel",
    "op",
    "parse_signature",
    "written",
]
