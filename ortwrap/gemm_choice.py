"""Which library runs a graph's GEMMs on CPU, chosen by measuring them: ``gemm="auto"`` and
``half_compute="auto"``.

A float32 graph's MatMul/Gemm run as ONNX Runtime's (MLAS) or as PyTorch's (MKL/oneDNN, the
``*_f32`` ATen ops of ``passes/half_matmul.py``); a bfloat16 (autocast) graph's run in float32 in
MLAS or as PyTorch's bf16 GEMMs (the native route). Which is faster depends on the CPU and the
shapes, not on the vendor or a flag: on an Intel Sapphire Rapids MKL beats MLAS by ~20% on a GPT-2
LM, on a Zen 5 EPYC MLAS is ~2x MKL's float32 rate; on an Intel with AVX512-BF16 but no AMX
PyTorch's bf16 GEMMs are slower than MLAS's float32 ones, with AMX several times faster.

So, per graph (the ``gemm_choice`` build stage, before the passes):

1. :func:`gemm_problems`: the graph's GEMMs as (batch, M, N, K, operand layouts, count), with the
   dimensions the first call's inputs give them (symbolic dimensions resolved from the inputs'
   shapes, or by shape inference on a copy with the inputs' shapes where the graph lost them); for
   a training graph also both backward GEMMs of each (``dA = dY B^T``, ``dB = A^T dY``).
2. Below :data:`MIN_STEP_FLOPS` GEMM FLOPs a step the GEMMs' speed does not matter and each
   PyTorch GEMM would only add an ORT <-> PyTorch crossing: MLAS (and float32), nothing measured.
3. Otherwise the :data:`MAX_SHAPES` largest problems by FLOPs (count x FLOPs; they dominate the
   step) are timed through both libraries, interleaved, at the thread counts the program runs with
   (ORT's ``intra_op_threads``, PyTorch's ``torch.get_num_threads()``), the best of :data:`REPS`
   calls each; a problem larger than :data:`MAX_CALL_FLOPS` is timed at a smaller size (its
   batch, then its largest dimension halved), which keeps a measurement at ~0.1-0.3 s on one core.
4. :func:`decide` (pure): the time the measured problems take a step through each library (FLOPs
   over the rate, times their count; PyTorch's route also :data:`CROSSING_S` for each call); the
   PyTorch route when it is faster by :data:`MARGIN`, else MLAS / float32 (the lower peak RSS).
5. The rates are kept per shape in ``<cache_dir>/gemm/<machine>.json``, the machine being the CPU
   model and flags, both thread counts and the torch / onnxruntime versions: a later build whose
   largest shapes were measured on this machine (by this or another model) measures nothing. (Not a
   measurement with several threads made while the machine is overloaded: :func:`keep_on_disk`.)

Per graph, not per GEMM: both routes run every GEMM of the graph the same way, so their backward
ops, the attention rewrite (PyTorch's flash attention on the torch route) and the arena choice
(``runtime/session.uses_cpu_arena``) stay one decision; a graph that mixed them would cross between
ORT and PyTorch more often, and one library was faster on every shape of every model measured
(one kernel family wins across a CPU's shapes); the rates are kept per shape in the choice's record
(``BuildArtifacts.gemm_choice``) to see if that ever stops holding.

Convolutions, per node (``torch_convs``; ``"auto"``, CPU training graphs): each distinct 2-D
convolution shape of at least :data:`CONV_MIN_FLOPS` (the :data:`CONV_MAX_SHAPES` largest) is timed,
forward and backward, through ORT (Conv + ConvGrad, float32) and PyTorch (``convolution`` +
``convolution_backward`` in the convolution's dtype: bf16 under autocast, where ORT computes in
float32), kept in the same record; :func:`decide_convs` (pure) routes a convolution to PyTorch where
its time in a step (:data:`CONV_TORCH_IN_STEP` x the isolated one) plus two ATen calls
(:data:`CONV_CROSSING_S` each), both measured in training steps, is below ORT's by :data:`CONV_MARGIN`
(``passes/torch_conv.py`` rewrites those nodes). Per node, not per graph: a convolution is one node
and its gradient, so a routed one adds its own two crossings and nothing else, and which library
wins changes with the shape (on a Zen 5 EPYC, ORT's direct kernels win on few channels, oneDNN's
on more: the UNet's 24->8 and 32->16 3x3 convolutions). A bf16 ConvTranspose (PyTorch's op either
way: no ConvTransposeGrad on CPU) is timed in bf16 against float32 the same way.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import math
import operator
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import onnx
import onnx_ir as ir
import torch

from ._logging import logger
from .options import Options, cache_dir

#: ORT's intra-op pool (torch's thread count) only where a training graph's GEMMs and convolutions that
#: ORT runs take at least this many seconds a step per node of the graph (measured rates): below it
#: the graph's kernels are small and ORT runs them on one thread (:func:`decide_pool`).
POOL_MIN_NODE_S = 15e-6
#: ... or where a value of the forward graph has at least this many elements (large elementwise kernels).
POOL_BIG_ELEMENTS = 1 << 20
#: A step whose GEMMs (forward and backward) take fewer FLOPs than this keeps MLAS and float32 without
#: measuring: ~1-2 ms of GEMMs, where the PyTorch route's crossings cost as much as it could save.
MIN_STEP_FLOPS = 2e8
#: How many distinct GEMM problems (the largest by count x FLOPs) are timed.
MAX_SHAPES = 4
#: A timed call does at most this many FLOPs (the problem is shrunk to fit): ~2-6 ms on one core.
MAX_CALL_FLOPS = 3e8
#: Calls timed per problem and library, after one untimed call (oneDNN compiles its kernel for a new
#: shape on the first; MLAS's first call touches cold memory); the best is kept.
REPS = 3
#: A measurement stops after the rep that passes this many seconds (at least one rep runs).
BUDGET_S = 0.3
#: What one ORT -> PyTorch crossing (an ATen node: DLPack in and out, the op's dispatch) costs the
#: PyTorch route per GEMM call, on top of the GEMM (~31 us per Linear, forward and backward: 3 GEMMs;
#: tiny Linears through both routes, one thread, a Zen 5 EPYC).
CROSSING_S = 1e-5
#: The PyTorch route is chosen when its estimate is below (1 - MARGIN) x MLAS's: a tie keeps MLAS
#: (less heap next to ORT's arena) and the measurement noise does not flip the choice.
MARGIN = 0.05
#: Bumped when the measurement changes, so that older records are not used.
METHOD = 2

#: Convolutions (``torch_convs``): a 2-D convolution of fewer forward FLOPs than this stays ORT's
#: without measuring (its two ATen calls cost about what PyTorch's kernel could save).
CONV_MIN_FLOPS = 1e6
#: How many distinct convolution shapes (the largest by count x FLOPs) are timed.
CONV_MAX_SHAPES = 12
#: Calls timed per convolution and route after an untimed one (the best is kept), and the seconds
#: after which a shape's measurement stops.
CONV_REPS = 5
CONV_BUDGET_S = 0.1
#: What a routed convolution's ATen node costs a training step besides its op, a call (it makes two):
#: the bridge inside ORT's run (40-55 us, docs/performance.md "ATen nodes: what a call costs") and, for
#: a bf16 one, the casts to bf16 and back that the isolated timing includes but the step pays again on
#: colder data. Measured in UNet training steps (Zen 5 EPYC, 1 thread, CPU time, load 0.5-2): every
#: Conv routed against none, the step's change against the ATen ops' own time in that step (~45-90 us
#: a call left over; docs/performance.md "Where the route's extra cost went").
CONV_CROSSING_S = 6e-5
#: PyTorch's convolution ops inside a training step take this much longer than their isolated timing
#: (best of :data:`CONV_REPS` on warm data): 1.53 against 1.38 ms (fp32) and 1.17 against 1.04 ms
#: (bf16) for the UNet's two routed shapes, timed around ``aten.convolution`` /
#: ``convolution_backward`` in the step. ORT's Conv + ConvGrad took in the step about what they take
#: isolated (inferred: the routed step's change matched ORT's isolated time minus the routed ops').
CONV_TORCH_IN_STEP = 1.1
#: PyTorch's route is taken where its estimate is below (1 - CONV_MARGIN) x ORT's.
CONV_MARGIN = 0.05

#: convolution measurements this process made (tests count them)
conv_measurements = 0

#: measurements this process made (tests count them)
measurements = 0
#: machine key -> shape key -> rates: the records this process read or made
_memo: dict[str, dict[str, dict]] = {}


@dataclass(frozen=True)
class Gemm:
    """One GEMM problem: ``batch`` products of ``op(A) [m, k] @ op(B) [k, n]``, ``count`` times a step.

    ``trans_a``/``trans_b``: the operand is stored transposed (``A`` as [k, m], ``B`` as [n, k]: a
    Linear's weight), as both routes read it."""

    m: int
    n: int
    k: int
    batch: int = 1
    trans_a: bool = False
    trans_b: bool = False
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    def shrunk(self, max_flops: float) -> Gemm:
        """The problem timed in its place: batch, then the largest dimension, halved until it fits."""
        g = self
        while g.flops > max_flops and g.batch > 1:
            g = _replace(g, batch=max(1, g.batch // 2))
        while g.flops > max_flops and max(g.m, g.n, g.k) > 64:
            dim = max(("m", "n", "k"), key=lambda d: getattr(g, d))
            g = _replace(g, **{dim: getattr(g, dim) // 2})
        return g

    def label(self) -> str:
        a = f"{self.k}x{self.m}^T" if self.trans_a else f"{self.m}x{self.k}"
        b = f"{self.n}x{self.k}^T" if self.trans_b else f"{self.k}x{self.n}"
        return f"{self.batch}*" * (self.batch > 1) + f"{a} @ {b}" + f" (x{self.count})" * (self.count > 1)


def _replace(g: Gemm, **changes) -> Gemm:
    return Gemm(**{**asdict(g), **changes})


@dataclass(frozen=True)
class Rate:
    """A problem's measured rates (FLOP/s) through MLAS and through the candidate PyTorch route."""

    gemm: Gemm
    timed: Gemm  #: the (possibly shrunk) problem actually timed
    ort: float
    torch: float


@dataclass(frozen=True)
class Conv:
    """One 2-D convolution problem: input [n, c, h, w], ``o`` output channels, a ``kh`` x ``kw``
    kernel, in ``dtype`` (``"f32"``, or ``"bf16"``: PyTorch's route computes in bf16, ORT's in float32),
    ``count`` times in the graph."""

    n: int
    c: int
    h: int
    w: int
    o: int
    kh: int
    kw: int
    stride: tuple[int, int] = (1, 1)
    pads: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    dtype: str = "f32"
    count: int = 1
    #: a ConvTranspose (``output_padding`` ``out_pad``): in a bf16 graph, PyTorch's transposed
    #: convolution in bf16 against the float32 one it is otherwise (ORT has no ConvTransposeGrad on CPU)
    transposed: bool = False
    out_pad: tuple[int, int] = (0, 0)

    def out_hw(self) -> tuple[int, int]:
        sizes, ks = (self.h, self.w), (self.kh, self.kw)
        if self.transposed:
            return tuple(
                (size - 1) * s - 2 * p + d * (k - 1) + op + 1
                for size, p, d, k, s, op in zip(sizes, self.pads, self.dilation, ks, self.stride, self.out_pad)
            )  # type: ignore[return-value]
        return tuple(
            (size + 2 * p - d * (k - 1) - 1) // s + 1
            for size, p, d, k, s in zip(sizes, self.pads, self.dilation, ks, self.stride)
        )  # type: ignore[return-value]

    @property
    def flops(self) -> float:
        """The forward's FLOPs (the backward's are about twice as many)."""
        ho, wo = (self.h, self.w) if self.transposed else self.out_hw()
        return 2.0 * self.n * self.o * ho * wo * (self.c // self.groups) * self.kh * self.kw

    def key(self) -> str:
        """Its key in the machine's record (without the count: that is the graph's)."""
        return (
            f"conv{'T' if self.transposed else ''} {self.dtype} {self.n} {self.c} {self.h} {self.w} {self.o} {self.kh} {self.kw} "
            f"s{self.stride[0]},{self.stride[1]} p{self.pads[0]},{self.pads[1]} "
            f"d{self.dilation[0]},{self.dilation[1]} g{self.groups}"
            + f" op{self.out_pad[0]},{self.out_pad[1]}"
            * self.transposed
        )

    def label(self) -> str:
        return (
            "transposed " * self.transposed
            + f"{self.c}->{self.o} {self.kh}x{self.kw} at {self.h}x{self.w}"
            + f" {self.dtype}" * (self.dtype != "f32")
        )


@dataclass(frozen=True)
class ConvRate:
    """A convolution's measured seconds a call (forward and backward) through ORT and PyTorch."""

    conv: Conv
    ort_s: float
    torch_s: float


@dataclass(frozen=True)
class GemmChoice:
    """What ``gemm_choice`` decided for one graph, and why.

    Attributes:
        torch_gemm: float32 GEMMs and attention run as PyTorch's (``gemm``).
        native_bf16: bfloat16 GEMMs run as PyTorch's bf16 GEMMs (``half_compute``).
        option: the option this graph's GEMMs follow (``"gemm"`` for a float32 graph, ``"half_compute"``
            for one with bf16 values), or ``""`` off the CPU.
        how: ``"option"`` (given explicitly), ``"measured"``, ``"cached"`` (earlier measurements of these
            shapes on this machine, this process's or the disk's), ``"measured in part"``, ``"small"`` (below ``MIN_STEP_FLOPS``),
            ``"no bf16 instructions"``, ``"no shapes"`` (the GEMMs' dimensions are unknown), ``"not cpu"``,
            ``"measurement failed"`` (logged as a warning).
        rates: each timed problem's rates.
        ort_s, torch_s: the estimated seconds a step of the timed problems takes through each route.
        seconds: how long the measurement took (0 when nothing was measured).
        step_flops: the GEMM FLOPs of one step (forward, and backward for a training graph).
        torch_convs: the Conv nodes (names) that run as PyTorch's convolution (``passes/torch_conv.py``):
            those :func:`decide_convs` picks from ``conv_rates`` (training graphs, ``"auto"`` only).
        conv_rates: each measured convolution shape's times.
        conv_how: ``"measured"``, ``"cached"``, ``"measured in part"`` or ``"measurement failed"``; ``""``
            where no convolution was considered.
    """

    torch_gemm: bool
    native_bf16: bool
    option: str = ""
    how: str = "option"
    rates: tuple[Rate, ...] = ()
    ort_s: float = 0.0
    torch_s: float = 0.0
    seconds: float = 0.0
    step_flops: float = 0.0
    torch_convs: tuple[str, ...] = ()
    conv_rates: tuple[ConvRate, ...] = ()
    conv_how: str = ""
    largest_elements: int = 0

    def ort_matrix_seconds(self) -> float | None:
        """The estimated seconds a step of the graph's GEMMs and convolutions that ORT runs take (at
        the measured thread counts): the timed GEMM shapes' time scaled to the step's GEMM FLOPs (none
        where PyTorch's route runs them), plus each measured convolution left to ORT times its count.
        ``None`` where nothing says (the options given, the measurement failed, no shapes)."""
        if self.how == "small":
            gemm_s = 0.0
        elif self.how.startswith(("measured", "cached")) and self.rates:
            timed = sum(r.gemm.flops * r.gemm.count for r in self.rates)
            routed = self.torch_gemm if self.option == "gemm" else self.native_bf16
            gemm_s = 0.0 if routed else self.ort_s * self.step_flops / timed
        else:
            return None
        if self.conv_how == "measurement failed":
            return None
        torch_shapes = set(decide_convs(self.conv_rates))  # the shapes routed to PyTorch: not ORT's work
        conv_s = sum(r.ort_s * r.conv.count for r in self.conv_rates if r.conv not in torch_shapes)
        return gemm_s + conv_s

    def summary(self) -> str:
        if self.option == "gemm":
            chosen, candidate, base = ("torch" if self.torch_gemm else "ort"), "PyTorch float32", "MLAS float32"
        else:
            chosen, candidate, base = ("native" if self.native_bf16 else "float32"), "PyTorch bf16", "MLAS float32"
        if self.how == "not cpu":
            return "GEMMs: not on the CPU (gemm and half_compute apply to CPU graphs)"
        if self.how == "option":
            return f"{self.option}={chosen!r} (as given)"
        text = f"{self.option}='auto' -> {chosen!r} ({self.how}"
        if self.rates:
            flops = sum(r.gemm.flops * r.gemm.count for r in self.rates)
            text += (
                f"; {candidate} {flops / self.torch_s / 1e9:.0f} GFLOP/s vs {base} {flops / self.ort_s / 1e9:.0f} "
                f"GFLOP/s on the {len(self.rates)} largest GEMM shapes, "
                + ", ".join(f"{r.gemm.label()}: {r.torch / 1e9:.0f} vs {r.ort / 1e9:.0f}" for r in self.rates)
            )
            if self.seconds:
                text += f"; measured in {self.seconds:.2f} s"
        elif self.how == "small":
            text += f": {self.step_flops / 1e6:.0f} MFLOP of GEMMs a step"
        text += ")"
        if self.conv_how == "measurement failed":
            text += "; convolutions: ORT's (measurement failed)"
        if self.conv_rates:
            text += (
                f"; convolutions: {len(self.torch_convs)} Conv nodes to PyTorch ({self.conv_how}; ms through "
                "ORT vs PyTorch, forward and backward: "
                + ", ".join(f"{r.conv.label()}: {r.ort_s * 1e3:.2f} vs {r.torch_s * 1e3:.2f}" for r in self.conv_rates)
                + ")"
            )
        return text


# ------------------------------------------------------------------------------ the graph's GEMMs


def _eval_dim(dim, env: dict[str, int]) -> int | None:
    if isinstance(dim, int):
        return dim
    text = getattr(dim, "value", None)
    if not text:
        return None
    if text in env:
        return env[text]
    try:  # an expression of input dims (the dynamo exporter's "s0*s1")
        return _eval_expr(ast.parse(text, mode="eval").body, env)
    except (SyntaxError, KeyError, ValueError, TypeError, ZeroDivisionError):
        return None


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def _eval_expr(node: ast.AST, env: dict[str, int]) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval_expr(node.left, env), _eval_expr(node.right, env))
    raise ValueError(ast.dump(node))


def _dims(value: ir.Value, env: dict[str, int], concrete: dict[str, list[int | None]]) -> list[int | None] | None:
    """The value's dims (None for each unknown one), or None when even its rank is unknown."""
    dims = None if value.shape is None else [_eval_dim(d, env) for d in value.shape]
    known = concrete.get(value.name or "")
    if known is not None and (dims is None or len(known) == len(dims)):
        dims = [k if d is None else d for d, k in zip(dims or known, known)]
    return dims


def _is_transpose_2d(value: ir.Value) -> bool:
    """``value`` is ``Transpose(W, perm=[1, 0])``, or a Cast of one (autocast's bf16 weight)."""
    node = value.producer()
    if node is not None and node.op_type == "Cast" and node.domain in ("", "ai.onnx") and node.inputs[0] is not None:
        node = node.inputs[0].producer()
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return False
    perm = node.attributes.get("perm")
    return perm is not None and list(perm.as_ints()) == [1, 0]


def _forward_gemm(node: ir.Node, env: dict[str, int], concrete: dict) -> Gemm | bool | None:
    """The node's forward GEMM; None when it is none (a vector product); False when its dims are unknown."""
    a, b = node.inputs[0], node.inputs[1]
    da, db = _dims(a, env, concrete), _dims(b, env, concrete)
    if da is None or db is None:
        return False
    if node.op_type == "MatMul" and len(da) >= 2 and len(db) >= 2:  # the reduced dim, from either side
        da[-1] = db[-2] = da[-1] if da[-1] is not None else db[-2]
    if None in da or None in db:
        return False
    if node.op_type == "Gemm":
        ta, tb = (bool(node.attributes[n].as_int()) if n in node.attributes else False for n in ("transA", "transB"))
        m, k = (da[1], da[0]) if ta else (da[0], da[1])
        n = db[0] if tb else db[1]
        return Gemm(m, n, k, 1, ta, tb)
    if len(da) < 2 or len(db) < 2:
        return None
    if len(db) == 2:  # a Linear (or x @ matrix): the leading dims of A are rows
        return Gemm(math.prod(da[:-1]), db[1], da[-1], 1, False, _is_transpose_2d(b))
    rank = max(len(da), len(db)) - 2
    batch = [max(x, y) for x, y in zip(([1] * rank + da[:-2])[-rank:], ([1] * rank + db[:-2])[-rank:])]
    return Gemm(da[-2], db[-1], da[-1], math.prod(batch))


def _backward_gemms(g: Gemm) -> list[Gemm]:
    """``dA = dY op(B)^T`` and ``dB = op(A)^T dY`` of a forward GEMM, in the layouts both routes read
    (ORT's Gemm gradient, the PyTorch ops' ``linear_backward``: ``dY W`` and ``dY^T X``); batched
    ones are timed untransposed (ORT's batched MatMul reads no transposed operands)."""
    if g.batch > 1:
        return [Gemm(g.m, g.k, g.n, g.batch), Gemm(g.k, g.n, g.m, g.batch)]
    da = Gemm(g.m, g.k, g.n, g.batch, False, not g.trans_b)
    db = Gemm(g.n, g.k, g.m, g.batch, True, False) if g.trans_b else Gemm(g.k, g.n, g.m, g.batch, True, False)
    return [da, db]


def gemm_problems(
    model: ir.Model, dims: dict[str, int], dtype: ir.DataType, with_backward: bool, concrete: dict | None = None
) -> list[Gemm] | None:
    """The top-level graph's MatMul/Gemm of ``dtype`` operands as GEMM problems (identical ones
    counted), with their backward GEMMs for a training graph. The dimensions come from ``dims``
    (symbolic dimension -> size) and, when given, ``concrete`` (value name -> dims); without
    ``concrete`` a GEMM with unknown dimensions makes the result None, with it the GEMM is left out
    (the attention's q k^T after a reshape to a computed head size, say)."""
    counts: dict[Gemm, int] = {}
    for node in model.graph:
        if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        if not all(v is not None and v.dtype == dtype for v in node.inputs[:2]):
            continue
        g = _forward_gemm(node, dims, concrete or {})
        if g is False and concrete is None:
            return None
        if g is None or g is False:
            continue
        for p in [g, *(_backward_gemms(g) if with_backward else [])]:
            counts[p] = counts.get(p, 0) + 1
    return [_replace(g, count=c) for g, c in counts.items()]


def input_dims(model: ir.Model, input_names: Sequence[str | None], leaves: Sequence[torch.Tensor]) -> dict[str, int]:
    """Symbolic dimension name -> size, from the graph inputs fed the first call's tensors."""
    inputs = {v.name: v for v in model.graph.inputs}
    env: dict[str, int] = {}
    for name, t in zip(input_names, leaves):
        value = inputs.get(name) if name is not None else None
        if value is None or value.shape is None or len(value.shape) != t.dim():
            continue
        for d, size in zip(value.shape, t.shape):
            if not isinstance(d, int) and getattr(d, "value", None):
                env.setdefault(d.value, int(size))
    return env


def concrete_shapes(
    model: onnx.ModelProto, input_names: Sequence[str | None], leaves: Sequence[torch.Tensor]
) -> dict[str, list[int | None]]:
    """Value name -> dims, by shape inference on a copy of ``model`` whose inputs have the first
    call's shapes (for graphs whose shape inference lost the symbols: a Reshape to a computed shape)."""
    from .export.type_inference import infer_types

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    shapes = {n: t.shape for n, t in zip(input_names, leaves) if n is not None}
    for value in copy.graph.input:
        if value.name in shapes and len(value.type.tensor_type.shape.dim) == len(shapes[value.name]):
            for d, size in zip(value.type.tensor_type.shape.dim, shapes[value.name]):
                d.Clear()
                d.dim_value = int(size)
    del copy.graph.value_info[:]
    typed = infer_types(copy, strict=False)
    out = {}
    for v in [*typed.graph.value_info, *typed.graph.input, *typed.graph.output]:
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            out[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
    return out


def conv_problems(
    model: ir.Model, env: dict[str, int], dtype: ir.DataType, concrete: dict | None = None
) -> dict[Conv, list[str]]:
    """The top-level graph's 2-D Conv nodes of ``dtype`` or float32 that ``ortwrap_ops::conv`` can run (explicit
    symmetric pads), with known dimensions: problem -> the nodes' names (its count: how many)."""
    from .passes.conv_transpose_matmul import matmul_form
    from .passes.torch_conv import conv_args, conv_transpose_args

    found: dict[Conv, list[str]] = {}
    for node in model.graph:
        transposed = node.op_type == "ConvTranspose"
        if node.op_type not in ("Conv", "ConvTranspose") or node.domain not in ("", "ai.onnx") or not node.name:
            continue
        x, w = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
        # each in its own dtype: a bf16 graph may have float32 convolutions (the TorchScript exporter's
        # autocast graphs), a float32 graph has none in bf16
        if x is None or w is None or x.dtype != w.dtype or x.dtype not in (dtype, ir.DataType.FLOAT):
            continue
        half = x.dtype == ir.DataType.BFLOAT16
        if transposed and (not half or matmul_form(node) is not None):
            continue  # a float32 one runs as PyTorch's anyway (TorchGradientsPass); the other, a MatMul
        args = (conv_transpose_args if transposed else conv_args)(node, lambda i: None)
        dx, dw = _dims(x, env, concrete or {}), _dims(w, env, concrete or {})
        if args is None or dx is None or dw is None or None in dx or None in dw or len(dw) != 4:
            continue
        if transposed:
            stride, pads, dilation, out_pad, groups = args[3:]
            o = dw[1] * groups
        else:
            (stride, pads, dilation, groups), out_pad, o = args[3:7], (0, 0), dw[0]
        conv = Conv(
            *dx, o, dw[2], dw[3], tuple(stride), tuple(pads), tuple(dilation), groups, "bf16" if half else "f32",
            transposed=transposed, out_pad=tuple(out_pad),
        )  # fmt: skip
        found.setdefault(conv, []).append(node.name)
    return found


# ------------------------------------------------------------------------------------ the decision


def decide_convs(
    rates: Sequence[ConvRate],
    crossing_s: float = CONV_CROSSING_S,
    margin: float = CONV_MARGIN,
    in_step: float = CONV_TORCH_IN_STEP,
) -> list[Conv]:
    """The convolutions PyTorch's route runs faster, its time in a step (``in_step`` x the isolated
    one) and its two ATen calls included, by ``margin`` (a transposed one is an ATen node either way:
    PyTorch's bf16 against its float32, no factor on either side). Pure."""
    return [
        r.conv
        for r in rates
        if (
            r.torch_s < (1.0 - margin) * r.ort_s
            if r.conv.transposed
            else in_step * r.torch_s + 2 * crossing_s < (1.0 - margin) * r.ort_s
        )
    ]


def decide_pool(
    matrix_s: float | None,
    nodes: int,
    largest_elements: int,
    min_node_s: float = POOL_MIN_NODE_S,
    big_elements: int = POOL_BIG_ELEMENTS,
) -> bool:
    """Whether a CPU training graph of ``nodes`` nodes runs on ORT's intra-op pool (torch's thread
    count) rather than on one ORT thread: where the GEMMs and convolutions ORT runs take at least
    ``min_node_s`` a node (``matrix_s`` seconds a step, ``GemmChoice.ort_matrix_seconds``), or a value
    holds ``big_elements`` elements. ORT's pool wakes a sleeping worker for each kernel it splits;
    on a graph of small kernels that costs more than the split saves, and PyTorch's OpenMP workers
    (spinning after each of its parallel regions in the step) hold the other cores meanwhile
    (docs/performance.md, "Threads"). Unknown (``None``): the pool, as before. Pure."""
    if matrix_s is None or largest_elements >= big_elements:
        return True
    return matrix_s >= min_node_s * max(nodes, 1)


def decide(rates: Sequence[Rate], crossing_s: float = CROSSING_S, margin: float = MARGIN) -> tuple[bool, float, float]:
    """Whether the PyTorch route wins on these measured problems: (choice, its estimated seconds a
    step of them through MLAS, through PyTorch). Pure: the rates in, the choice out."""
    ort_s = sum(r.gemm.count * r.gemm.flops / r.ort for r in rates)
    torch_s = sum(r.gemm.count * (r.gemm.flops / r.torch + crossing_s) for r in rates)
    return bool(rates) and torch_s < (1.0 - margin) * ort_s, ort_s, torch_s


# ------------------------------------------------------------------------------------ measuring


def _ort_session(g: Gemm, options: Options):
    from onnx import TensorProto, helper

    from ._ort import ort
    from .runtime.session import session_options

    if g.batch > 1:
        node = helper.make_node("MatMul", ["a", "b"], ["c"])
        a_dims, b_dims = ["batch", "m", "k"], ["batch", "k", "n"]
    else:
        node = helper.make_node("Gemm", ["a", "b"], ["c"], transA=int(g.trans_a), transB=int(g.trans_b))
        a_dims = ["k", "m"] if g.trans_a else ["m", "k"]
        b_dims = ["n", "k"] if g.trans_b else ["k", "n"]
    graph = helper.make_graph(
        [node],
        "gemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_dims),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, b_dims)],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    so = session_options(options)
    so.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _operands(g: Gemm) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    a_shape = (g.k, g.m) if g.trans_a else (g.m, g.k)
    b_shape = (g.n, g.k) if g.trans_b else (g.k, g.n)
    if g.batch > 1:
        a_shape, b_shape = (g.batch, *a_shape), (g.batch, *b_shape)
    return torch.randn(a_shape, generator=gen), torch.randn(b_shape, generator=gen)


def measure(problems: Sequence[Gemm], options: Options, half: bool) -> tuple[list[Rate], float]:
    """Time each problem through MLAS (float32) and PyTorch (float32, or bf16 with ``half``: ``op(A)``
    in bf16, ``op(B)`` cast from float32 in the call, as the native route's weights are), interleaved,
    best of :data:`REPS` after a warm-up call; (the rates, the seconds it took).

    With one thread on both sides the calls are timed in CPU seconds of the process, which other
    processes on a loaded machine do not inflate (a GEMM call there is often preempted: wall-clock
    minima of a few calls were 2-5x off under load 8 on 2 cores); with more, in wall seconds, which is
    what the threads' parallelism shows in."""
    global measurements
    measurements += 1
    start = time.perf_counter()
    one_thread = _one_thread(options)
    clock = time.process_time if one_thread else time.perf_counter
    timed = [p.shrunk(MAX_CALL_FLOPS) for p in problems]
    sessions: dict[tuple, object] = {}
    calls = []
    for g in timed:
        key = (g.batch > 1, g.trans_a, g.trans_b)
        if key not in sessions:
            sessions[key] = _ort_session(g, options)
        sess = sessions[key]
        a, b = _operands(g)
        feeds = {"a": a.numpy(), "b": b.numpy()}
        ta = a.transpose(-1, -2) if g.trans_a else a
        if half:
            ta = ta.to(torch.bfloat16)

        def run_torch(ta=ta, b=b, g=g) -> None:
            bb = b.to(torch.bfloat16) if half else b
            torch.matmul(ta, bb.transpose(-1, -2) if g.trans_b else bb)

        def run_ort(sess=sess, feeds=feeds) -> None:
            sess.run(None, feeds)

        calls.append((run_ort, run_torch))
    best = [[math.inf, math.inf] for _ in timed]
    for rep in range(REPS + 1):
        for i, pair in enumerate(calls):
            for j, call in enumerate(pair):
                t0 = clock()
                call()
                if rep:
                    best[i][j] = min(best[i][j], max(clock() - t0, 1e-9))
        if rep and time.perf_counter() - start > BUDGET_S:
            break
    rates = [Rate(p, g, g.flops / b[0], g.flops / b[1]) for p, g, b in zip(problems, timed, best)]
    return rates, time.perf_counter() - start


def _conv_ort_session(c: Conv, options: Options):
    """ORT's route of one convolution: its Conv and the ConvGrad its gradient builder writes (float32)."""
    from onnx import TensorProto, helper

    from ._ort import ort
    from .runtime.session import session_options

    attrs = {
        "kernel_shape": [c.kh, c.kw], "strides": list(c.stride), "pads": [*c.pads, *c.pads],
        "dilations": list(c.dilation), "group": c.groups,
    }  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs),
        helper.make_node("ConvGrad", ["dy", "x", "w"], ["dx", "dw", "db"], domain="com.microsoft", **attrs),
    ]
    floats = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "w", "b", "dy")]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "dx", "dw", "db")]
    model = helper.make_model(
        helper.make_graph(nodes, "conv", floats, outs),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        ir_version=8,
    )
    so = session_options(options)
    so.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def measure_convs(convs: Sequence[Conv], options: Options) -> tuple[list[ConvRate], float]:
    """Time each convolution's forward and backward through ORT (Conv + ConvGrad, float32) and
    PyTorch (``convolution`` + ``convolution_backward`` in the convolution's dtype; for bf16 with the
    casts the graph has around it), interleaved, the best of :data:`CONV_REPS` after a warm-up call
    (clocks as :func:`measure`'s); (the rates, the seconds it took)."""
    global conv_measurements
    conv_measurements += 1
    start = time.perf_counter()
    clock = time.process_time if _one_thread(options) else time.perf_counter
    rates = []
    for c in convs:
        gen = torch.Generator().manual_seed(0)
        ho, wo = c.out_hw()
        x = torch.randn(c.n, c.c, c.h, c.w, generator=gen)
        w_shape = (c.c, c.o // c.groups) if c.transposed else (c.o, c.c // c.groups)
        w = torch.randn(*w_shape, c.kh, c.kw, generator=gen)
        b = torch.randn(c.o, generator=gen)
        dy = torch.randn(c.n, c.o, ho, wo, generator=gen)
        half = c.dtype == "bf16"
        args = (list(c.stride), list(c.pads), list(c.dilation), c.transposed, list(c.out_pad), c.groups)

        def run_torch(x=x, w=w, b=b, dy=dy, c=c, half=half, args=args) -> None:
            dt = torch.bfloat16 if half else torch.float32
            xc, wc = x.to(dt), w.to(dt)
            torch.ops.aten.convolution(xc, wc, b.to(dt), *args).float()
            grads = torch.ops.aten.convolution_backward(dy.to(dt), xc, wc, [c.o], *args, [True, True, True])
            [g.float() for g in grads]

        if c.transposed:  # the route it takes otherwise: PyTorch's, in float32
            run_ort = functools.partial(run_torch, half=False)
        else:
            sess = _conv_ort_session(c, options)
            feeds = {"x": x.numpy(), "w": w.numpy(), "b": b.numpy(), "dy": dy.numpy()}

            def run_ort(sess=sess, feeds=feeds) -> None:
                sess.run(None, feeds)

        best = [math.inf, math.inf]
        began = time.perf_counter()
        for rep in range(CONV_REPS + 1):
            for j, call in enumerate((run_ort, run_torch)):
                t0 = clock()
                call()
                if rep:
                    best[j] = min(best[j], max(clock() - t0, 1e-9))
            if rep and time.perf_counter() - began > CONV_BUDGET_S:
                break
        rates.append(ConvRate(c, best[0], best[1]))
    return rates, time.perf_counter() - start


# ------------------------------------------------------------------------------------ the disk cache


def _cpu() -> tuple[str, str]:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().splitlines()
    except OSError:
        info = []
    name = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), os.uname().machine)
    flags = next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), [])
    return name, hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16]


