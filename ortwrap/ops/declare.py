"""The two declarations: :class:`Kernel` (one of ortwrap's C kernels, ``kernels/_cpu.c``) and
:class:`Op` (one of ortwrap's PyTorch ops, ``torch.ops.ortwrap_ops``), with the :class:`Gradient`
both use.

Two classes, not one: a kernel is typed by a signature string that ``_cpu.c``'s table repeats and
is found by the ONNX ops its rewrite starts from; a PyTorch op by a ``torch.library`` schema and a
Python implementation, with the dtype argument, weight copies and optional gradients of the bf16
GEMMs. What the stages read of both (``operator``, ``gradient``, ``heavy``) has the same name in
each, and ``ops/tables.py`` derives every table from the two lists.

Signature characters: ``f`` float32 tensor, ``h`` bfloat16 tensor, ``i`` int64 tensor, ``F`` float32 scalar (0-d),
``I`` int64 scalar (0-d); ``?`` after a character makes that input optional (it may be absent);
inputs and outputs are separated by ``>``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..graph.names import NATIVE_PREFIX

__all__ = [
    "CPU_NAMESPACE",
    "OPS_NAMESPACE",
    "ZERO3_MAX_ARITY",
    "ZERO3_NAMESPACE",
    "Gradient",
    "Kernel",
    "KernelTableError",
    "Op",
    "gradient",
    "parse_signature",
]

#: the namespace of ortwrap's PyTorch ops (``torch.ops.ortwrap_ops``; ``ops.torch_ops.define_ops``)
OPS_NAMESPACE = "ortwrap_ops"
#: the namespace of ortwrap's CPU kernels in ATen nodes' ``operator`` (``ortwrap_cpu::<name>``)
CPU_NAMESPACE = NATIVE_PREFIX.removesuffix("::")
#: the namespace of ZeRO-3's per-layer parameter ops, ``fetch_<n>``, ``refetch_<n>`` and ``grads_<n>`` for n
#: up to :data:`ZERO3_MAX_ARITY` (``integrations/zero3_layers.py`` defines them: their implementations read
#: its layer table, and it registers each ``fetch_<n>``'s gradient, one ``grads_<n>`` node, itself)
ZERO3_NAMESPACE = "ortwrap_zero3"
#: Largest number of partitioned parameters one submodule may own (ZeRO-3 ``zero3_gather="submodule"``).
ZERO3_MAX_ARITY = 32
_TENSOR_CHARS = {"f": "float32", "h": "bfloat16", "i": "int64", "F": "float32 scalar", "I": "int64 scalar"}


class KernelTableError(RuntimeError):
    """The compiled kernel table (``_cpu.c`` ``kOps``) disagrees with ``ops.KERNELS``."""


def parse_signature(signature: str) -> tuple[list[tuple[str, bool]], list[str]]:
    """``"fff?FI>fff"`` -> ([(char, optional), ...] per input, [char per output])."""
    ins, sep, outs = signature.partition(">")
    if not sep:
        raise ValueError(f"signature {signature!r} has no '>'")
    inputs: list[tuple[str, bool]] = []
    for ch in ins:
        if ch == "?":
            if not inputs:
                raise ValueError(f"signature {signature!r}: '?' before any input")
            inputs[-1] = (inputs[-1][0], True)
        elif ch in _TENSOR_CHARS:
            inputs.append((ch, False))
        else:
            raise ValueError(f"signature {signature!r}: unknown character {ch!r}")
    for ch in outs:
        if ch not in _TENSOR_CHARS:
            raise ValueError(f"signature {signature!r}: unknown output character {ch!r}")
    return inputs, list(outs)


@dataclass(frozen=True)
class Gradient:
    """The gradient of a forward kernel or op: one node of ``backward`` (a name in the same
    namespace) reading ``inputs`` (``GO(j)``, ``I(i)``, ``O(k)``) and writing ``outputs``
    (``GI(i)``); ``stop``: forward inputs that get no gradient (integer inputs, statistics)."""

    backward: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    stop: frozenset[int] = frozenset()


def gradient(backward: str, inputs: Sequence[str], outputs: Sequence[str], stop: Sequence[int] = ()) -> Gradient:
    """A :class:`Gradient` from lists."""
    return Gradient(backward, tuple(inputs), tuple(outputs), frozenset(stop))


@dataclass(frozen=True)
class Kernel:
    """One of ortwrap's CPU kernels (``ortwrap_cpu::<name>``, ``kernels/_cpu.c``).

    Attributes:
        name: the kernel's name in ``kOps``.
        signature: typed inputs and outputs (module docstring).
        doc: what it computes, one line.
        gradient: its gradient, or None for a backward kernel.
        replaces: ONNX op types where ``NativeCPUKernelsPass``'s rewrite for this kernel starts.
        rewrite: the pass's method that performs that rewrite.
        variant_of: for a variant with other dtypes (or layouts), the kernel whose nodes it replaces
            (in another pass: ``passes/half_values.py``, ``passes/native_attention.py``) instead of a
            rewrite of its own.
        replaces_ops: for a kernel that takes the place of some of ortwrap's PyTorch ops (ATen nodes
            of ``ortwrap_ops``), those ops (``passes/native_attention.py`` rewrites them).
        heavy: its recompute cost: a GEMM or attention, whose work per output element grows with an
            operand's size; ``recompute="cheap"`` does not recompute it (``grad/recompute.py``).
    """

    name: str
    signature: str
    doc: str
    gradient: Gradient | None = None
    replaces: tuple[str, ...] = ()
    rewrite: str | None = None
    variant_of: str | None = None
    replaces_ops: tuple[str, ...] = ()
    heavy: bool = False

    @property
    def operator(self) -> str:
        """The ``operator`` of its ATen nodes."""
        return f"{CPU_NAMESPACE}::{self.name}"

    @property
    def inputs(self) -> list[tuple[str, bool]]:
        return parse_signature(self.signature)[0]

    @property
    def outputs(self) -> list[str]:
        return parse_signature(self.signature)[1]

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The float dtypes it reads or writes (it computes in float32; ``h``: bfloat16 tensors)."""
        return ("float32", "bfloat16") if "h" in self.signature else ("float32",)


