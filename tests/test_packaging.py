"""Packaging in a source checkout: the prebuilt helpers that setup.py makes are used only while their
source is unchanged; without a C compiler a model still trains in ONNX Runtime (ORT's own kernels,
one warning that names the environment); the message when ONNX Runtime is missing; one version.
The installed wheel and sdist are tested by tests/installed/ (make test-wheel)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import ortwrap
from ortwrap import _ort
from ortwrap.bridge import _native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BRIDGE = os.path.join(ROOT, "ortwrap", "bridge")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_prebuilt_helper_is_loaded_until_its_source_changes(tmp_path, monkeypatch):
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (built,) = (tmp_path / "lib" / "ortwrap" / "bridge").glob("_runner.*.so")
    shutil.copy(built, pkg)
    shutil.copy(os.path.join(BRIDGE, "_runner.c"), pkg)
    monkeypatch.setattr(_native, "LOADED", {})
    monkeypatch.setenv("ORTWRAP_CACHE_DIR", str(tmp_path / "cache"))

    lib = _native.load.__wrapped__("_runner", str(pkg))
    assert _native.LOADED["_runner"] == str(pkg / built.name)  # the prebuilt module, nothing compiled
    assert lib.ortwrap_bridge_set_handlers
    assert not (tmp_path / "cache").exists()

    with open(pkg / "_runner.c", "a") as f:  # edited after the build: compiled from the source instead
        f.write("\nint ortwrap_edited(void) { return 7; }\n")
    lib = _native.load.__wrapped__("_runner", str(pkg))
    assert _native.LOADED["_runner"].startswith(str(tmp_path / "cache"))
    assert lib.ortwrap_edited() == 7

    os.remove(pkg / built.name)  # a file of that name that setup.py did not build is not loaded either
    shutil.copy(os.path.join(BRIDGE, "_runner.c"), pkg)
    (pkg / "_runner.so").write_bytes(b"not a library")
    lib = _native.load.__wrapped__("_runner", str(pkg))
    assert _native.LOADED["_runner"].startswith(str(tmp_path / "cache")) and lib.ortwrap_bridge_set_handlers


def test_without_a_c_compiler_the_model_trains_on_ort_with_one_warning(tmp_path):
    """The helpers are prebuilt (here: already compiled into the cache, as a wheel ships them);
    the CPU kernels cannot be compiled: ORT's own kernels run, with one warning, and the model
    (a Function, GELU, LayerNorm) trains in ONNX Runtime like eager through both exporters."""
    env = {**os.environ, "ORTWRAP_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": ROOT}
    env.pop("CC", None)
    warm = "from ortwrap.bridge import _native; _native.load('_runner'); _native.load('_aten')"
    proc = subprocess.run([sys.executable, "-c", warm], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    code = textwrap.dedent(
        """
        import os, sys, warnings
        sys.path.insert(0, os.path.join(sys.argv[1], "tests", "installed"))
        from test_installed import _train
        from ortwrap import FallbackWarning
        from ortwrap.bridge import _native
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for exporter in ("torchscript", "dynamo"):
                ops = _train(exporter)
                assert {"PythonOp", "PythonOpGrad", "LayerNormalizationGrad"} <= ops, ops
                assert "ATen" not in ops, ops
        assert not [w for w in caught if issubclass(w.category, FallbackWarning)]
        msgs = [str(w.message) for w in caught if "native CPU kernels could not be built" in str(w.message)]
        assert len(msgs) == 1, [str(w.message) for w in caught]
        assert "_cpu" not in _native.LOADED
        print(msgs[0])
        """
    )
    env["CC"] = str(tmp_path / "no-such-compiler")
    proc = subprocess.run([sys.executable, "-c", code, ROOT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    message = proc.stdout
    assert f"no C compiler in this environment (Python {sys.version.split()[0]} at {sys.prefix}" in message
    assert f"CC={tmp_path / 'no-such-compiler'}" in message and "apt-get install gcc" in message, message
    assert "the model still trains in ONNX Runtime" in message


def test_missing_onnxruntime_says_which_pythons_have_training_wheels():
    on_313 = _ort.missing_ort_message((3, 13))
    assert "CPython 3.10, 3.11, 3.12 only" in on_313 and "this is Python 3.13" in on_313
    code = "import sys; sys.modules['onnxruntime'] = None; import ortwrap"  # as if not installed
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}
    )
    assert proc.returncode != 0
    assert "ImportError: ortwrap needs ONNX Runtime's training build: pip install 'ortwrap[cpu]'" in proc.stderr
    assert "training wheels exist for CPython 3.10, 3.11, 3.12" in proc.stderr


def test_one_version_and_the_package_metadata():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ortwrap._version.__version__"}
    assert ortwrap.__version__ == ortwrap._version.__version__
    assert project["project"]["license"] == "MIT" and os.path.exists(os.path.join(ROOT, "LICENSE"))
    assert project["project"]["requires-python"] == ">=3.10"  # not capped
    for extra in ("cpu", "cuda"):
        assert all('python_version < "3.13"' in r for r in project["project"]["optional-dependencies"][extra])
    assert os.path.exists(os.path.join(ROOT, "ortwrap", "py.typed"))