def machine(options: Options) -> dict:
    """What a measurement depends on besides the shapes: the CPU, both thread counts, the libraries."""
    from ._ort import ort

    name, flags = _cpu()
    return {
        "cpu": name,
        "flags": flags,
        "ort_threads": options.intra_op_threads or torch.get_num_threads(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "onnxruntime": ort.__version__,
        "method": METHOD,
    }


def _machine_key(options: Options) -> str:
    return hashlib.sha256(json.dumps(machine(options), sort_keys=True).encode()).hexdigest()[:24]


def directory() -> str:
    """Where the measurements are kept: ``<cache_dir()>/gemm``, one JSON file per machine key."""
    return os.path.join(cache_dir(), "gemm")


def _path(key: str) -> str:
    return os.path.join(directory(), f"{key}.json")


def _load(key: str) -> dict:
    try:
        with open(_path(key)) as f:
            return json.load(f).get("rates", {})
    except (OSError, ValueError, AttributeError):
        return {}


def _store(key: str, options: Options, new: dict[str, dict]) -> None:
    path = _path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        rates = {**_load(key), **new}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"machine": machine(options), "rates": rates}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache directory: measured again next process
        logger.info("could not keep the GEMM measurement in %s: %s", path, e)


def keep_on_disk(one_thread: bool, load: float, cpus: int) -> bool:
    """Whether a measurement is kept for later processes: always at one thread (timed in CPU
    seconds, which other processes do not inflate); with more threads not while the machine is
    overloaded (1-minute load average above its CPU count), when PyTorch's OpenMP threads lose most of
    their time to the other processes (3-6 GFLOP/s against 170 for MLAS on 2 loaded cores) and the
    measurement says more about the load than about the libraries. This process still uses it."""
    return one_thread or load <= cpus


