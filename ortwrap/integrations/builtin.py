"""ortwrap's own integrations, registered with the seam (``integrations/__init__.py``) in the order
their hooks run. The package imports this module; the seam, the dispatcher and ``api.py`` name none
of them, and each imports its library (DeepSpeed, torch.distributed's wrappers) lazily."""

from __future__ import annotations

from . import register
from .deepspeed import DeepSpeedZero3
from .distributed import DataParallelWrappers

register(DataParallelWrappers())
register(DeepSpeedZero3())
