"""ortwrap's CPU kernels (``kernels/_cpu.c``), each declared once: name, typed inputs and outputs
(a signature string, ``ops/declare.py``), gradient (the backward kernel and how the gradient node
is wired), the ONNX op types where the rewrite that introduces it starts
(``passes/native_cpu_kernels.py``) and its recompute cost. Everything else is derived from, or
checked against, these declarations:

* ``_cpu.c``'s ``kOps`` table carries the same signature strings; ``kernels.install`` compares them
  with the declarations when the library loads and raises :class:`KernelTableError` naming each
  mismatch. The C runner checks each node's input and output counts against the signature.
* ``kernels.install`` registers the gradient definitions from the declarations;
* ``NativeCPUKernelsPass`` dispatches on :attr:`Kernel.replaces`, counts per declared kernel, and
  types the outputs from the signature;
* ``ops/tables.py`` derives what the other stages read (recompute costs, bf16 variants).
"""

from __future__ import annotations

import functools

from .declare import OPS_NAMESPACE, Kernel, KernelTableError, gradient

__all__ = ["KERNELS", "check_kernel_table", "kernel"]

#: Every kernel in ``kernels/_cpu.c``, forward kernels with their gradients, then backward kernels.
KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "gelu",
        "f>f",
        "y = x * Phi(x) (erf GELU)",
        gradient("gelu_backward", ["GO(0)", "I(0)"], ["GI(0)"]),
        replaces=("Erf",),
        rewrite="_gelu",
    ),
    Kernel("gelu_backward", "ff>f", "dx from dy, x"),
    Kernel(
        "gelu_tanh",
        "f>f",
        "0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))",
        gradient("gelu_tanh_backward", ["GO(0)", "I(0)"], ["GI(0)"]),
        replaces=("Tanh",),
        rewrite="_gelu_tanh",
    ),
    Kernel("gelu_tanh_backward", "ff>f", "dx from dy, x"),
    # Starting at ortwrap's own ATen nodes (TorchGradientsPass has made HardSwish/HardSigmoid those):
    # MobileNetV3's activations without a Python call each (docs/performance.md, "The model zoo").
    Kernel(
        "hardswish",
        "f>f",
        "x * min(max(x + 3, 0), 6) / 6 (ortwrap_ops::hardswish)",
        gradient("hardswish_backward", ["GO(0)", "I(0)"], ["GI(0)"]),
        replaces=("ATen",),
        rewrite="_hard_activation",
    ),
    Kernel("hardswish_backward", "ff>f", "dx from dy, x"),
    Kernel(
        "hardsigmoid",
        "f>f",
        "min(max(x + 3, 0), 6) / 6 (ortwrap_ops::hard_sigmoid with alpha 1/6, beta 1/2)",
        gradient("hardsigmoid_backward", ["GO(0)", "I(0)"], ["GI(0)"]),
        replaces=("ATen",),
        rewrite="_hard_activation",
    ),
    Kernel("hardsigmoid_backward", "ff>f", "dx from dy, x"),
    # hardtanh/relu6 (and, where the installed torch's clamp gives 0 at its number bounds, clamp):
    # ATen nodes (ops.ATEN_OPS: ORT's Clip gradient passes the gradient at a bound), without a Python call.
    Kernel(
        "clamp",
        "fFF>f",
        "min(max(x, lo), hi), NaN kept, a NaN bound absent (the ATen nodes hardtanh, relu6, clamp, clip, ...)",
        gradient("clamp_backward", ["GO(0)", "I(0)", "I(1)", "I(2)"], ["GI(0)"], stop=[1, 2]),
        replaces=("ATen",),
        rewrite="_clamp",
    ),
    Kernel("clamp_backward", "ffFF>f", "dy, x, lo, hi -> dx: dy where lo < x < hi (an absent bound: <=), else 0"),
    Kernel(
        "layer_norm",
        "fff?FI>fff",
        "x, weight, bias, eps, axis -> y, mean, rstd (shape[:axis] + 1s)",
        gradient(
            "layer_norm_backward",
            ["GO(0)", "I(0)", "I(1)", "O(1)", "O(2)", "I(4)"],
            ["GI(0)", "GI(1)", "GI(2)"],
            stop=[3, 4],
        ),
        replaces=("LayerNormalization",),
        rewrite="_layer_norm",
    ),
    Kernel("layer_norm_backward", "fffffI>fff", "dy, x, weight, mean, rstd, axis -> dx, dweight, dbias"),
    Kernel(
        "layer_norm_bf16",
        "fff?FI>hff",
        "layer_norm with y rounded to bfloat16 (read only by bf16 GEMMs, which round it anyway)",
        gradient(
            "layer_norm_bf16_backward",
            ["GO(0)", "I(0)", "I(1)", "O(1)", "O(2)", "I(4)"],
            ["GI(0)", "GI(1)", "GI(2)"],
            stop=[3, 4],
        ),
        variant_of="layer_norm",
    ),
    Kernel("layer_norm_bf16_backward", "hffffI>fff", "layer_norm_backward with dy in bfloat16"),
    # nn.GroupNorm with its affine (and a SiLU after it): both exporters' Reshape, InstanceNormalization,
    # Reshape, Mul, Add (Sigmoid, Mul) as one node each way (a rewrite rule: passes/native_cpu_kernels.py).
    Kernel(
        "group_norm",
        "fffFII>f",
        "x [N, C, *], gamma [C], beta [C], eps, groups, silu -> z = GroupNorm(x) * gamma + beta; z * sigmoid(z) if silu",
        # the backward computes the statistics (and z) again, as instance_norm's
        gradient(
            "group_norm_backward",
            ["GO(0)", "I(0)", "I(1)", "I(2)", "I(3)", "I(4)", "I(5)"],
            ["GI(0)", "GI(1)", "GI(2)"],
            stop=[3, 4, 5],
        ),
        replaces=("InstanceNormalization",),
        rewrite="_group_norm",
    ),
    Kernel("group_norm_backward", "ffffFII>fff", "dy, x, gamma, beta, eps, groups, silu -> dx, dgamma, dbeta"),
    # nn.GroupNorm and nn.InstanceNorm*d (both exporters write InstanceNormalization): one node each way
    # instead of the decomposition's ~60 (passes/instance_norm.py), which stays for what this does not cover.
    Kernel(
        "instance_norm",
        "fffF>f",
        "x [N, C, *], scale [C], bias [C], eps -> y, normalized over shape[2:]",
        # the backward computes the statistics again (saved ones made recompute="cheap" rerun the forward for them)
        gradient("instance_norm_backward", ["GO(0)", "I(0)", "I(1)", "I(3)"], ["GI(0)", "GI(1)", "GI(2)"], stop=[3]),
        replaces=("InstanceNormalization",),
        rewrite="_instance_norm",
    ),
    Kernel("instance_norm_backward", "fffF>fff", "dy, x, scale, eps -> dx, dscale, dbias"),
    # ONNX MaxPool (1-D and 2-D, floor mode) without the int64 indices ORT's gradient adds to it (~9x the pooling's
    # cost): the backward finds each window's maximum again in x, PyTorch's choice among equal ones.
    Kernel(
        "max_pool",
        "fi>f",
        "x [N, C, H, W] or [N, C, W], params [kh, kw, sh, sw, pad top, left, bottom, right, dh, dw] -> y (floor mode)",
        gradient("max_pool_backward", ["GO(0)", "I(0)", "I(1)"], ["GI(0)"], stop=[1]),
        replaces=("MaxPool",),
        rewrite="_max_pool",
        heavy=True,  # recompute="cheap" keeps windowed pooling (grad/recompute.py)
    ),
    Kernel(
        "max_pool_backward", "ffi>f", "dy, x, params -> dx: each dy to its window's maximum (first of equals, last NaN)"
    ),
    Kernel(
        "embedding",
        "fi>f",
        "weight, indices -> weight[indices]",
        gradient("embedding_backward", ["GO(0)", "I(1)", "I(0)"], ["GI(0)"], stop=[1]),
        replaces=("Gather",),
        rewrite="_embedding",
    ),
    Kernel("embedding_backward", "fif>f", "dy, indices, weight -> dweight"),
    Kernel(
        "softmax",
        "f>f",
        "softmax over the last dimension",
        gradient("softmax_backward", ["GO(0)", "O(0)"], ["GI(0)"]),
        replaces=("Softmax",),
        rewrite="_softmax",
    ),
    Kernel("softmax_backward", "ff>f", "dy, y -> dx"),
    Kernel(
        "cross_entropy",
        "fiII>ff",
        "scores [n, c], labels, ignore_index, reduction (none, mean, sum) -> loss, log_prob",
        gradient("cross_entropy_backward", ["GO(0)", "O(1)", "I(1)", "I(2)", "I(3)"], ["GI(0)"], stop=[1, 2, 3]),
        replaces=("SoftmaxCrossEntropyLoss",),
        rewrite="_cross_entropy",
    ),
    Kernel("cross_entropy_backward", "ffiII>f", "dloss, log_prob, labels, ignore_index, reduction -> dscores"),
    Kernel(
        "attention_bf16",
        "hhhf?F>hf",
        "softmax attention of bf16 q [..., T, D], k^T [..., D, S], v [..., S, E], additive mask, scale -> out, lse",
        gradient(
            "attention_bf16_backward",
            ["GO(0)", "I(0)", "I(1)", "I(2)", "O(0)", "O(1)", "I(3)", "I(4)"],
            ["GI(0)", "GI(1)", "GI(2)"],
            stop=[3, 4],
        ),
        replaces_ops=(f"{OPS_NAMESPACE}::attention_keep_inputs", f"{OPS_NAMESPACE}::attention"),
        heavy=True,
    ),
    Kernel(
        "attention_bf16_backward", "hhhhhff?F>hhh", "dout, q, kt, v, out, lse, mask, scale -> dq, dkt, dv", heavy=True
    ),
    Kernel(
        "attention_bthd_bf16",
        "hhhf?F>hf",
        "attention_bf16 on q [B, T, H, D], k [B, S, H, D], v [B, S, H, E] -> out [B, T, H, E], lse [B, H, T]",
        gradient(
            "attention_bthd_bf16_backward",
            ["GO(0)", "I(0)", "I(1)", "I(2)", "O(0)", "O(1)", "I(3)", "I(4)"],
            ["GI(0)", "GI(1)", "GI(2)"],
            stop=[3, 4],
        ),
        variant_of="attention_bf16",
        heavy=True,
    ),
    Kernel(
        "attention_bthd_bf16_backward",
        "hhhhhff?F>hhh",
        "dout, q, k, v, out, lse, mask, scale -> dq, dk, dv",
        heavy=True,
    ),
)