def _one_thread(options: Options) -> bool:
    return (options.intra_op_threads or torch.get_num_threads()) == 1 and torch.get_num_threads() == 1


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def _shape_key(g: Gemm, half: bool) -> str:
    """A problem's key in the record (its count is the graph's, not the shape's)."""
    return f"{'bf16' if half else 'f32'} {g.batch} {g.m} {g.n} {g.k} {int(g.trans_a)}{int(g.trans_b)}"


def schema_key(options: Options) -> tuple:
    """What the build cache's key needs of these options: the two options, and for ``"auto"`` the
    machine a measurement depends on (a build made on another CPU, or another thread count, may have
    chosen otherwise)."""
    auto = "auto" in (options.gemm, options.half_compute)
    return (options.gemm, options.half_compute, _machine_key(options) if auto else None)


# ------------------------------------------------------------------------------------ the stage


@dataclass
class _Graph:
    """What the choice reads of a build: the typed model, its export, the first call's tensors."""

    model: ir.Model
    exported: onnx.ModelProto
    input_names: list[str | None]
    leaves: list[torch.Tensor]
    with_backward: bool
    _concrete: dict | None = field(default=None, repr=False)

    def largest_elements(self) -> int:
        """The element count of the graph's largest value whose dims the first call's inputs give."""
        env = input_dims(self.model, self.input_names, self.leaves)
        values = [*self.model.graph.inputs, *(v for node in self.model.graph for v in node.outputs)]
        sizes = [_dims(v, env, self._concrete or {}) for v in values]
        known = max((math.prod(d) for d in sizes if d and None not in d), default=0)
        if known >= POOL_BIG_ELEMENTS:  # (all the thread choice asks; no shape inference for the rest)
            return known
        if self._concrete is None and any(d is None or None in d for d in sizes):
            self._concrete = concrete_shapes(self.exported, self.input_names, self.leaves)
            sizes = [_dims(v, env, self._concrete) for v in values]
        return max((math.prod(d) for d in sizes if d and None not in d), default=0)

    def problems(self, dtype: ir.DataType) -> list[Gemm] | None:
        env = input_dims(self.model, self.input_names, self.leaves)
        found = gemm_problems(self.model, env, dtype, self.with_backward)
        if found is None:  # dims the symbolic shapes lost: inferred again with the first call's shapes
            if self._concrete is None:
                self._concrete = concrete_shapes(self.exported, self.input_names, self.leaves)
            found = gemm_problems(self.model, env, dtype, self.with_backward, self._concrete)
        return found


