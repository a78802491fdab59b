"""ortwrap's own ATen -> ONNX translations for the dynamo exporter, where torchlib's are wrong for training.

The dynamo exporter translates ATen ops with onnxscript's torchlib, which targets inference. Some of
its translations are silently wrong in training mode; ortwrap replaces them through
``torch.onnx.export(custom_translation_table=...)``:

======================================================  ===========================================
ATen op                                                 torchlib 0.7 does / ortwrap emits
======================================================  ===========================================
``aten._native_batch_norm_legit_functional``            forces ``training=False``: normalizes with
(BatchNorm in training mode)                            the running statistics and returns them
                                                        unchanged. ortwrap emits
                                                        ``BatchNormalization(training_mode=1)``,
                                                        whose running statistics the shared
                                                        ``BatchNormRunningStatsPass`` routes to the
                                                        buffer outputs with PyTorch's unbiased
                                                        variance, as for the TorchScript exporter.
``aten.native_batch_norm`` (running statistics          normalizes with the wrong statistics. ortwrap
that are module inputs)                                 writes the same as for the op above; both
                                                        return eager's saved mean and inverse std
                                                        (outputs 1 and 2; they were the running ones).
``aten._native_batch_norm_legit_no_training``          returns the running mean as the saved mean,
(``F.batch_norm(training=False)``)                      which the exporter declared ``[0]`` (eager's
                                                        empty saved mean): the running-mean input
                                                        became ``[0]``. ortwrap returns new empty
                                                        values, as for ``native_batch_norm``.
``aten.embedding`` with ``padding_idx``                 a plain ``Gather``, whose gradient reaches
                                                        the padding row. ortwrap emits the
                                                        TorchScript path's form: padding positions
                                                        read a stop-gradient copy of the weight.
``aten.cross_entropy_loss`` with ``label_smoothing``    ignores the smoothing (a wrong loss).
                                                        ortwrap adds the smoothing term, as its
                                                        TorchScript symbolic does.
``aten.cross_entropy_loss`` of class probabilities      ``SoftmaxCrossEntropyLoss`` of the float
                                                        target, which ORT refuses (indices only).
                                                        ortwrap writes eager's sum of target times
                                                        log-softmax.
``aten.gelu``                                           ONNX ``Gelu`` (opset 20), whose ORT 1.19.2
                                                        gradient ignores ``approximate="tanh"``.
                                                        ortwrap writes both forms out in elementwise
                                                        ops, as the TorchScript exporter does (ORT
                                                        fuses the erf form back into ``Gelu``).
``aten.squeeze.dim``/``dims`` of a dim that is not 1      ``Squeeze`` of that axis, which fails where
                                                        torch's is a no-op. ortwrap squeezes only the
                                                        axes whose size is a static 1 (torch.export
                                                        assumes symbolic dims are at least 2).
``aten.softmax.int``/``log_softmax.int`` with dtype     casts the result, not the input (eager's
                                                        order). ortwrap casts the input first.
``aten.unsafe_chunk``                                   none: the decomposition's ``unsafe_split`` of
                                                        a computed size failed the constant folder.
                                                        ortwrap writes torchlib's ``chunk``.
``aten.scalar_tensor`` (Python scalars, after type      a float32 constant cast to the scalar's dtype:
promotion)                                              a float64 scalar loses its digits. ortwrap
                                                        writes a constant of the dtype itself.
``aten.atleast_{1,2,3}d.Sequence``                      a ``SequenceMap`` with an ``If`` on the rank
                                                        (ORT cannot differentiate either). ortwrap
                                                        reshapes each tensor by its static rank.
``aten.native_layer_norm`` without weight               ``LayerNormalization`` without its scale
                                                        input, on which ORT's gradient builder
                                                        fails. ortwrap passes a constant scale of 1
                                                        (and bias of 0).
``aten.native_layer_norm``'s mean and rstd outputs      differentiable outputs whose gradient no
                                                        node reads: ORT's builder failed ("grad node
                                                        arg should exist"). ortwrap stops their
                                                        gradient, as eager's backward ignores it.
``aten.unsqueeze`` of a complex tensor                  none (DeepSeek-V2's rotary table). ortwrap
                                                        unsqueezes torchlib's real ``[..., 2]`` form.
``aten.scalar_tensor`` of a complex dtype               a complex ONNX constant, where torchlib's
                                                        complex values are real ``[..., 2]``.
                                                        ortwrap writes ``[value, 0]``.
``aten.chalf`` (complex32)                              ``_to_copy`` to complex32: KeyError. ortwrap
                                                        writes ``[..., (x, 0)]`` in float16.
======================================================  ===========================================

Before translation, :func:`number_operands_as_tensors` gives an op a 0-d tensor where the capture
recorded a Python number as its first operand (``torch.add(0.3333, mask)``) or beside a complex one.

Some ops run as ATen nodes instead (:data:`TRAINING_ATEN_OPS`: PyTorch's kernel forward, PyTorch's
autograd for the gradient, ``export/aten_fallback.py``), where torchlib's form trains wrong:

========================================  ===========================================================
``aten.scatter_reduce``                   ``ScatterElements(reduction=...)``, whose ORT gradient is
                                          a plain scatter's: the gradients of ``self`` and ``src``
                                          were wrong for every reduction, and ``mean`` forgot to
                                          count ``self`` (its output too).
``aten.index_add``                        the gradient of ``self`` was zeroed at the added rows.
``aten._safe_softmax``                    a row that is all -inf gave NaN (eager: zeros).
``aten.max_pool{1,2,3}d_with_indices``    on an unbatched input (``Unsqueeze`` -> ``MaxPool`` with
(``return_indices=True``)                 indices), ORT 1.19.2's ``MaxPoolGrad`` crashed the
                                          process (SIGSEGV). A pool without indices is
                                          ``aten.max_pool2d``, left to ORT.
``aten.exponential``, ``aten.uniform``    no translation: the exporter's decomposition left
(``Tensor.exponential_``, ``uniform_``:   ``prims.uniform`` of a symbolic shape, which no node could
PhiMoE's router)                          take. As ATen nodes they draw from PyTorch's generator, as
                                          eager does (and as the TorchScript exporter's ATen nodes).
========================================  ===========================================================

One op is decomposed before translation instead (:func:`training_decompositions`):
``aten.instance_norm`` in training mode with running statistics (``InstanceNorm(track_running_stats=True)``)
updates them in place although its schema does not say so, so ``torch.export`` keeps no buffer
mutation for them, and torchlib's ``InstanceNormalization`` drops them. ortwrap's decomposition
writes eager's update (the batch mean of the per-instance means and unbiased variances) and
normalizes in elementwise ops.
"""

