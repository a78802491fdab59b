"""Import of ONNX Runtime's training build, with one clear error when it is missing.

Never imports ``onnxruntime.training.ortmodule``: that is what ortwrap replaces, and it fails to
import on current PyTorch.
"""

from __future__ import annotations

try:
    import onnxruntime as ort
    from onnxruntime.capi import _pybind_state as C
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "ortwrap needs ONNX Runtime's training build: pip install 'ortwrap[cpu]' "
        "(onnxruntime-training-cpu==1.19.2) or 'ortwrap[cuda]' (onnxruntime-training==1.19.2). "
        "Install only one of them, and not plain onnxruntime beside it."
    ) from e

if not hasattr(C, "OrtModuleGraphBuilder"):  # pragma: no cover
    raise ImportError(
        f"the installed onnxruntime {ort.__version__} is not a training build (no OrtModuleGraphBuilder); "
        "uninstall onnxruntime and install onnxruntime-training-cpu==1.19.2 or onnxruntime-training==1.19.2"
    )

__all__ = ["C", "ort"]
