"""The build cache's stages: ``cache_lookup`` (between an exporter's capture and its translation),
``cache_store`` (after a build) and :func:`program_from_cache` (a program from an entry: a session
over the stored graph, mapped to this module). The cache itself (key, signed entries, size cap) is
``cache.py``.
"""

from __future__ import annotations

from typing import Any

import onnx
import torch

from .. import gemm_choice as gemms
from .. import kernels
from .._logging import logger
from ..bridge import aten
from ..bridge.aten import ATEN_DOMAIN
from ..export import ExportedModel
from ..options import build_cache_dir
from ..passes import PassRecord
from .cache import (
    CacheEntry,
    Uncacheable,
    build_key,
    load,
    portable_out_spec,
    store,
)
from .pipeline import StageRecord, run_stages, stage
from .request import BuildArtifacts, BuildRequest
from .stages import build_stages

__all__ = ["cache_lookup", "cache_store", "cached_graph_nodes", "program_from_cache"]


def _schema(request: BuildRequest) -> tuple:
    return (
        request.in_spec,
        tuple((t.dim(), str(t.dtype), str(t.device), t.requires_grad) for t in request.leaves),
        request.training,
        request.with_backward,
        str(request.device),
        repr(request.autocast),
        gemms.schema_key(request.options),  # "auto": chosen by a measurement on this machine
    )


def _static_shape(leaves: list[torch.Tensor]) -> tuple:
    return tuple(tuple(t.shape[1:]) for t in leaves)


def _entry_fits(entry: CacheEntry, leaves: list[torch.Tensor]) -> bool:
    if entry.static_spatial and entry.static_shape != _static_shape(leaves):
        return False
    return entry.shape_guards is None or entry.shape_guards.check(leaves)


@stage("cache_lookup", ("request", "capture", "exporter"), ("cached", "cache_key"), group="export")
def cache_lookup(request: BuildRequest, capture: Any, exporter: str) -> dict:
    """The build cache's entry for this capture, schema and options that fits these inputs, if any
    (the key is made from the capture: :func:`build_key`)."""
    o = request.options
    if not o.build_cache:
        return {"cached": None, "cache_key": None}
    native = o.native_kernels and request.with_backward and request.device.type == "cpu"
    try:
        key = build_key(request.module, _schema(request), o, native, exporter=exporter, capture=capture)
    except Uncacheable as e:
        logger.info("build cache: %s cannot be cached: %s", type(request.module).__name__, e)
        return {"cached": None, "cache_key": None}
    except Exception as e:  # the cache never fails a build: a capture the key does not know is a miss
        logger.warning(
            "build cache: no key for %s's capture (%s: %s); it is built without the cache",
            type(request.module).__name__,
            type(e).__name__,
            e,
        )
        return {"cached": None, "cache_key": None}
    entries = load(build_cache_dir(), key) or []
    entry = next((e for e in entries if _entry_fits(e, request.leaves)), None)
    return {"cached": entry, "cache_key": key}


@stage("cache_store", ("request", "cache_key", "fed_export", "graph", "host_split", "exported_proto", "pre_grad",
                       "pass_records", "exporter", "exports", "static_reasons"), (), group="session")  # fmt: skip
def cache_store(
    request,
    cache_key,
    fed_export,
    graph,
    host_split,
    exported_proto,
    pre_grad,
    pass_records,
    exporter,
    exports,
    static_reasons,
):
    """Add this build to the cache (not graphs with PythonOps or a host shape program); with the
    reasons its dims are static (the export's and the exporter loop's, e.g. a size probe's)."""
    if fed_export.functions or host_split is not None:
        return {}
    by_id = {id(b): n for n, b in request.module.named_buffers(remove_duplicate=False)}
    try:
        buffers = {g: by_id[id(b)] for g, b in fed_export.buffer_outputs.items()}
    except KeyError:
        return {}
    out_spec, dropped = portable_out_spec(fed_export.out_spec)
    entry = CacheEntry(
        model_bytes=graph.model_bytes,
        graph=graph,
        exported=exported_proto.SerializeToString(),
        pre_grad=pre_grad.SerializeToString(),
        user_input_names=list(fed_export.user_input_names),
        output_names=list(fed_export.output_names),
        out_spec=out_spec,
        state_names=dict(fed_export.state_names),
        buffer_outputs=buffers,
        static_reasons=list(static_reasons),
        static_spatial=fed_export.static_spatial,
        shape_guards=fed_export.shape_guards,
        exporter=exporter,
        exports=exports,
        pass_names=[r.name for r in pass_records if r.modified],
        static_shape=_static_shape(request.leaves) if fed_export.static_spatial else None,
        dropped_outputs=dropped,
    )
    directory = build_cache_dir()
    entries = [e for e in (load(directory, cache_key, warn=False) or []) if not _same_fit(e, entry)]
    store(directory, cache_key, [*entries, entry])
    return {}