from __future__ import annotations

import torch

from .._compat import torch as compat


def _batch_norm_functional(input, weight=None, bias=None, running_mean=None, running_var=None, training=False,
                           momentum=0.1, eps=1e-5):  # fmt: skip
    from onnxscript import opset18 as op

    if weight is None:
        weight = op.Expand(op.CastLike(op.Constant(value_float=1.0), input), op.Shape(input, start=1, end=2))
    if bias is None:
        bias = op.Expand(op.CastLike(op.Constant(value_float=0.0), input), op.Shape(input, start=1, end=2))
    if running_mean is None or running_var is None:
        raise NotImplementedError("ortwrap: batch_norm without running statistics is exported by torchlib")
    if training:
        y, new_mean, new_var = op.BatchNormalization(
            input, weight, bias, running_mean, running_var, epsilon=eps, momentum=1.0 - momentum, training_mode=1
        )
        # Outputs 1 and 2: the batch mean and 1/sqrt(biased variance + eps), as eager returns them
        # (they were the running statistics: wrong wherever a caller read them). Not differentiable
        # in eager: stop-gradient here. Nothing reads them in a model's graph, and the cleanup drops them.
        axes = op.Concat(
            op.Constant(value_ints=[0]), op.Range(op.Constant(value_int=2), op.Size(op.Shape(input)), 1), axis=0
        )
        mean = op.ReduceMean(input, axes, keepdims=1)
        centered = op.Sub(input, mean)
        var = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=0)
        eps_value = op.CastLike(op.Constant(value_float=eps), input)
        stop = _stop_gradient_op()
        save_mean = stop(op.Reshape(mean, op.Constant(value_ints=[-1])))
        save_invstd = stop(op.Reciprocal(op.Sqrt(op.Add(var, eps_value))))
    else:
        y = op.BatchNormalization(input, weight, bias, running_mean, running_var, epsilon=eps, momentum=1.0 - momentum)
        new_mean, new_var = running_mean, running_var
        # Eager's saved statistics in eval mode are empty (CPU): new empty values. (They were the
        # running statistics, which the exporter then declared [0], eager's shape: the running-stat
        # inputs became [0], and ORT's gradient broadcast against them failed at run time.)
        save_mean, save_invstd = _empty_like_dtype(input), _empty_like_dtype(input)
    # Outputs 3 and 4 mirror the TorchScript exporter's form, Identity of the running-stat inputs;
    # BatchNormRunningStatsPass rewires them to the node's updated statistics.
    del new_mean, new_var
    return y, save_mean, save_invstd, op.Identity(running_mean), op.Identity(running_var)


