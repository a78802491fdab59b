"""Builds ortwrap's two Python-C-API helpers as extension modules; the metadata is in pyproject.toml.

``ortwrap/bridge/_runner.c`` (the PythonOp runners) and ``_aten.c`` (the ATen-op executor) are
plain C against Python.h that ONNX Runtime calls through raw function pointers. Built here, a wheel
or sdist install needs no C compiler at run time; ortwrap loads them with ctypes
(``ortwrap/bridge/_native.py``). Each carries the digest of its source (``ORTWRAP_SOURCE_SHA256``),
so a source checkout edited after ``pip install -e .`` compiles the edited file instead of loading
the stale build. ``kernels/_cpu.c`` is not built here: it is compiled on first use with
``-march=native`` for the CPU that runs it (it ships as package data).
"""

import importlib.util
import os

from setuptools import Extension, setup

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("_digest", os.path.join(_HERE, "ortwrap", "bridge", "_digest.py"))
_digest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_digest)


def _helper(name: str) -> Extension:
    source = f"ortwrap/bridge/{name}.c"
    digest = _digest.source_digest(os.path.join(_HERE, source))
    return Extension(
        f"ortwrap.bridge.{name}",
        [source],
        depends=["ortwrap/bridge/_dlpack.h"],
        define_macros=[("ORTWRAP_SOURCE_SHA256", f'"{digest}"')],
        libraries=["dl"],
    )


setup(ext_modules=[_helper("_runner"), _helper("_aten")])