@dataclass(frozen=True)
class Op:
    """One of ortwrap's PyTorch ops (``torch.ops.ortwrap_ops.<name>``), run as an ATen node.

    Attributes:
        schema: its ``torch.library`` schema, ``"name(args) -> returns"``.
        impl: the PyTorch implementation (``CompositeImplicitAutograd``: without an explicit
            ``gradient``, the ATen bridge differentiates it by autograd).
        gradient: its explicit backward op (no recompute of the forward under autograd); the
            backward op's last argument, ``output_mask``, is filled from the gradients the graph uses.
        dtype_operands: for an op with a dtype argument: its last argument, ``dtypes``, holds torch's
            ScalarType codes of [compute, result, each of its first ``dtype_operands`` inputs] (the
            float operands); it computes in the first, returns its result in the second, and its
            backward returns each operand's gradient in that operand's dtype. None: no dtype argument.
        optional_gradients: a backward op reading two output gradients of which the graph may
            produce only one (``grad.aten.drop_missing_gradients`` makes the missing one absent).
        float32_form: the op ``TorchGemmOnCPUPass`` writes instead on the float32 torch-GEMM
            route (``Options.gemm="torch"``).
        weight_copy_output: the output that is the weight's (input 1's) copy in the compute dtype,
            which ``grad/recompute.py`` drops (``NO_WEIGHT_COPY``), the backward casting the weight again.
        heavy: its recompute cost (as :attr:`Kernel.heavy`).
    """

    schema: str
    impl: Callable
    gradient: Gradient | None = None
    dtype_operands: int | None = None
    optional_gradients: bool = False
    float32_form: str | None = None
    weight_copy_output: int | None = None
    heavy: bool = False

    @property
    def name(self) -> str:
        return self.schema.partition("(")[0]

    @property
    def operator(self) -> str:
        """The ``operator`` of its ATen nodes."""
        return f"{OPS_NAMESPACE}::{self.name}"

    @property
    def n_outputs(self) -> int:
        """How many tensors it returns (its schema's returns)."""
        returns = self.schema.rpartition("->")[2].strip()
        if returns.startswith("("):
            return len(returns[1:-1].split(","))
        return 1