def _native_batch_norm(input, weight=None, bias=None, running_mean=None, running_var=None, training=False,
                       momentum=0.1, eps=1e-5):  # fmt: skip
    """``aten.native_batch_norm`` (left unfunctionalized where the running statistics are inputs of
    the module): torchlib's normalized with the wrong statistics. ortwrap's training form, or in
    eval mode the empty saved statistics eager returns."""
    y, save_mean, save_invstd, _, _ = _batch_norm_functional(
        input, weight, bias, running_mean, running_var, training, momentum, eps
    )
    return y, save_mean, save_invstd


def _empty_like_dtype(input):
    """A new ``[0]`` tensor of ``input``'s dtype."""
    import numpy as np
    import onnx
    from onnxscript import opset18 as op

    empty = op.Constant(value=onnx.numpy_helper.from_array(np.zeros((0,), dtype=np.float32)))
    return op.CastLike(empty, input)


def _native_batch_norm_no_training(input, weight=None, bias=None, running_mean=None, running_var=None,
                                   momentum=0.1, eps=1e-5):  # fmt: skip
    """``aten._native_batch_norm_legit_no_training`` (``F.batch_norm(training=False)`` decomposed):
    torchlib returned the running mean, cast to itself, as the saved mean, and the exporter gave
    that value eager's shape of it, ``[0]``: the cast folded away, the running-mean *input* was
    declared ``[0]`` and ORT's gradient broadcast against it failed at run time. ortwrap's eval form
    returns the empty saved statistics eager returns, as new values."""
    return _native_batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)


def _unsafe_chunk(self, chunks, dim=0):
    """``aten.unsafe_chunk``: no torchlib translation, and its decomposition's ``unsafe_split`` of a
    computed size along a dynamic dim is a ``SplitToSequence`` the onnxscript constant folder fails
    on. torchlib's ``chunk`` (the same function), ``Split`` into ``chunks`` outputs, the last shorter."""
    from onnxscript import opset18 as op

    if chunks == 1:
        return op.Identity(self)
    return op.Split(self, axis=dim, num_outputs=chunks)


def _stop_gradient_op():
    """``ortwrap::StopGradient`` (resolved by ``passes/stop_gradient.py``), callable from onnxscript."""
    import onnxscript

    from .schemas import ORTWRAP_DOMAIN, register_schemas

    register_schemas()
    return onnxscript.values.Opset(ORTWRAP_DOMAIN, 1).StopGradient


def _detach(self):
    """``detach`` / ``detach_``: torchlib writes ``Identity``, which ORT differentiates through."""
    return _stop_gradient_op()(self)


def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    from onnxscript import opset18 as op

    if scale_grad_by_freq:
        raise NotImplementedError("ortwrap: nn.Embedding(scale_grad_by_freq=True) has no ONNX Runtime equivalent")
    gathered = op.Gather(weight, indices)
    if padding_idx is None or padding_idx < 0:
        return gathered
    frozen_rows = op.Gather(_stop_gradient_op()(weight), indices)
    is_pad = op.Equal(op.Cast(indices, to=7), op.Constant(value_int=padding_idx))
    is_pad = op.Unsqueeze(is_pad, op.Constant(value_ints=[-1]))
    return op.Where(is_pad, frozen_rows, gathered)


