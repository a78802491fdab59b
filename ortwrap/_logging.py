"""The ``ortwrap`` logger."""

from __future__ import annotations

import logging

logger = logging.getLogger("ortwrap")


def configure(level: int) -> None:
    """Set the ortwrap logger's level and give it a stderr handler if it has none."""
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ortwrap %(levelname)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
