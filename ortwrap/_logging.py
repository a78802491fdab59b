"""The ``ortwrap`` logger, the process-wide verbosity, and where warnings point.

ortwrap logs like a library (as torch and transformers do):

- every record goes to the ``ortwrap`` logger (``ortwrap.progress`` for a long build's progress
  lines), which propagates to the application's handlers; ortwrap never sets its level or
  ``propagate`` except through :func:`set_verbosity` (or ``ORTWRAP_LOG_LEVEL``, read once at import);
- it has a ``NullHandler``, and one handler that writes to stderr only while the application has
  configured no handler that the record would reach (the role of ``logging.lastResort``, at
  ortwrap's verbosity): a script without logging set up still sees warnings, or INFO lines after
  ``set_verbosity("INFO")``; an application with handlers gets each record once, from its own;
- under ``torch.distributed``, ranks other than 0 pass on only warnings and errors.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import warnings
from typing import Any

from .options import env_log_level, parse_log_level

__all__ = ["get_verbosity", "logger", "progress", "set_verbosity", "warn_at_user_line"]

logger = logging.getLogger("ortwrap")
#: Progress lines of long builds, at INFO (a child of ``ortwrap``: its level and handlers apply).
progress = logging.getLogger("ortwrap.progress")


class _StderrUnlessConfigured(logging.StreamHandler):
    """Writes a record to stderr only when no other handler would get it: none on the loggers
    between the record's logger and the first that does not propagate (the root included)."""

    def __init__(self) -> None:
        super().__init__()  # (stream None: sys.stderr at each write, as pytest's capsys replaces it)
        self.setFormatter(logging.Formatter("[ortwrap %(levelname)s] %(message)s"))

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ sets it
        pass

    def handle(self, record: logging.LogRecord) -> bool:
        current: logging.Logger | None = logging.getLogger(record.name)
        while current is not None:
            if any(h is not self and not isinstance(h, logging.NullHandler) for h in current.handlers):
                return False
            if not current.propagate:
                break
            current = current.parent  # type: ignore[assignment]
        return super().handle(record)


class _RankZeroInfo(logging.Filter):
    """Under ``torch.distributed``, records below WARNING pass on rank 0 only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        dist = sys.modules.get("torch.distributed")
        try:
            return not (dist is not None and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)
        except Exception:  # (a process group being torn down)
            return True


if not getattr(logger, "_ortwrap_handlers", False):  # (once per process, whatever reloads ortwrap)
    logger._ortwrap_handlers = True  # type: ignore[attr-defined]
    logger.addHandler(logging.NullHandler())
    logger.addHandler(_StderrUnlessConfigured())
    for _lg in (logger, progress):
        _lg.addFilter(_RankZeroInfo())
    _env_level = env_log_level()
    if _env_level is not None:
        logger.setLevel(_env_level)


def set_verbosity(level: int | str) -> None:
    """Set ortwrap's verbosity for the whole process: the level of the ``ortwrap`` logger.

    Args:
        level: a ``logging`` level (``logging.INFO``) or its name (``"INFO"``, ``"CRITICAL"``).
            ``"INFO"`` shows one summary line per build (and progress while a long one runs);
            ``"DEBUG"`` adds ONNX Runtime's own C++ log. The default is ``ORTWRAP_LOG_LEVEL``, else
            the level the application's logging gives (``WARNING`` when it sets none).
    """
    logger.setLevel(parse_log_level(level))


def get_verbosity() -> int:
    """ortwrap's effective logging level (``logger.getEffectiveLevel()``)."""
    return logger.getEffectiveLevel()


def ort_log_wanted() -> bool:
    """Whether ONNX Runtime's C++ log is shown: only when ortwrap logs at DEBUG."""
    return logger.isEnabledFor(logging.DEBUG)


# ------------------------------------------------------------------------------------------------ progress

#: While a build runs, a line at INFO every this many seconds (then one summary line at the end).
PROGRESS_EVERY_S = 10.0


class BuildProgress:
    """Reports a long build *while* it runs: a daemon thread logs, every ``PROGRESS_EVERY_S``
    seconds, the stage that is running and the time so far. Started only when INFO is enabled.

    ``stage`` is set by the pipeline as each stage starts (``pipeline.run_stages``)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.stage = "starting"
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BuildProgress:
        if progress.isEnabledFor(logging.INFO):
            self._thread = threading.Thread(target=self._run, name="ortwrap-build-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        every = PROGRESS_EVERY_S
        while not self._stop.wait(every):
            progress.info(
                "building %s: still in %s (%.0f s so far)", self.what, self.stage, time.perf_counter() - self._start
            )


# ------------------------------------------------------------------------------------------------ warnings

_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _call_machinery_dirs() -> tuple[str, ...]:
    """Directories of code between a user's call and ortwrap's forward: ortwrap, torch (nn.Module's
    call, DDP, torch.compile's frames), and the wrappers that call a module for the user
    (DeepSpeed's engine, accelerate's hooks), where installed; contextlib and functools."""
    import contextlib
    import functools
    import importlib.util

    dirs = [_OWN_DIR, contextlib.__file__, functools.__file__]
    for name in ("torch", "deepspeed", "accelerate"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            dirs += [os.path.join(os.path.abspath(p), "") for p in spec.submodule_search_locations]
    return tuple(dirs)


_MACHINERY: tuple[str, ...] | None = None


def warn_at_user_line(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` pointing at the user's line: the innermost frame outside ortwrap and the
    call machinery between the user and ortwrap (:func:`_call_machinery_dirs`), on every path
    (a direct call, nn.Module's hooks, DDP, torch.compile, an integration, a method of the module).

    NOTE: ortwrap decides nothing from frames (tests/test_compat.py keeps frame inspection out of
    the package). Only where a warning is reported is read from the stack: Python 3.12's
    ``skip_file_prefixes`` does it in ``warnings``; before 3.12, ``traceback.extract_stack`` gives
    the same ``stacklevel``.
    """
    global _MACHINERY
    if _MACHINERY is None:
        _MACHINERY = _call_machinery_dirs()
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=_MACHINERY)  # type: ignore[call-arg]
        return
    stack = traceback.extract_stack()[:-1]  # innermost last; without this function's own frame
    level = 2  # (all machinery: point at this function's caller)
    for i, summary in enumerate(reversed(stack)):
        if not summary.filename.startswith(_MACHINERY):
            level = i + 2  # stacklevel 1 is this function, 2 its caller, ...
            break
    warnings.warn(message, category, stacklevel=level)