def _cross_entropy(logits, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    from onnxscript import opset18 as op

    mode = {0: "none", 1: "mean", 2: "sum"}[reduction]
    if target.dtype is not None and target.dtype.is_floating_point():
        return _cross_entropy_probabilities(logits, target, weight, mode, label_smoothing)
    inputs = [logits, target] + ([weight] if weight is not None else [])
    loss, _log_prob = op.SoftmaxCrossEntropyLoss(*inputs, reduction=mode, ignore_index=ignore_index)
    if not label_smoothing:
        return loss
    if weight is not None:
        raise NotImplementedError("ortwrap: cross_entropy with both class weights and label_smoothing")
    # torch: (1 - eps) * nll + eps / C * sum_c(-log p_c), zero at ignored targets, reduced like nll.
    dtype = logits.dtype

    def const(v: float):
        return _typed_constant(v, dtype)

    log_p = op.LogSoftmax(logits, axis=1)
    smooth = op.Neg(op.ReduceSum(log_p, op.Constant(value_ints=[1]), keepdims=0))
    ignored = op.Equal(target, op.Constant(value_int=ignore_index))
    smooth = op.Where(ignored, const(0.0), smooth)
    if mode == "mean":
        kept = op.Cast(op.Not(ignored), to=dtype)
        smooth = op.Div(op.ReduceSum(smooth, keepdims=0), op.ReduceSum(kept, keepdims=0))
    elif mode == "sum":
        smooth = op.ReduceSum(smooth, keepdims=0)
    classes = op.Cast(op.Gather(op.Shape(logits), op.Constant(value_int=1), axis=0), to=dtype)
    return op.Add(op.Mul(const(1.0 - label_smoothing), loss), op.Mul(op.Div(const(label_smoothing), classes), smooth))


def _cross_entropy_probabilities(logits, target, weight, mode: str, label_smoothing: float):
    """``cross_entropy`` of class probabilities (a float target): ``SoftmaxCrossEntropyLoss`` takes
    class indices only (ORT refused the float target). Eager's form: ``-sum_c(w_c t_c log_softmax(x)_c)``
    over the class dim, ``t`` smoothed to ``t (1 - eps) + eps / C``; ``mean`` divides by the number of
    samples (not by the weights)."""
    import numpy as np
    from onnxscript import opset18 as op

    rank = len(logits.shape)
    axis = 1 if rank > 1 else 0
    dtype = logits.dtype
    log_p = op.LogSoftmax(logits, axis=axis)
    if label_smoothing:
        classes = op.Cast(op.Gather(op.Shape(logits), op.Constant(value_int=axis), axis=0), to=dtype)
        smoothing = op.Div(_typed_constant(label_smoothing, dtype), classes)
        target = op.Add(op.Mul(target, _typed_constant(1.0 - label_smoothing, dtype)), smoothing)
    prod = op.Mul(log_p, target)
    if weight is not None:
        shape = np.array([-1] + [1] * (rank - axis - 1), dtype=np.int64)
        prod = op.Mul(prod, op.Reshape(weight, op.Constant(value_ints=[int(v) for v in shape])))
    loss = op.Neg(op.ReduceSum(prod, op.Constant(value_ints=[axis]), keepdims=0))
    if mode == "mean":
        return op.ReduceMean(loss, keepdims=0) if rank > 1 else loss
    if mode == "sum":
        return op.ReduceSum(loss, keepdims=0) if rank > 1 else loss
    return loss


def _typed_constant(v: float, dtype):
    """A scalar constant in ``dtype`` (an ONNX type), rounded once from ``v``: float64 keeps the
    Python float exactly (a float32 constant cast to float64 would not), half-precision types go
    through float32 as before."""
    import numpy as np
    import onnx
    from onnxscript import opset18 as op

    code = int(getattr(dtype, "value", dtype))
    if code == onnx.TensorProto.DOUBLE:
        return op.Constant(value=onnx.numpy_helper.from_array(np.array(v, dtype=np.float64)))
    return op.Cast(op.Constant(value_float=v), to=code)


def _scalar_tensor(s, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten.scalar_tensor``: torchlib writes a Python float as a float32 constant and casts it,
    which rounds a float64 scalar (``x * (1/3)`` in a ``.double()`` model) to float32 precision.
    Here a constant scalar becomes a constant of its dtype directly."""
    import numpy as np
    import onnx
    from onnxscript import opset18 as op

    code = onnx.TensorProto.FLOAT if dtype is None or dtype == -1 else int(getattr(dtype, "value", dtype))
    parts = {onnx.TensorProto.COMPLEX64: np.float32, onnx.TensorProto.COMPLEX128: np.float64}.get(code)
    if parts is not None:  # torchlib's form of a complex value: (real, imaginary) in a trailing dim
        if isinstance(s, (bool, int, float)):
            return op.Constant(value=onnx.numpy_helper.from_array(np.array([s, 0.0], dtype=parts)))
        real = op.Reshape(op.Cast(s, to=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(parts))), [1])
        return op.Concat(real, op.Constant(value=onnx.numpy_helper.from_array(np.zeros(1, dtype=parts))), axis=0)
    if isinstance(s, (bool, int, float)) and code != onnx.TensorProto.BFLOAT16:
        np_dtype = onnx.helper.tensor_dtype_to_np_dtype(code)
        return op.Constant(value=onnx.numpy_helper.from_array(np.array(s, dtype=np_dtype)))
    if isinstance(s, (bool, int, float)):
        return op.Cast(op.Constant(value_float=float(s)), to=code)
    return op.Cast(s, to=code)


def _gelu(x, approximate="none"):
    from onnxscript import opset18 as op

    dtype = x.dtype

    def const(v: float):
        return _typed_constant(v, dtype)

    if approximate == "tanh":
        inner = op.Mul(const(0.7978845608028654), op.Add(x, op.Mul(const(0.044715), op.Mul(x, op.Mul(x, x)))))
        return op.Mul(op.Mul(const(0.5), x), op.Add(const(1.0), op.Tanh(inner)))
    return op.Mul(op.Mul(x, op.Add(op.Erf(op.Div(x, const(1.4142135623730951))), const(1.0))), const(0.5))


def _native_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    import numpy as np
    import onnx
    from onnxscript import opset18 as op

    shape = [int(d) for d in normalized_shape]
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(input.dtype.value if hasattr(input.dtype, "value") else input.dtype)
    if weight is None:
        weight = op.Constant(value=onnx.numpy_helper.from_array(np.ones(shape, dtype=np_dtype)))
    if bias is None:
        bias = op.Constant(value=onnx.numpy_helper.from_array(np.zeros(shape, dtype=np_dtype)))
    y, mean, rstd = op.LayerNormalization(input, weight, bias, axis=-len(shape), epsilon=eps, stash_type=1)
    # The statistics carry no gradient in eager (native_layer_norm's backward reads only y's), and
    # ORT's LayerNormalization gradient reads none for them either: as graph outputs, its builder
    # found no gradient to yield for them and failed. Stop-gradient, as eager (a model's graph reads
    # them nowhere, and the cleanup drops the markers).
    stop = _stop_gradient_op()
    return y, stop(mean), stop(rstd)


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return _native_layer_norm(input, normalized_shape, weight, bias, eps)[0]


# Ops torch.export leaves in its (training) graph that torchlib has no translation for: the exporter
# decomposes them with ``run_decompositions``, which retraces the whole graph with symbolic shapes
# (seconds, most of the dynamo export). Translating the few that HF models use here lets ortwrap
# skip that retrace (``dynamo_translate.dynamo_to_onnx(decompose=False)``).


def _cast_or_identity(x, dtype):
    """``x`` (a real tensor: complex inputs go to torchlib's complex translations) cast to ``dtype``;
    to a complex dtype, torchlib's form of complex values: ``[..., (x, 0)]`` (ONNX Runtime has no
    complex tensors: a complex ``Cast`` failed the session)."""
    import numpy as np
    import onnx
    from onnxscript import opset18 as op

    if dtype is None or dtype == -1:
        return op.Identity(x)
    code = int(getattr(dtype, "value", dtype))
    parts = {onnx.TensorProto.COMPLEX64: onnx.TensorProto.FLOAT, onnx.TensorProto.COMPLEX128: onnx.TensorProto.DOUBLE}
    if code in parts:
        real = op.Unsqueeze(op.Cast(x, to=parts[code]), op.Constant(value_ints=[-1]))
        zero = op.Constant(
            value=onnx.numpy_helper.from_array(np.zeros((), onnx.helper.tensor_dtype_to_np_dtype(parts[code])))
        )
        return op.Concat(real, op.Expand(zero, op.Shape(real)), axis=-1)
    return op.Cast(x, to=dtype)


def _chalf(self, memory_format=None):
    """``aten.chalf`` (``Tensor.chalf()``) of a real tensor: torchlib has no complex32 (its ``_to_copy``
    raised KeyError). torchlib's form of a complex32 value: ``[..., (x, 0)]`` in float16."""
    import numpy as np
    import onnx
    from onnxscript import opset18 as op

    real = op.Unsqueeze(op.Cast(self, to=onnx.TensorProto.FLOAT16), op.Constant(value_ints=[-1]))
    zero = op.Constant(value=onnx.numpy_helper.from_array(np.zeros((), np.float16)))
    return op.Concat(real, op.Expand(zero, op.Shape(real)), axis=-1)


def _to_dtype(self, dtype, non_blocking=False, copy=False, memory_format=None):
    return _cast_or_identity(self, dtype)


def _to_dtype_layout(
    self, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, copy=False, memory_format=None
):
    return _cast_or_identity(self, dtype)


def _to_device(self, device, dtype, non_blocking=False, copy=False, memory_format=None):
    return _cast_or_identity(self, dtype)


def _bitwise_and(self, other):
    from onnxscript import opset18 as op

    if self.dtype == 9:  # bool (the dtype of an onnxscript value is an ir.DataType, ONNX's numbering)
        return op.And(self, other)
    return op.BitwiseAnd(self, other)


def _min_other(self, other):
    """``torch.min(a, b)`` (elementwise; T5's relative position buckets): torchlib has none."""
    from onnxscript import opset18 as op

    return op.Min(self, other)


def _max_other(self, other):
    from onnxscript import opset18 as op

    return op.Max(self, other)


def _diff(self, n=1, dim=-1, prepend=None, append=None):
    from onnxscript import opset18 as op

    if n != 1 or prepend is not None or append is not None:
        raise NotImplementedError("ortwrap translates diff(n=1) without prepend/append only")
    axis = op.Constant(value_ints=[dim])
    head = op.Slice(self, op.Constant(value_ints=[1]), op.Constant(value_ints=[2**62]), axis)
    tail = op.Slice(self, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]), axis)
    if self.dtype == 9:
        return op.Xor(head, tail)
    return op.Sub(head, tail)