def choose(
    model: ir.Model,
    exported: onnx.ModelProto,
    input_names: list[str | None],
    leaves: list[torch.Tensor],
    *,
    options: Options,
    device_type: str,
    with_backward: bool,
) -> GemmChoice:
    """The routes of this graph's GEMMs (see the module docstring): the explicit options as given,
    ``"auto"`` by measurement (or a cached one)."""
    torch_gemm, native = options.torch_gemm, options.native_bf16
    if device_type != "cpu":
        return GemmChoice(bool(torch_gemm), bool(native), how="not cpu")
    from .passes.half_matmul import _has_half_values

    if _has_half_values(model.graph):
        option, dtype, fixed = "half_compute", ir.DataType.BFLOAT16, native
    else:
        option, dtype, fixed = "gemm", ir.DataType.FLOAT, torch_gemm
    if fixed is not None:
        return GemmChoice(bool(torch_gemm), bool(native), option)
    graph = _Graph(model, exported, input_names, leaves, with_backward)
    try:
        chosen, fields = _choose(graph, option, dtype, options)
    except Exception as e:  # NOTE: a choice that cannot be measured must not fail the build: MLAS, and say why
        logger.warning("%s='auto' could not measure the GEMMs (%s: %s); MLAS runs them", option, type(e).__name__, e)
        chosen, fields = False, {"how": "measurement failed"}
    convs: dict = {}
    if with_backward:
        try:
            convs = _choose_convs(graph, dtype, options)
        except Exception as e:  # NOTE: as above: ORT's Conv then
            logger.warning("%s='auto' could not measure the convolutions (%s: %s)", option, type(e).__name__, e)
            convs = {"conv_how": "measurement failed"}
    routes = {"torch_gemm": bool(torch_gemm), "native_bf16": bool(native)}
    routes["torch_gemm" if option == "gemm" else "native_bf16"] = chosen
    try:
        largest = graph.largest_elements() if with_backward else 0  # (read for training graphs only)
    except Exception as e:  # NOTE: only the thread choice reads it: unknown keeps ORT's pool
        logger.debug("the graph's largest value could not be sized (%s: %s)", type(e).__name__, e)
        largest = POOL_BIG_ELEMENTS
    choice = GemmChoice(**routes, option=option, **fields, **convs, largest_elements=largest)
    logger.debug("%s", choice.summary())  # the build summary line is the one INFO line of a build
    return choice