def _same_fit(a: CacheEntry, b: CacheEntry) -> bool:
    return (
        a.static_spatial == b.static_spatial and a.static_shape == b.static_shape and a.shape_guards == b.shape_guards
    )


def program_from_cache(request: BuildRequest, entry: CacheEntry, records: list[StageRecord], debug: dict, t0: float):
    """A program from a cache entry: a session over the stored graph, mapped to this module."""

    @stage("cache_load", ("request", "cached"), ("fed_export", "graph"), group="export")
    def cache_load(request: BuildRequest, cached: CacheEntry) -> dict:
        named = dict(request.module.named_parameters(remove_duplicate=False))
        named.update(request.module.named_buffers(remove_duplicate=False))
        fed_export = ExportedModel(
            model=onnx.load_model_from_string(cached.pre_grad),
            user_input_names=list(cached.user_input_names),
            state_inputs={g: named[n] for g, n in cached.state_names.items()},
            output_names=list(cached.output_names),
            out_spec=cached.out_spec,
            buffer_outputs={g: named[n] for g, n in cached.buffer_outputs.items()},
            state_names=dict(cached.state_names),
            static_reasons=list(cached.static_reasons),
            static_spatial=cached.static_spatial,
            shape_guards=cached.shape_guards,
        )
        if any(n.domain == ATEN_DOMAIN for n in fed_export.model.graph.node):
            aten.install()
            if any(
                n.op_type == "ATen" and _operator(n).startswith(aten.NATIVE_PREFIX) for n in cached_graph_nodes(cached)
            ):
                kernels.available(request.options.intra_op_threads or torch.get_num_threads())
        return {"fed_export": fed_export, "graph": cached.graph}

    if entry.dropped_outputs:
        logger.warning(
            "forward() output %s, the object the export built, could not be kept in the build cache: "
            "this process returns None for it (return tensors in tuples, dicts or dataclasses)",
            ", ".join(entry.dropped_outputs),
        )
    stages = [cache_load, *[s for s in build_stages(request) if s.name in ("session", "program")]]
    values = run_stages(stages, {"request": request, "cached": entry, "host_split": None}, records=records, **debug)
    seconds: dict[str, float] = {"export": 0.0, "passes": 0.0, "gradient_build": 0.0, "session": 0.0}
    for r in records:
        seconds[r.group] = seconds.get(r.group, 0.0) + r.seconds
    artifacts = BuildArtifacts(
        onnx.load_model_from_string(entry.exported),
        values["fed_export"].model,
        entry.graph,
        [PassRecord(n, True, 0.0) for n in entry.pass_names],
        seconds,
        request.training,
        request.with_backward,
        0,
        sorted(entry.static_reasons) if entry.static_spatial else [],
        None,
        entry.exporter,
        {r.name: r.seconds for r in records},
        records,
        cached=True,
    )
    return values["program"], artifacts


def _operator(node: onnx.NodeProto) -> str:
    return next((a.s.decode() for a in node.attribute if a.name == "operator"), "")


def cached_graph_nodes(entry: CacheEntry) -> list[onnx.NodeProto]:
    """The nodes of a cached built graph."""
    return list(onnx.load_model_from_string(entry.model_bytes).graph.node)