def _squeeze_axes(self, dims) -> list[int] | None:
    """The dims of ``dims`` that are 1 in ``self``'s static shape; None if the rank is unknown.

    torchlib writes ``squeeze(dim)`` as ``Squeeze(axes=[dim])``, which fails (ORT) where torch's is a
    no-op: a dim that is not 1. A symbolic dim is not 1 either: torch.export specializes dims of
    size 0 and 1 and assumes the others are at least 2."""
    shape = self.shape
    if shape is None:
        return None
    rank = len(shape)
    out = []
    for d in dims:
        d = d % rank if rank else 0
        if rank and isinstance(shape[d], int) and shape[d] == 1 and d not in out:
            out.append(d)
    return out


def _squeeze_dims(self, dim):
    from onnxscript import opset18 as op

    axes = _squeeze_axes(self, list(dim))
    if axes is None:
        return op.Squeeze(self, op.Constant(value_ints=list(dim)))
    if not axes:
        return op.Identity(self)
    return op.Squeeze(self, op.Constant(value_ints=sorted(axes)))


def _squeeze_dim(self, dim):
    return _squeeze_dims(self, [dim])


def _softmax_in(onnx_op: str):
    """``softmax(x, dim, dtype)``/``log_softmax``: eager casts the input to ``dtype`` first; torchlib
    casts the result (so the op ran in the input's dtype: a float64 SoftmaxGrad, which ORT's CPU
    provider lacks, and different numbers)."""

    def translate(self, dim, dtype=None, half_to_float=False):
        from onnxscript import opset18 as op

        if dtype is not None and dtype != -1:
            self = op.Cast(self, to=dtype)
        if self.shape is not None and len(self.shape) == 0:
            axes = op.Constant(value_ints=[0])
            return op.Squeeze(getattr(op, onnx_op)(op.Unsqueeze(self, axes), axis=0), axes)
        return getattr(op, onnx_op)(self, axis=dim)

    return translate


