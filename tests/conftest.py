from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

# Keep tests deterministic and fast on 2 cores.
torch.set_num_threads(2)
warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")


def _cuda_ready() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install ortwrap[cuda])"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _cuda_ready()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def _build_cache_dir(tmp_path_factory):
    """One build cache for the test session (fresh each run): tests of the same model, schema and
    options load each other's builds, so parity tests also check programs loaded from the cache."""
    return str(tmp_path_factory.mktemp("ortwrap_builds"))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, _build_cache_dir):
    for var in list(os.environ):
        if var.startswith("ORTWRAP_") and var != "ORTWRAP_CACHE_DIR":
            monkeypatch.delenv(var)
    monkeypatch.setenv("ORTWRAP_BUILD_CACHE_DIR", _build_cache_dir)


@pytest.fixture(params=["torchscript", "dynamo"])
def exporter(request):
    """Run a test with each exporter: check_parity and ``ORTWrap(..., exporter=exporter)`` use it.

    Core parity modules opt in with ``pytestmark = pytest.mark.usefixtures("exporter")``. A test that
    builds ``ORTWrap`` itself passes ``exporter=exporter``: the default, ``"auto"``, is neither (dynamo,
    then TorchScript where the dynamo capture fails). A test in such a module that exports nothing is
    marked ``parity.no_exporter`` and runs once."""
    import parity

    saved = parity.EXPORTER
    parity.EXPORTER = request.param
    try:
        yield request.param
    finally:
        parity.EXPORTER = saved


@pytest.fixture(params=["training", "onnxruntime"])
def engine(request):
    """Run a test with each engine (``ORTWrap(engine=...)``, docs/engines.md): check_parity uses it.
    Skipped where that engine's runtime is not installed (the training build in the
    ``ORT_EXTRA=ort`` venv). A parametrization that names engines passes ``indirect=["engine"]``."""
    import parity

    reason = parity.engine_missing(request.param)
    if reason:
        pytest.skip(reason)
    saved = parity.ENGINE
    parity.ENGINE = request.param
    try:
        yield request.param
    finally:
        parity.ENGINE = saved


@pytest.fixture
def one_exporter_on_the_engine(request):
    """For a module that runs on whichever engine the venv resolves: where that is ``onnxruntime`` (no
    training build), its graphs come from AOTAutograd whatever ``exporter`` says, so the two exporter
    settings are one test: the ``[torchscript]`` variant is skipped, saying so, and ``[dynamo]`` runs."""
    import parity

    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("exporter") == "torchscript" and parity.engine_missing("training"):
        pytest.skip("engine=onnxruntime: exporter= does not apply (the [dynamo] variant runs this test)")


@pytest.fixture
def gemm_dir(tmp_path, monkeypatch):
    """A fresh measurement store (and no records from earlier tests in this process), at one thread:
    a measurement with more threads is not kept on disk while the machine is overloaded
    (``keep_on_disk``), as the shared test machines often are. (test_gemm_choice.py, test_conv_choice.py)"""
    from ortwrap import gemm_choice as gc

    monkeypatch.setattr(gc, "directory", lambda: str(tmp_path))
    monkeypatch.setattr(gc, "_memo", {})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path
    torch.set_num_threads(threads)
