"""ortwrap as a user installs it: a wheel or an sdist, not editable, in a fresh venv.

``make test-wheel`` (tests/installed/run.sh) installs each into its own venv and runs this file there,
copied to a directory outside the checkout, with ``CC`` naming no compiler and an empty
``ORTWRAP_CACHE_DIR``: the core path must need no C compiler (the PythonOp runners and the ATen
executor are the install's prebuilt extension modules), and the CPU kernels, which are compiled on
first use, fall back to ONNX Runtime's own with one warning. The C++ compiler stays: the CPU region
(``cpu_region``) compiles from the installed source against the installed torch. Skipped elsewhere
(``make test``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import shutil
import sys
import sysconfig
import warnings

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(
    os.environ.get("ORTWRAP_TEST_INSTALLED") != "1", reason="runs against an installed wheel: make test-wheel"
)

SITE = sysconfig.get_paths()["platlib"]


def test_imported_from_the_install_not_the_checkout():
    import ortwrap

    assert os.path.dirname(ortwrap.__file__) == os.path.join(SITE, "ortwrap"), ortwrap.__file__
    assert not [f for f in os.listdir(SITE) if f.startswith("__editable__") and "ortwrap" in f]
    assert ortwrap.__version__ == importlib.metadata.version("ortwrap")
    dist = importlib.metadata.distribution("ortwrap")
    assert dist.metadata["License-Expression"] == "MIT"
    files = {str(f) for f in dist.files}
    for f in (
        "ortwrap/py.typed",
        "ortwrap/kernels/_cpu.c",
        "ortwrap/bridge/_dlpack.h",
        "ortwrap/_compat/_cpu_region.cpp",
    ):
        assert f in files, f
    assert any(f.endswith("licenses/LICENSE") for f in files), files


class ScaledTanh(torch.autograd.Function):
    """y = x * tanh(w), with a hand-written backward (runs as a PythonOp inside ORT)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * torch.tanh(w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        t = torch.tanh(w)
        return grad * t, (grad * x * (1 - t * t)).sum(0)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.act = nn.GELU()
        self.w = nn.Parameter(torch.randn(16))
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(ScaledTanh.apply(self.act(self.norm(self.fc1(x))), self.w))


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5), f"{what}: {a} != eager {b}"


def _train(exporter: str) -> set[str]:
    """Three SGD steps eagerly and through ORTWrap; outputs and every gradient must agree.
    Returns the op types of the built ORT graph."""
    from ortwrap import ORTWrap

    torch.manual_seed(0)
    eager = Net()
    ours = Net()
    ours.load_state_dict(eager.state_dict())
    wrapped = ORTWrap(ours, fallback=False, exporter=exporter)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_o = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    for step, batch in enumerate((5, 7, 5)):
        x = torch.randn(batch, 6) * 3
        target = torch.randn(batch, 3)
        out_e, out_o = eager(x), wrapped(x)
        _close(out_o, out_e, f"step {step} output")
        ((out_e - target) ** 2).mean().backward()
        ((out_o - target) ** 2).mean().backward()
        for (name, p_o), (_, p_e) in zip(ours.named_parameters(), eager.named_parameters(), strict=True):
            assert p_o.grad is not None, f"step {step}: {name}.grad is None"
            _close(p_o.grad, p_e.grad, f"step {step} grad of {name}")
        for opt in (opt_e, opt_o):
            opt.step()
            opt.zero_grad()
    return {n.op_type for n in wrapped.last_artifacts.graph.model().graph.node}


def test_trains_on_ort_like_eager_with_no_compiler():
    cc = os.environ.get("CC")
    assert cc and shutil.which(cc) is None, "run with CC naming no compiler (tests/installed/run.sh does)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for exporter in ("torchscript", "dynamo"):
            ops = _train(exporter)
            assert "PythonOp" in ops and "PythonOpGrad" in ops, (exporter, ops)  # the Function ran inside ORT
            assert "LayerNormalizationGrad" in ops, (exporter, ops)  # ORT's own kernels: no compiler here
    from ortwrap import FallbackWarning
    from ortwrap.bridge import _native

    assert not [w for w in caught if issubclass(w.category, FallbackWarning)]
    kernel_warnings = [str(w.message) for w in caught if "native CPU kernels could not be built" in str(w.message)]
    assert len(kernel_warnings) == 1, [str(w.message) for w in caught]
    (message,) = kernel_warnings
    assert f"CC={cc}" in message and sys.prefix in message and "apt-get install gcc" in message, message
    # Nothing was compiled: the runners and the ATen executor (which this model did not need: load it)
    # are the install's extension modules.
    from ortwrap.bridge import aten

    aten.install()
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for name in ("_runner", "_aten"):
        assert _native.LOADED[name] == os.path.join(SITE, "ortwrap", "bridge", name + suffix), _native.LOADED
    assert "_cpu" not in _native.LOADED
    # The one C++ helper (the CPU region, optional: a warning without a C++ compiler) was compiled
    # from the installed source against the installed torch's headers; nothing else was.
    from ortwrap.runtime import cpu_region

    assert cpu_region.library() is not None, [str(w.message) for w in caught]
    assert _native.LOADED["_cpu_region"].startswith(os.environ["ORTWRAP_CACHE_DIR"]), _native.LOADED
    cache = os.environ["ORTWRAP_CACHE_DIR"]
    assert [f for f in os.listdir(cache) if f.endswith(".so") and not f.startswith("_cpu_region-")] == []