def _choose(graph: _Graph, option: str, dtype: ir.DataType, options: Options) -> tuple[bool, dict]:
    """(the PyTorch route or not, the other ``GemmChoice`` fields) for one ``"auto"`` option."""
    half = option == "half_compute"
    if half:
        from .cpu import cpu_has_native_bf16

        if not cpu_has_native_bf16():  # PyTorch's bf16 GEMMs convert to float32: never faster
            return False, {"how": "no bf16 instructions"}
    problems = graph.problems(dtype)
    if problems is None:
        return False, {"how": "no shapes"}
    step_flops = sum(p.flops * p.count for p in problems)
    if step_flops < MIN_STEP_FLOPS:
        return False, {"how": "small", "step_flops": step_flops}
    top = sorted(problems, key=lambda p: (-p.flops * p.count, p.m, p.n, p.k))[:MAX_SHAPES]
    key = _machine_key(options)
    known = _memo.setdefault(key, {})
    if any(_shape_key(p, half) not in known for p in top):
        known.update(_load(key))
    missing = [p for p in top if _shape_key(p, half) not in known]
    how, seconds = "cached", 0.0
    if missing:
        measured, seconds = measure(missing, options, half)
        new = {
            _shape_key(r.gemm, half): {"timed": asdict(r.timed), "ort": r.ort, "torch": r.torch, "seconds": seconds}
            for r in measured
        }
        known.update(new)
        how = "measured" if len(missing) == len(top) else "measured in part"
        one_thread = _one_thread(options)
        load, cpus = _load_average(), os.cpu_count() or 1
        if keep_on_disk(one_thread, load, cpus):
            _store(key, options, new)
        else:
            how += f", not kept: load {load:.1f} on {cpus} CPUs"
    rates = []
    for p in top:
        r = known[_shape_key(p, half)]
        rates.append(Rate(p, Gemm(**r["timed"]), r["ort"], r["torch"]))
    chosen, ort_s, torch_s = decide(rates)
    fields = {"how": how, "rates": tuple(rates), "ort_s": ort_s, "torch_s": torch_s, "seconds": seconds}
    return chosen, {**fields, "step_flops": step_flops}