def _instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn_enabled):
    """``aten.instance_norm`` as eager computes it, running-statistics update included."""
    dims = list(range(2, input.dim()))
    if running_mean is not None and running_var is not None and use_input_stats:
        with torch.no_grad():
            x = input.detach()
            running_mean.copy_(running_mean * (1 - momentum) + x.mean(dims).mean(0) * momentum)
            running_var.copy_(running_var * (1 - momentum) + x.var(dims, correction=1).mean(0) * momentum)
    if use_input_stats or running_mean is None or running_var is None:
        mean = input.mean(dims, keepdim=True)
        var = input.var(dims, correction=0, keepdim=True)
    else:  # eval with running statistics
        shape = [1, -1] + [1] * len(dims)
        mean, var = running_mean.reshape(shape), running_var.reshape(shape)
    out = (input - mean) * torch.rsqrt(var + eps)
    shape = [1, -1] + [1] * len(dims)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out


def _instance_norm_updates_stats(node) -> bool:
    args = list(node.args) + [None] * 9
    return args[3] is not None and args[4] is not None and args[5] is True


def number_operands_as_tensors(program: torch.export.ExportedProgram) -> int:
    """Give each op whose ``Tensor`` argument the capture recorded as a Python number a 0-d tensor there,
    where the number is its first argument or its result is complex.

    ``torch.add(0.3333, mask, alpha=0.6667)`` (PhiMoE's router) is captured as
    ``aten.add.Tensor(0.3333, mask)``: the exporter's type promotion pass re-runs such a node and
    finds no overload for a float ``self``. ``freqs_cis * 1.0`` (DeepSeek-V2's rotary table) is
    ``aten.mul.Tensor(complex, 1.0)``, and torchlib's complex ``mul`` slices both operands into real
    and imaginary parts: a number has none. The number becomes ``aten.scalar_tensor`` of the dtype
    eager computes in (the node's result dtype; where the result is bool, the number's own kind at
    full precision). Returns how many arguments were rewritten.
    """
    graph = program.graph_module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not compat.is_op_overload(node.target):
            continue
        schema = compat.op_schema(node.target)
        out = node.meta.get("val")
        is_complex = isinstance(out, torch.Tensor) and out.is_complex()
        for i, (arg, value) in enumerate(zip(schema.arguments, node.args)):
            if str(arg.type) != "Tensor" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if i > 0 and not is_complex:
                continue  # (the type promotion pass takes a number there)
            if isinstance(out, torch.Tensor) and out.dtype != torch.bool:
                dtype = out.dtype
            else:
                dtype = torch.int64 if isinstance(value, int) else torch.float64
            with graph.inserting_before(node):
                number = graph.call_function(torch.ops.aten.scalar_tensor.default, (value,), {"dtype": dtype})
            fake_mode = getattr(out, "fake_mode", None)
            if fake_mode is not None:  # (a node without it is run again by the type promotion pass)
                with fake_mode:
                    number.meta["val"] = torch.ops.aten.scalar_tensor.default(value, dtype=dtype)
            node.update_arg(i, number)
            count += 1
    if count:
        program.graph_module.recompile()
    return count


