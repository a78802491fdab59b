"""Decompositions the AOTAutograd trace applies on top of torch.export's default (core ATen) set:
backward ops that stay whole there and that torchlib cannot translate to ONNX.

``aten.convolution_backward`` (core ATen keeps it; ONNX has no ConvGrad): the input's gradient is a
transposed convolution of the output's gradient, the weight's gradient a convolution of the input
(batch and channels swapped) with the output's gradient, group by group; a transposed convolution's backward is the same with the roles of its
input and its output's gradient swapped. Shapes are static here (the engine builds per shape
signature), so the transposed convolution's output padding is a number.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def convolution_backward(
    grad_out, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    nd = weight.dim() - 2
    stride, padding, dilation = (list(v) * nd if len(v) == 1 else list(v) for v in (stride, padding, dilation))
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            # y = conv_transpose(x, w) is the input's gradient of a convolution by w: x's gradient is that
            # convolution of y's gradient (its output size is x's; output_padding's extra rows are not read)
            grad_input = aten.convolution(grad_out, weight, None, stride, padding, dilation, False, [0] * nd, groups)
        elif any(isinstance(input.shape[2 + i], torch.SymInt) for i in range(nd)):
            grad_input = _input_grad_symbolic(grad_out, weight, stride, padding, dilation, groups, input.shape, nd)
        else:
            extra = [
                input.shape[2 + i]
                - (
                    (grad_out.shape[2 + i] - 1) * stride[i]
                    - 2 * padding[i]
                    + dilation[i] * (weight.shape[2 + i] - 1)
                    + 1
                )
                for i in range(nd)
            ]
            grad_input = aten.convolution(grad_out, weight, None, stride, padding, dilation, True, extra, groups)
    if output_mask[1]:
        # transposed: w is the weight of the convolution from y to x, so its gradient is that convolution's
        # weight gradient with the roles of x and y's gradient swapped
        x, go = (grad_out, input) if transposed else (input, grad_out)
        cin = x.shape[1] // groups
        cout = go.shape[1] // groups
        parts = []
        for g in range(groups):
            xg = x[:, g * cin : (g + 1) * cin] if groups > 1 else x
            gg = go[:, g * cout : (g + 1) * cout] if groups > 1 else go
            # [Cin, N, ...] * [Cout, N, ...] -> [Cin, Cout, ...]: the batch is the reduction
            w = aten.convolution(
                xg.transpose(0, 1), gg.transpose(0, 1), None, dilation, padding, stride, False, [0] * nd, 1
            ).transpose(0, 1)
            for i in range(nd):
                w = w.narrow(2 + i, 0, weight.shape[2 + i])
            parts.append(w)
        grad_weight = torch.cat(parts, 0) if groups > 1 else parts[0]
        grad_weight = grad_weight.contiguous()
    if output_mask[2]:
        grad_bias = grad_out.sum([0, *range(2, grad_out.dim())])
    return grad_input, grad_weight, grad_bias


def _input_grad_symbolic(grad_out, weight, stride, padding, dilation, groups, size, nd):
    """A convolution's input gradient when the input's sizes are symbolic (the engine's dynamic builds):
    the output padding would be a computed size, which ONNX's ConvTranspose takes only as a number. So the
    full transposed convolution (no padding), padded at the end by ``stride - 1`` (the input reaches at
    most that far past it), then the input's window cut out (``padding`` on, ``size`` long)."""
    full = aten.convolution(grad_out, weight, None, stride, [0] * nd, dilation, True, [0] * nd, groups)
    pads = [p for i in reversed(range(nd)) for p in (0, stride[i] - 1)]
    if any(pads):
        full = aten.constant_pad_nd(full, pads, 0.0)
    for i in range(nd):
        full = aten.slice(full, 2 + i, padding[i], padding[i] + size[2 + i])
    return full


def copy(self, src, non_blocking=False):
    """``aten.copy`` (a functionalized ``x[:, 0] = 2``: a 0-d constant copied into a slice) broadcasts
    ``src`` to ``self``'s shape; torchlib's translation is ``CastLike(src, self)``, which does not (BART's
    and T5's ``shift_tokens_right`` built a session that ORT refused, or a wrong shape)."""
    out = src if src.dtype == self.dtype else aten._to_copy.default(src, dtype=self.dtype)
    if tuple(out.shape) != tuple(self.shape):
        out = aten.expand.default(out, list(self.shape))
    return aten.clone.default(out)


def weight_norm_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    """``aten._weight_norm_interface_backward`` (torch has no decomposition of it): ``w = v * g / |v|``
    with the norm over every dim but ``dim``."""
    dims = [d for d in range(saved_v.dim()) if d != dim % saved_v.dim()]
    norms = saved_norms.reshape(saved_g.shape)
    grad_g = (grad_w * saved_v).sum(dims, keepdim=True) / norms
    grad_v = (saved_g / norms) * (grad_w - saved_v * (grad_g / norms))
    return grad_v, grad_g


def empty_permuted(size, physical_layout, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten.empty_permuted`` (torch's ``empty_like`` decomposition writes it: Mixtral's and
    Qwen2-MoE's routing) has no translation; the layout is only strides, which ONNX does not have."""
    return aten.empty.memory_format(list(size), dtype=dtype, device=device)


def var_mean(x, dim=None, *, correction=None, keepdim=False):
    """``aten.var_mean.correction`` (batch norm's decomposition computes its statistics with it) as a
    mean and a sum of squared deviations: torchlib translates neither it nor ``aten.var``, so the
    graph split ran it in PyTorch between ORT segments (shapes are static: the count is a number)."""
    dims = list(range(x.dim())) if dim is None else [d % max(x.dim(), 1) for d in dim]
    count = 1
    for d in dims:
        count *= x.shape[d]
    mean = aten.mean.dim(x, dims, True)
    deviation = aten.sub.Tensor(x, mean)
    squares = aten.sum.dim_IntList(aten.mul.Tensor(deviation, deviation), dims, keepdim)
    var = aten.div.Tensor(squares, max(count - (1 if correction is None else correction), 0))
    return var, mean if keepdim else aten.squeeze.dims(mean, dims)


def engine_decompositions() -> dict:
    """op -> decomposition, for the AOTAutograd trace (added to torch.export's defaults).

    Also torch's own decompositions of training-mode batch norm: translated whole, ONNX's
    BatchNormalization(training_mode=1) gives no saved mean and inverse deviation, and torchlib's
    translation computed them wrong on onnxruntime (tests/test_engine_onnxruntime.py, the CNN). And
    weight norm's (``_weight_norm_interface``, wav2vec2's positional convolution) with its backward.
    """
    from ..._compat import torch as compat

    table = compat.decompositions_of(
        [aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.default,
         aten._native_batch_norm_legit.no_stats, aten.native_batch_norm.default,
         aten._weight_norm_interface.default]
    )  # fmt: skip
    return {
        **table,
        aten.convolution_backward.default: convolution_backward,
        aten.copy.default: copy,
        aten.var_mean.correction: var_mean,
        aten.empty_permuted.default: empty_permuted,
        aten._weight_norm_interface_backward.default: weight_norm_backward,
    }