def _choose_convs(graph: _Graph, dtype: ir.DataType, options: Options) -> dict:
    """The ``GemmChoice`` fields of the convolution route (``torch_convs``, ``conv_rates``,
    ``conv_how``): the graph's convolution shapes timed (or read from the machine's record) and
    :func:`decide_convs`. Empty where the graph has no convolution worth measuring."""
    env = input_dims(graph.model, graph.input_names, graph.leaves)
    found = conv_problems(graph.model, env, dtype)
    convs = sum(n.op_type in ("Conv", "ConvTranspose") and n.domain in ("", "ai.onnx") for n in graph.model.graph)
    if sum(len(names) for names in found.values()) < convs:  # dims the symbolic shapes lost (or not 2-D)
        if graph._concrete is None:
            graph._concrete = concrete_shapes(graph.exported, graph.input_names, graph.leaves)
        found = conv_problems(graph.model, env, dtype, graph._concrete)
    counted = {_replace_conv(c, len(names)): names for c, names in found.items() if c.flops >= CONV_MIN_FLOPS}
    if not counted:
        return {}
    top = sorted(counted, key=lambda c: (-c.flops * c.count, c.key()))[:CONV_MAX_SHAPES]
    key = _machine_key(options)
    known = _memo.setdefault(key, {})
    if any(c.key() not in known for c in top):
        known.update(_load(key))
    missing = [c for c in top if c.key() not in known]
    how = "cached"
    if missing:
        measured, seconds = measure_convs(missing, options)
        new = {r.conv.key(): {"ort_s": r.ort_s, "torch_s": r.torch_s, "seconds": seconds} for r in measured}
        known.update(new)
        how = "measured" if len(missing) == len(top) else "measured in part"
        load, cpus = _load_average(), os.cpu_count() or 1
        if keep_on_disk(_one_thread(options), load, cpus):
            _store(key, options, new)
        else:
            how += f", not kept: load {load:.1f} on {cpus} CPUs"
    rates = tuple(ConvRate(c, known[c.key()]["ort_s"], known[c.key()]["torch_s"]) for c in top)
    names = tuple(n for c in decide_convs(rates) for n in counted[c])
    return {"torch_convs": names, "conv_rates": rates, "conv_how": how}


def _replace_conv(c: Conv, count: int) -> Conv:
    return Conv(**{**asdict(c), "count": count})
