"""FFT layers train on ORT with eager's numbers (issue 24: the FFT family under the dynamo exporter).

ORT 1.19.2 has no gradient for ``DFT``, its shape inference refuses torchlib's inverse one-sided
``DFT`` (``irfft``, ``hfft``), and the exporter's decompositions pad and conjugate complex values
that torchlib cannot translate. Under dynamo the FFT ops run as ATen nodes (PyTorch's kernel and
autograd), their complex values in torchlib's real ``[..., 2]`` form. The TorchScript exporter keeps
complex values, which ORT cannot hold, and writes the FFTs and every op on their complex results as
ATen nodes: its type inference carries those values in the same real form (``export/type_inference.py``);
its ``stft`` symbolic (ONNX STFT, no ORT gradient) is replaced by an ATen node.
"""

from __future__ import annotations

import pytest
import torch
from parity import check_parity, tensor_leaves
from torch import nn

from ortwrap import ORTWrap
from ortwrap.errors import PassError

pytestmark = pytest.mark.usefixtures("exporter")

N = 16


def _loss(out) -> torch.Tensor:
    """Every output, complex ones through their real view, with position-dependent weights."""
    total = 0.0
    for i, t in enumerate(tensor_leaves(out)):
        v = torch.view_as_real(t) if t.is_complex() else t
        w = torch.linspace(-1.0, 1.0 + i, v.numel(), dtype=v.dtype).reshape(v.shape)
        total = total + (v * w).sum() + 0.1 * (v * v).sum()
    return total


class SpectralFilter(nn.Module):
    """A learned spectral filter (FNO/GFNet-style): rfft -> times a learned complex weight -> irfft,
    plus an fft2 magnitude and a complex output (fft of the input)."""

    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(N, N)
        self.weight = nn.Parameter(torch.randn(channels, N // 2 + 1, 2))

    def forward(self, x: torch.Tensor):
        f = torch.fft.rfft(self.proj(x), dim=-1, norm="ortho")
        y = torch.fft.irfft(f * torch.view_as_complex(self.weight), n=N, dim=-1)
        mag = torch.fft.fft2(y, s=(4, N + 2)).abs()  # s pads the last dim and crops the channels
        return y + torch.fft.hfft(f[..., :5], n=N), mag, torch.fft.ihfftn(x, dim=(-2, -1))


class Spectrogram(nn.Module):
    """``stft`` with a learned window, whose gradient comes back through the ATen node."""

    def __init__(self) -> None:
        super().__init__()
        self.window = nn.Parameter(torch.hann_window(8) + 0.1 * torch.randn(8))

    def forward(self, x: torch.Tensor):
        s = torch.stft(x, n_fft=8, hop_length=2, window=self.window, return_complex=True)
        return s.abs().sum(-1), s


class RealSpectrogram(nn.Module):
    """``stft(return_complex=False)``: the TorchScript exporter's symbolic wrote ONNX STFT (no ORT gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(40, 40)

    def forward(self, x: torch.Tensor):
        return torch.stft(self.proj(x), n_fft=10, hop_length=3, return_complex=False)


class ComplexInput(nn.Module):
    """A complex signal fed in its real form: under TorchScript every input dim is dynamic, and
    ``view_as_complex`` needs the last to be 2 (type inference evaluates it at the example's sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(N, 2))

    def forward(self, x: torch.Tensor):
        z = torch.view_as_complex(x) * torch.view_as_complex(self.scale)
        return torch.view_as_real(torch.fft.fft(z, norm="forward") * z)


def _inputs(shape):
    def make(b: int, g: torch.Generator):
        return (torch.randn(b, *shape, generator=g).requires_grad_(),), {}

    return make


#: name -> (model, input shape without the batch)
MODELS = {
    "spectral_filter": (SpectralFilter, (3, N)),
    "stft": (Spectrogram, (40,)),
    "stft_real": (RealSpectrogram, (40,)),
    "complex_input": (ComplexInput, (N, 2)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_fft_modules_train_like_eager(name, exporter):
    make_model, shape = MODELS[name]
    # outputs (complex ones included), every parameter's and the input's gradient, three steps with
    # changing batch sizes
    check_parity(make_model, _inputs(shape), loss_fn=_loss, lr=0.002)


class InverseOfReal(nn.Module):
    def forward(self, x: torch.Tensor):
        return torch.fft.ifft(x * 2.0, norm="ortho")  # of a real tensor: eager returns a lazy conjugate


def test_complex_output_that_is_a_lazy_conjugate(exporter):
    """The output's real view is taken of the resolved conjugate (``view_as_real`` refuses a lazy one)."""
    x = torch.randn(3, 8, requires_grad=True)
    x_o = x.detach().clone().requires_grad_()
    expected = InverseOfReal()(x)
    got = ORTWrap(InverseOfReal(), fallback=False, exporter=exporter)(x_o)
    torch.testing.assert_close(got, expected.resolve_conj())
    w = torch.rand(*expected.shape, 2)
    (torch.view_as_real(expected.resolve_conj()) * w).sum().backward()
    (torch.view_as_real(got.resolve_conj()) * w).sum().backward()
    torch.testing.assert_close(x_o.grad, x.grad)


class ComplexConcat(nn.Module):
    def forward(self, x: torch.Tensor):
        return torch.view_as_real(torch.cat([torch.fft.fft(x), torch.fft.fft(2.0 * x)]))


def test_complex_value_into_an_onnx_op_is_refused(exporter):
    """Under TorchScript, ``cat`` of complex values is an ONNX SequenceConstruct, which would take the
    real [..., 2] pairs as real numbers: refused by name, not trained (dynamo's torchlib writes it exactly)."""
    x = torch.randn(3, 8)
    wrapped = ORTWrap(ComplexConcat(), fallback=False, exporter=exporter)
    if exporter == "torchscript":
        with pytest.raises(PassError, match=r"ATen op fft_fft makes a complex tensor.*ONNX op SequenceConstruct"):
            wrapped(x)
        return
    torch.testing.assert_close(wrapped(x), ComplexConcat()(x))
