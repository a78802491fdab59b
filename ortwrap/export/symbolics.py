"""Custom TorchScript symbolics, registered only while ortwrap exports.

``ortwrap_symbolics`` registers them on entry and restores whatever was registered before on exit,
so a user's own ``torch.onnx.export`` calls are unaffected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_SYMBOLICS: dict[str, object] = {}


@contextlib.contextmanager
def ortwrap_symbolics(opset: int) -> Iterator[None]:
    """Register ortwrap's symbolics for the duration of one export."""
    from torch.onnx import register_custom_op_symbolic, unregister_custom_op_symbolic

    registered = []
    try:
        for name, fn in _SYMBOLICS.items():
            register_custom_op_symbolic(name, fn, opset)
            registered.append(name)
        yield
    finally:
        for name in registered:
            unregister_custom_op_symbolic(name, opset)
