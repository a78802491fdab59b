"""Complex values through ops that take a TorchScript ``prim::Constant`` (a device: ``.to(x.device)``,
``fftfreq(..., device=...)``) or a dtype, then complex math, against eager (both exporters).

Under TorchScript complex values travel as real ``[..., 2]`` pairs between ATen nodes, which type
inference marks (``export/type_inference.py``). It ignored ``prim::Constant`` values: an ATen node
taking one was never evaluated, nor anything after it, so a later node taking a complex value stayed
unmarked (ORT then refused the untyped value with an unrelated message, and in an inference graph
the node would have computed on the pairs as on reals). Each case here either trains with eager's
numbers or is refused at build, naming the op and why.
"""

from __future__ import annotations

import pytest
import torch
from test_op_fixes import Fn, check, randn

from ortwrap import ORTWrap
from ortwrap.errors import ORTWrapError

pytestmark = pytest.mark.usefixtures("exporter")


def _fft(x):
    return torch.fft.fft(x, norm="ortho")


def _polar(x, y):
    return torch.polar(x.abs() + 0.5, y)


def _pairs(x, y):
    return torch.view_as_complex(torch.stack([x, y], -1).to(x.device))


#: name -> (function, what it is refused with and by which exporters, or None where it trains)
CASES = {
    "fft_norm_times_fft": (lambda x, y: torch.view_as_real(_fft(x) * _fft(y)), None),
    "fft_norm_abs": (lambda x, y: (_fft(x) * _fft(y)).abs(), None),
    "fft_norm_ifft": (lambda x, y: torch.view_as_real(torch.fft.ifft(_fft(x) * _fft(y), norm="ortho")), None),
    "real_to_device_as_complex": (lambda x, y: torch.view_as_real(_pairs(x, y) * _polar(y, x)), None),
    "real_to_device_as_complex_exp": (lambda x, y: torch.view_as_real(torch.exp(_pairs(x, y)) * _fft(y)), None),
    # an ATen node taking a device (fft_fftfreq has no ONNX form): ORT cannot pass a Device to PyTorch
    # (dynamo: the same refusal at translation)
    "fftfreq_device_times_fft": (
        lambda x, y: torch.view_as_real(_fft(x) * torch.fft.fftfreq(x.shape[-1], device=x.device)),
        (r"fft_fftfreq.*argument 'device'", ("torchscript", "dynamo")),
    ),
    "fftfreq_device_abs": (
        lambda x, y: (_fft(x) * torch.fft.fftfreq(x.shape[-1], device=x.device) + _fft(y)).abs(),
        (r"fft_fftfreq.*argument 'device'", ("torchscript", "dynamo")),
    ),
    # ``to`` of a complex value: TorchScript names no overload, and ``to`` has several
    **{
        name: (fn, (r"ATen op to takes .*a complex value, without the overload name", ("torchscript",)))
        for name, fn in {
            "complex_to_device": lambda x, y: torch.view_as_real(_polar(x, y).to(x.device) * _polar(y, x)),
            "complex_to_str_device": lambda x, y: torch.view_as_real(_polar(x, y).to("cpu") * _polar(y, x)),
            "complex_to_dtype": lambda x, y: torch.view_as_real(_polar(x, y).to(torch.complex64) * _polar(y, x)),
            "complex_to_device_dtype": lambda x, y: (_polar(x, y).to(x.device, torch.complex64) * _fft(y)).abs(),
            "complex_cpu": lambda x, y: (_polar(x, y).cpu() * _polar(y, x)).angle(),
        }.items()
    },
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_complex_through_prim_constants(exporter, case, grad):
    fn, refused = case
    # last dim 2: a [..., 2] pair computed on as reals would broadcast against fftfreq's 2 values
    inputs = [randn(3, 2, grad=grad), randn(3, 2, seed=5, grad=grad)]
    if refused is not None and exporter in refused[1]:
        m = ORTWrap(Fn(fn), fallback=False, exporter=exporter, build_cache=False)
        with pytest.raises(ORTWrapError, match=refused[0]), torch.set_grad_enabled(grad):
            m(*inputs)
        return
    if grad:
        check(fn, inputs, exporter)
        return
    with torch.no_grad():
        got = ORTWrap(Fn(fn), fallback=False, exporter=exporter, build_cache=False)(*inputs)
        want = fn(*inputs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
