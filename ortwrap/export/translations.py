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
``aten.embedding`` with ``padding_idx``                 a plain ``Gather``, whose gradient reaches
                                                        the padding row. ortwrap emits the
                                                        TorchScript path's form: padding positions
                                                        read a stop-gradient copy of the weight.
``aten.cross_entropy_loss`` with ``label_smoothing``    ignores the smoothing (a wrong loss).
                                                        ortwrap adds the smoothing term, as its
                                                        TorchScript symbolic does.
``aten.gelu``                                           ONNX ``Gelu`` (opset 20), whose ORT 1.19.2
                                                        gradient ignores ``approximate="tanh"``.
                                                        ortwrap writes both forms out in elementwise
                                                        ops, as the TorchScript exporter does (ORT
                                                        fuses the erf form back into ``Gelu``).
``aten.native_layer_norm`` without weight               ``LayerNormalization`` without its scale
                                                        input, on which ORT's gradient builder
                                                        fails. ortwrap passes a constant scale of 1
                                                        (and bias of 0).
======================================================  ===========================================
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
    else:
        y = op.BatchNormalization(input, weight, bias, running_mean, running_var, epsilon=eps, momentum=1.0 - momentum)
        new_mean, new_var = running_mean, running_var
    # Outputs 1 and 2 (saved mean / inverse std) serve ATen's backward only: nothing in the forward
    # graph reads them. Outputs 3 and 4 mirror the TorchScript exporter's form, Identity of the
    # running-stat inputs; BatchNormRunningStatsPass rewires them to the node's updated statistics.
    del new_mean, new_var
    return y, op.Identity(running_mean), op.Identity(running_var), op.Identity(running_mean), op.Identity(running_var)


_STOP_GRADIENT_SCHEMA = False


def _stop_gradient_op():
    """``ortwrap::StopGradient`` (resolved by ``passes/stop_gradient.py``), callable from onnxscript."""
    global _STOP_GRADIENT_SCHEMA
    import onnx
    import onnxscript

    from .symbolics import ORTWRAP_DOMAIN

    if not _STOP_GRADIENT_SCHEMA:
        param = onnx.defs.OpSchema.FormalParameter
        schema = onnx.defs.OpSchema(
            "StopGradient",
            ORTWRAP_DOMAIN,
            1,
            inputs=[param("input", "T")],
            outputs=[param("output", "T")],
            type_constraints=[("T", ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"], "")],
        )
        try:
            onnx.defs.register_schema(schema)
        except Exception:  # already registered in this process
            pass
        _STOP_GRADIENT_SCHEMA = True
    return onnxscript.values.Opset(ORTWRAP_DOMAIN, 1).StopGradient


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
    inputs = [logits, target] + ([weight] if weight is not None else [])
    loss, _log_prob = op.SoftmaxCrossEntropyLoss(*inputs, reduction=mode, ignore_index=ignore_index)
    if not label_smoothing:
        return loss
    if weight is not None:
        raise NotImplementedError("ortwrap: cross_entropy with both class weights and label_smoothing")
    # torch: (1 - eps) * nll + eps / C * sum_c(-log p_c), zero at ignored targets, reduced like nll.
    dtype = logits.dtype

    def const(v: float):
        return op.Cast(op.Constant(value_float=v), to=dtype)

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


def _gelu(x, approximate="none"):
    from onnxscript import opset18 as op

    dtype = x.dtype

    def const(v: float):
        return op.Cast(op.Constant(value_float=v), to=dtype)

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
    return y, mean, rstd


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return _native_layer_norm(input, normalized_shape, weight, bias, eps)[0]


def training_translations() -> dict:
    """The ``custom_translation_table`` entries ortwrap always passes to the dynamo exporter."""
    table = {}
    aten = torch.ops.aten
    table[compat.batch_norm_functional_op().default] = _batch_norm_functional
    table[aten.embedding.default] = _embedding
    table[aten.cross_entropy_loss.default] = _cross_entropy
    table[aten.gelu.default] = _gelu
    table[aten.native_layer_norm.default] = _native_layer_norm
    table[aten.layer_norm.default] = _layer_norm
    return table
