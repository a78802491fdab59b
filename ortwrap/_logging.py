"""The ``ortwrap`` logger, and ``ortwrap.progress`` for long builds' progress lines."""

from __future__ import annotations

import logging

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
