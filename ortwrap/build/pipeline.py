"""The build pipeline as data: a declared list of stages, run by one function.

A :class:`Stage` names the values it ``requires`` and the values it ``provides``, and returns them
(a dict) instead of keeping side results anywhere. :func:`run_stages` runs a list of stages over a
dict of values, checking each contract, timing each stage, and, with ``Options.debug_dir``, saving
a snapshot of every ONNX model a stage provides. A stage that fails leaves its snapshots and a text
file with its error in the debug directory, then re-raises. Each stage's name is handed to the
build's progress reporter (``_logging.BuildProgress``), which says at INFO, while a long stage runs,
which stage is running and the time so far.

``stages.py`` declares ortwrap's stages (export, translation, type inference, each graph pass,
host split, ATen gradients, gradient build, session, program) with :func:`stage`.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Stage", "StageRecord", "run_stages", "stage"]


@dataclass(frozen=True)
class Stage:
    """One step of the build.

    Attributes:
        name: the stage's name (also the key of its time in ``BuildArtifacts.stage_seconds``).
        requires: names of the values it reads.
        provides: names of the values it returns (exactly these).
        run: ``run(**{name: value for name in requires}) -> {name: value for name in provides}``.
        group: the coarse phase it belongs to (``export``, ``passes``, ``gradient_build``,
            ``session``), whose total ``BuildArtifacts.seconds`` reports.
    """

    name: str
    requires: tuple[str, ...]
    provides: tuple[str, ...]
    run: Callable[..., dict[str, Any]]
    group: str
    #: ``snapshot_if(out)``: whether this run's result is worth a debug snapshot (a pass that
    #: changed nothing is not); None: always.
    snapshot_if: Callable[[dict[str, Any]], bool] | None = None


def stage(
    name: str,
    requires: tuple[str, ...],
    provides: tuple[str, ...],
    group: str,
    snapshot_if: Callable[[dict[str, Any]], bool] | None = None,
):
    """Decorator: declare ``fn`` as a :class:`Stage`."""

    def wrap(fn: Callable[..., dict[str, Any]]) -> Stage:
        if snapshot_if is None:
            return Stage(name, requires, provides, fn, group)
        return Stage(name, requires, provides, fn, group, snapshot_if)

    return wrap


@dataclass
class StageRecord:
    """What one stage did: its name, group, wall time, the snapshot files it left, and the CPU time
    of the process while it ran (``time.process_time``: all threads; steadier than the wall time
    on a busy machine)."""

    name: str
    group: str
    seconds: float
    snapshots: list[str] = field(default_factory=list)
    cpu_seconds: float = 0.0


def _snapshot(directory: str, prefix: str, index: int, stage_name: str, name: str, value: Any) -> str | None:
    """Save ``value`` if it is an ONNX model (proto or onnx_ir); return the path."""
    import onnx

    try:
        import onnx_ir as ir
    except ImportError:  # pragma: no cover
        ir = None
    proto = None
    if isinstance(value, onnx.ModelProto):
        proto = value
    elif ir is not None and isinstance(value, ir.Model):
        proto = ir.serde.serialize_model(value)
    elif hasattr(value, "model") and isinstance(getattr(value, "model", None), onnx.ModelProto):
        proto = value.model  # an ExportedModel
    elif hasattr(value, "model_bytes"):
        path = os.path.join(directory, f"{prefix}_{index:02d}_{stage_name}_{name}.onnx")
        with open(path, "wb") as f:
            f.write(value.model_bytes)
        return path
    if proto is None:
        return None
    path = os.path.join(directory, f"{prefix}_{index:02d}_{stage_name}_{name}.onnx")
    onnx.save_model(proto, path)
    return path


def run_stages(
    stages: list[Stage],
    values: dict[str, Any],
    *,
    what: str,
    debug_dir: str | None = None,
    snapshot_prefix: str = "build",
    records: list[StageRecord] | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """Run ``stages`` in order over ``values`` (updated in place, and returned).

    Args:
        stages: the declared list.
        values: the values available before the first stage.
        what: what is being built, for progress lines ("training program for TinyGPT").
        debug_dir: where to save each stage's ONNX snapshots, and a failed stage's error.
        snapshot_prefix: the file name prefix of this build's snapshots.
        records: a list to append each stage's :class:`StageRecord` to.
        progress: the build's progress reporter (``_logging.BuildProgress``): its ``stage`` is set
            to each stage's name as the stage starts.

    Raises:
        Whatever a stage raises (ortwrap's phase errors), after recording it.
    """
    records = records if records is not None else []
    if debug_dir:
        os.makedirs(debug_dir, exist_ok=True)
    for index, st in enumerate(stages):
        missing = [r for r in st.requires if r not in values]
        if missing:
            raise AssertionError(f"build stage {st.name} requires {missing}, which no earlier stage provided")
        if progress is not None:
            progress.stage = st.name
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            out = st.run(**{r: values[r] for r in st.requires})
        except BaseException as e:
            records.append(StageRecord(st.name, st.group, time.perf_counter() - t0, [], time.process_time() - c0))
            if debug_dir:
                path = os.path.join(debug_dir, f"{snapshot_prefix}_{index:02d}_{st.name}_FAILED.txt")
                with open(path, "w") as f:
                    f.write(f"stage {st.name} of {what} failed:\n")
                    f.write("".join(traceback.format_exception(e)))
                records[-1].snapshots.append(path)
            raise
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        if set(out) != set(st.provides):
            raise AssertionError(f"build stage {st.name} returned {sorted(out)}, declared {sorted(st.provides)}")
        values.update(out)
        record = StageRecord(st.name, st.group, seconds, [], cpu)
        if debug_dir and (st.snapshot_if is None or st.snapshot_if(out)):
            for name in st.provides:
                path = _snapshot(debug_dir, snapshot_prefix, index, st.name, name, out[name])
                if path:
                    record.snapshots.append(path)
        records.append(record)
    return values