# Complex values: torchlib writes a complex tensor as a real one with a trailing dim of 2 (real,
# imaginary), and dispatches a node with a complex input only to translations marked complex.
# These are ops it has none for (DeepSeek-V2's rotary embedding: ``polar(...).unsqueeze(1)``).


def _complex(fn):
    fn.complex_values = True
    return fn


@_complex
def _unsqueeze_complex(self, dim):
    from onnxscript import opset18 as op

    if dim < 0:
        dim -= 1  # past the trailing (real, imaginary) dim
    return op.Unsqueeze(self, op.Constant(value_ints=[dim]))


#: the axes ``atleast_{1,2,3}d`` adds to a tensor of each lower rank (torch's: 1-D ``(n,)`` -> ``(1, n)``
#: in 2-D, ``(1, n, 1)`` in 3-D; 2-D ``(m, n)`` -> ``(m, n, 1)``)
_ATLEAST_AXES = {1: {0: [0]}, 2: {0: [0, 1], 1: [0]}, 3: {0: [0, 1, 2], 1: [0, 2], 2: [2]}}


def _atleast_sequence(n: int):
    """``aten.atleast_{n}d.Sequence``: one value per tensor, by its static rank. torchlib writes a
    ``SequenceMap`` over a ``SequenceConstruct`` with an ``If`` on the rank inside, which ORT 1.19.2
    cannot differentiate (refused: hstack, vstack, dstack, column_stack)."""

    def translate(tensors):
        from onnxscript import opset18 as op

        out = []
        for t in tensors:
            axes = _ATLEAST_AXES[n].get(len(t.shape))
            out.append(op.Identity(t) if axes is None else op.Unsqueeze(t, op.Constant(value_ints=axes)))
        return tuple(out)

    return translate


