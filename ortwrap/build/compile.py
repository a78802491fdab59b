"""``compile_program``: export, rewrite, build and load a module for one input schema.

The build runs as data (``build/pipeline.py``): the export stages of an exporter (capture, then,
unless the build cache serves the capture, translate: :func:`_export`, with the exporter fallback
and the static re-export), then ``build/stages.py``'s :func:`build_stages`. Each stage declares
what it requires and provides and returns it; each is timed and, with ``debug_dir``, snapshotted.
Each raises its own ortwrap error; the caller (``dispatch.py``) decides whether to fall back.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import linecache
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import onnx
import torch
from torch import nn

from .._compat import torch as compat
from .._logging import BuildProgress, logger, ort_log_wanted
from ..errors import ExportError, UnsupportedOutputError
from ..export import ExportedModel
from ..options import Options
from ..runtime.program import Program
from . import cache as build_cache
from .cache_stages import cache_lookup, cache_store, program_from_cache
from .pipeline import Stage, StageRecord, run_stages
from .request import BuildArtifacts, BuildRequest
from .stages import build_stages, export_stages

__all__ = ["compile_program"]


def _export(
    request: BuildRequest, records: list[StageRecord], debug: dict
) -> tuple[ExportedModel | None, int, list[str], str, str | None, build_cache.CacheEntry | None]:
    """Run the export stages of the first of ``request.options.exporters`` that succeeds: (the export,
    how many exports it took, why its non-batch dimensions are static, the exporter's name, the
    build cache key, the cache entry that serves this build).

    Between each exporter's first capture and its translation the build cache is looked up
    (``cache_lookup``): on a hit the translation never runs, and the export is None.

    A graph that needs static non-batch dimensions (see ``export.adapter``) is exported again
    with them. Only the successful exporter's exports are counted.

    Raises:
        ExportError: the first exporter's error (naming the others'), when every exporter failed.
    """
    exporters = request.options.exporters
    errors: list[tuple[str, ExportError]] = []
    for name in exporters:
        capture_stage, translate_stage = export_stages(name)
        exports = 0
        cache_key: str | None = None
        try:
            try:
                values, cache_key, hit = _capture(request, capture_stage, name, False, True, records, debug)
                if hit is not None:
                    return None, 0, [], name, cache_key, hit
                values = run_stages([translate_stage], values, records=records, **debug)
                exported: ExportedModel | None = values["exported"]
            except ExportError as e:
                # Some symbolics (adaptive pooling to a size > 1) need the traced spatial sizes.
                if "input size not accessible" not in str(e):
                    raise
                exported = None
                reasons = ["the exporter needs static spatial sizes"]
            else:
                reasons = list(exported.static_reasons)
            exports += 1
            if exported is None or (exported.static_reasons and not exported.static_spatial):
                logger.info("exporting with static non-batch dimensions: %s", "; ".join(reasons))
                # the first capture's key serves (its entries record their static shape); when the
                # first capture failed, this one's
                values, key, hit = _capture(request, capture_stage, name, True, cache_key is None, records, debug)
                cache_key = cache_key or key
                if hit is not None:
                    return None, 0, [], name, cache_key, hit
                values = run_stages([translate_stage], values, records=records, **debug)
                exported = values["exported"]
                exports += 1
        except UnsupportedOutputError:
            # The module's outputs, not the exporter, are the problem: every exporter would refuse them.
            raise
        except ExportError as e:
            errors.append((name, e))
            continue
        # NOTE: said only once a later exporter succeeded: when every exporter fails, the caller
        # first checks whether eager raises on this input (a bad batch gets eager's exception and
        # no word about exporters), else warns of the fallback with every exporter's error.
        for failed, e in errors:
            logger.warning(
                "the %s exporter failed for %s (%s); the %s exporter is used",
                failed,
                type(request.module).__name__,
                str(e).split(". ")[0][:300],
                name,
            )
        return exported, exports, reasons, name, cache_key, None
    name, first = errors[0]
    if len(errors) == 1:
        raise first
    others = "; ".join(
        f"the {n} exporter also failed: {str(e).removeprefix('[ortwrap:export] ')}" for n, e in errors[1:]
    )
    raise type(first)(f"{str(first).removeprefix('[ortwrap:export] ')} ({others})") from first


def _capture(
    request: BuildRequest,
    capture_stage: Stage,
    exporter: str,
    static_spatial: bool,
    lookup: bool,
    records: list[StageRecord],
    debug: dict,
) -> tuple[dict[str, Any], str | None, build_cache.CacheEntry | None]:
    """Run an exporter's capture stage; with ``lookup``, then the build cache's lookup
    (``cache_lookup``). Returns the stage values, the cache key and the entry that fits, if any."""
    start = {"request": request, "static_spatial": static_spatial, "exporter": exporter}
    values = run_stages([capture_stage], start, records=records, **debug)
    if not lookup:
        return values, None, None
    run_stages([cache_lookup], values, records=records, **debug)
    return values, values["cache_key"], values["cached"]


def _release_capture() -> None:
    """Once the exporter has returned the ONNX model (or the build cache served it): free what the
    capture left behind, before the passes, the gradient build and the session allocate theirs, so
    that those reuse its memory instead of adding to the peak.

    NOTE: torch.export keeps the last export's fx graph, fake tensors and ShapeEnv alive until its
    next trace (``compat.release_export_state``); tracing fills ``linecache`` with the whole source
    of every file on the captured stacks (node stack traces: ~5 MiB of lines for a transformers
    model), which nothing reads after the capture (a traceback re-reads its lines on demand).
    The collection then frees the capture's cycles (fx nodes and graphs); objects older than the
    build are set aside by :func:`_build_gc`, so it walks only the build's own."""
    compat.release_export_state()
    linecache.clearcache()
    gc.collect()


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (another C library)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def _trim_heap() -> None:
    """After a build: hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``).

    NOTE: a build allocates and frees many small blocks (ONNX protos, ORT's graph transformers'
    copies of the graph); glibc keeps the freed pages of its heap and arenas, and they stay in the
    process's resident set (~5 MiB after a small transformer's build). A few milliseconds."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


#: Allocations between two young-generation collections during a build (Python's default is 700).
_BUILD_GC_YOUNG_THRESHOLD = 20_000


@contextlib.contextmanager
def _build_gc() -> Iterator[None]:
    """During a build, the cyclic garbage collector looks only at objects the build created, and
    less often.

    NOTE: a build allocates enough (the exporter's imports, fake tensors, ONNX IR) to trigger full
    collections, and each one walks every object of the process: torch's and the user's, millions
    of them, ~0.15 CPU s each. A process's first dynamo build ran three to four of them and ~450
    young ones: 0.45 CPU s of the benchmark LM's 2.4 (docs/performance.md). ``gc.freeze()`` sets the
    objects that existed before the build aside for its duration, and ``gc.unfreeze()`` hands them
    back to the oldest generation afterwards: nothing is collected that would not have been, only
    later (cycles among the older objects wait for the first full collection after the build).
    Young collections run every ``_BUILD_GC_YOUNG_THRESHOLD`` allocations instead of 700 (0.1 CPU s
    less): the build's short-lived cycles are mostly fx nodes, fake tensors and IR values, which
    hold no tensor data.
    Thresholds are restored afterwards. Left alone when the collector is off or something else
    froze objects (``gc.get_freeze_count()``: the user's own ``gc.freeze()``, or a build within a
    build), whose ``unfreeze`` is not ours to call. (A ``gc.freeze()`` that another thread makes
    during a build is undone with the build's: the collector has one permanent generation.)
    """
    thresholds = gc.get_threshold()
    if gc.get_freeze_count() or not gc.isenabled() or thresholds[0] <= 0:
        yield
        return
    gc.freeze()
    gc.set_threshold(max(thresholds[0], _BUILD_GC_YOUNG_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


@_build_gc()
def compile_program(
    module: nn.Module,
    leaves: list[torch.Tensor],
    in_spec: tuple,
    input_paths: list[str],
    *,
    training: bool,
    with_backward: bool,
    device: torch.device,
    options: Options,
    build_index: int = 0,
    autocast: tuple | None = None,
) -> tuple[Program, BuildArtifacts]:
    """Export, rewrite, build and load ``module`` for one input schema: :func:`export_stages` (with
    the exporter fallback and static re-export of :func:`_export`), then :func:`build_stages`; with
    the garbage collector set aside as :func:`_build_gc` says.

    Raises:
        ExportError, PassError, GradientBuildError, SessionError: from the stage that failed.
    """
    for path, leaf in zip(input_paths, leaves):
        if leaf.is_complex():
            # NOTE: ORT holds no complex values (DLPack refuses them at the first run): refused before
            # the capture, so the signature falls back with this reason (or the split capture's
            # fragment runs in PyTorch), not with the runtime's "Unsupported code 5".
            raise ExportError(
                f"forward() argument `{path}` is a {leaf.dtype} tensor, and ONNX Runtime holds no complex values: "
                f"pass torch.view_as_real({path}) and call torch.view_as_complex inside the module"
            )
    request = BuildRequest(module, leaves, in_spec, input_paths, training, with_backward, device, options, autocast)
    records: list[StageRecord] = []
    debug = {
        "what": request.describe(),
        "debug_dir": options.debug_dir,
        "snapshot_prefix": f"build{build_index:02d}_{request.kind}",
    }
    t0 = time.perf_counter()
    # (torch's and the exporters' logs are muted, except at ortwrap's DEBUG verbosity)
    with BuildProgress(request.describe()) as reporter, compat.quiet_capture_logs(not ort_log_wanted()):
        program, artifacts = _compile(request, records, {**debug, "progress": reporter}, t0)
    _trim_heap()
    # (after the progress reporter stopped: the summary is the build's last line)
    if artifacts.cached:
        logger.info("loaded %s from the build cache in %.2fs", request.describe(), time.perf_counter() - t0)
    elif logger.isEnabledFor(logging.INFO):
        logger.info(
            "built %s in %.2fs (%s)",
            request.describe(),
            time.perf_counter() - t0,
            ", ".join(f"{k} {v:.2f}s" for k, v in artifacts.stage_seconds.items() if v >= 0.01),
        )
    return program, artifacts


def _compile(
    request: BuildRequest, records: list[StageRecord], debug: dict, t0: float
) -> tuple[Program, BuildArtifacts]:
    """:func:`compile_program`'s build, its progress reported by ``debug["progress"]``."""
    training, with_backward = request.training, request.with_backward
    exported, exports, reasons, exporter, cache_key, cached = _export(request, records, debug)
    _release_capture()
    if cached is not None:
        return program_from_cache(request, cached, records, debug, t0)
    assert exported is not None
    exported_proto = onnx.ModelProto()
    exported_proto.CopyFrom(exported.model)
    values = run_stages(build_stages(request), {"request": request, "exported": exported}, records=records, **debug)
    program = values["program"]
    if cache_key is not None:
        run_stages(
            [cache_store],
            {
                **values,
                "cache_key": cache_key,
                "exported_proto": exported_proto,
                "exporter": exporter,
                "exports": exports,
                "static_reasons": sorted(set(reasons + exported.static_reasons)),
            },
            records=records,
            **debug,
        )
    seconds: dict[str, float] = {"export": 0.0, "passes": 0.0, "gradient_build": 0.0, "session": 0.0}
    stage_seconds: dict[str, float] = {}
    for r in records:
        seconds[r.group] = seconds.get(r.group, 0.0) + r.seconds
        stage_seconds[r.name] = stage_seconds.get(r.name, 0.0) + r.seconds
    host_split = values["host_split"]
    artifacts = BuildArtifacts(
        exported_proto,
        values["pre_grad"],
        values["graph"],
        values["pass_records"],
        seconds,
        training,
        with_backward,
        exports,
        sorted(set(reasons + exported.static_reasons)) if exported.static_spatial else [],
        host_split,
        exporter,
        stage_seconds,
        records,
        recompute=values["recompute"],
        gemm_choice=values["gemm_choice"],
    )
    return program, artifacts
