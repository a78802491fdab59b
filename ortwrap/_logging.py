"""The ``ortwrap`` logger, and ``ortwrap.progress`` for long builds' progress lines."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("ortwrap")
#: Progress lines of long builds: shown at the default WARNING level (a child logger with its own
#: level; its records reach the ``ortwrap`` handler), silenced from ``log_level="ERROR"`` on.
progress = logging.getLogger("ortwrap.progress")


def configure(level: int) -> None:
    """Set the ortwrap logger's level and give it a stderr handler if it has none."""
    logger.setLevel(level)
    progress.setLevel(logging.INFO if level <= logging.WARNING else level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ortwrap %(levelname)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _internal(filename: str) -> bool:
    """A frame of ortwrap's or of the machinery between the user's call and ortwrap's forward
    (``nn.Module.__call__``, contextlib)."""
    f = filename.replace("\\", "/")
    return (
        filename.startswith(_OWN_DIR)
        or f.endswith("/torch/nn/modules/module.py")
        or f.endswith("/contextlib.py")
        or "/torch/_dynamo/" in f
    )


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by this function's caller that points at the
    user's line: the first frame outside ortwrap and ``nn.Module``'s call machinery, whatever path
    (forward, an integration, a method of the module) led there."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    return level