@functools.cache
def kernel(name: str) -> Kernel:
    """The declaration of kernel ``name``."""
    for k in KERNELS:
        if k.name == name:
            return k
    raise KeyError(f"no ortwrap CPU kernel named {name!r}")


def check_kernel_table(compiled: dict[str, str]) -> None:
    """Compare the compiled table (name -> signature, from ``_cpu.c``) with :data:`KERNELS`.

    Raises:
        KernelTableError: naming every kernel that is missing on either side or whose signature differs.
    """
    problems = []
    declared = {k.name: k.signature for k in KERNELS}
    for name, sig in declared.items():
        if name not in compiled:
            problems.append(f"{name}: declared in ortwrap/ops/kernels.py but not in _cpu.c's kOps")
        elif compiled[name] != sig:
            problems.append(f"{name}: _cpu.c says {compiled[name]!r}, ortwrap/ops/kernels.py says {sig!r}")
    problems += [
        f"{n}: in _cpu.c's kOps but not declared in ortwrap/ops/kernels.py" for n in compiled if n not in declared
    ]
    for k in KERNELS:
        if k.gradient is not None and k.gradient.backward not in declared:
            problems.append(f"{k.name}: its backward kernel {k.gradient.backward!r} is not declared")
    if problems:
        raise KernelTableError("ortwrap's kernel table has drifted from its declarations: " + "; ".join(problems))