#: ATen ops the dynamo path always writes as ATen nodes (the module docstring).
TRAINING_ATEN_OPS: tuple[str, ...] = (
    "scatter_reduce",
    "index_add",
    "_safe_softmax",
    "max_pool1d_with_indices",
    "max_pool2d_with_indices",
    "max_pool3d_with_indices",
    "exponential",
    "uniform",
)


def training_decompositions() -> dict:
    """``{op: (needs(node), decomposition)}``: ops the dynamo path decomposes before translating,
    where ``needs`` says a node of the captured graph needs it (the module docstring)."""
    return {torch.ops.aten.instance_norm.default: (_instance_norm_updates_stats, _instance_norm)}


def training_translations() -> dict:
    """The ``custom_translation_table`` entries ortwrap always passes to the dynamo exporter."""
    from .grouped_mm import grouped_mm_ops, grouped_mm_translation

    table = {}
    aten = torch.ops.aten
    table[compat.batch_norm_functional_op().default] = _batch_norm_functional
    table[aten.native_batch_norm.default] = _native_batch_norm
    table[aten._native_batch_norm_legit_no_training.default] = _native_batch_norm_no_training
    table[aten.embedding.default] = _embedding
    table[aten.cross_entropy_loss.default] = _cross_entropy
    table[aten.gelu.default] = _gelu
    table[aten.native_layer_norm.default] = _native_layer_norm
    table[aten.layer_norm.default] = _layer_norm
    table[aten.to.dtype] = _to_dtype
    table[aten.scalar_tensor.default] = _scalar_tensor
    table[aten.to.dtype_layout] = _to_dtype_layout
    table[aten.to.device] = _to_device
    table[aten.__and__.Tensor] = _bitwise_and
    table[aten.detach.default] = _detach
    table[aten.detach_.default] = _detach
    table[aten.diff.default] = _diff
    table[aten.unsafe_chunk.default] = _unsafe_chunk
    table[aten.squeeze.dim] = _squeeze_dim
    table[aten.squeeze.dims] = _squeeze_dims
    table[aten.min.other] = _min_other
    for op in grouped_mm_ops():
        table[op] = grouped_mm_translation
    table[aten.max.other] = _max_other
    table[aten.unsqueeze.default] = _unsqueeze_complex
    table[aten.chalf.default] = _chalf
    table[aten.atleast_1d.Sequence] = _atleast_sequence(1)
    table[aten.atleast_2d.Sequence] = _atleast_sequence(2)
    table[aten.atleast_3d.Sequence] = _atleast_sequence(3)
    table[aten.softmax.int] = _softmax_in("Softmax")
    table[aten.log_softmax.int] = _softmax_in("LogSoftmax")
    return table
