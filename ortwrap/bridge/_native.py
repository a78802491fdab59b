"""Build and load ortwrap's small native libraries (Python.h only) with the system C compiler.

ONNX Runtime 1.19.2 calls its PythonOp runners and its ATen executor through raw function
pointers, so they must be native code: a few hundred lines of C that use only the Python C API.
They, and ortwrap's CPU kernels (``kernels/_cpu.c``, plain C), are compiled on first use (about
0.2 s; 1 s for the kernels) into a cache keyed by the source, the Python version and the platform. ``torch.utils.cpp_extension`` is deliberately not used: its builds take
about a minute and were a common source of ORTModule install failures.

The cache directory is ``$ORTWRAP_CACHE_DIR`` or ``~/.cache/ortwrap``; the compiler is ``$CC`` or
the first of ``cc``/``gcc``/``clang`` found.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from functools import cache

from ..errors import ORTWrapError
from ..options import c_compiler_override, cache_dir


class NativeBuildError(ORTWrapError):
    """A native helper library of ortwrap could not be compiled."""

    phase = "native-build"


_HERE = os.path.dirname(os.path.abspath(__file__))


def _compiler() -> str:
    override = c_compiler_override()
    candidates = [override] if override else ["cc", "gcc", "clang"]
    for c in candidates:
        path = shutil.which(c)
        if path:
            return path
    raise NativeBuildError(
        "no C compiler found (tried "
        + ", ".join(candidates)
        + "). ortwrap compiles two small Python C-API helpers on first use to run "
        "torch.autograd.Functions and ATen ops inside ONNX Runtime. Install one (e.g. `apt-get install gcc`) "
        "or set CC."
    )


def _cpu_signature() -> bytes:
    """What ``-march=native`` code depends on: the CPU's model and feature flags (Linux), else the platform."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith((b"flags", b"model name", b"Features"))]
        return b"\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor().encode()


@cache
def load(name: str, directory: str = _HERE, native_code: bool = False) -> ctypes.PyDLL:
    """Compile ``<directory>/<name>.c`` (once, cached on disk) and load it.

    ``native_code``: compile with ``-O3 -march=native`` for the CPU it runs on (the cache key then
    includes the CPU's model and feature flags, so a shared cache never serves another CPU's code).

    Raises:
        NativeBuildError: no compiler, or the compilation failed (the compiler's output is included).
    """
    src = os.path.join(directory, f"{name}.c")
    with open(src, "rb") as f:
        source = f.read()
    include = sysconfig.get_paths()["include"]
    # -fno-trapping-math: without it GCC 12 does not if-convert the kernels' selects (GELU's sign
    # branches, exp's underflow clamp) on AVX2-only CPUs, and their loops stay scalar: 4.3x slower
    # GELU on an AMD EPYC without AVX-512 (AVX-512's masked ops vectorize either way). The kernels
    # never read floating-point exception flags.
    flags = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math"] if native_code else ["-O2"]
    key = hashlib.sha256(source + sys.version.encode() + platform.platform().encode() + include.encode())
    key.update(" ".join(flags).encode() + (_cpu_signature() if native_code else b""))
    cache = cache_dir()
    os.makedirs(cache, exist_ok=True)
    lib = os.path.join(cache, f"{name}-{key.hexdigest()[:16]}.so")
    if not os.path.exists(lib):
        cc = _compiler()
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        cmd = [cc, "-shared", "-fPIC", *flags, "-Wall", f"-I{include}", src, "-o", tmp, "-ldl", "-lpthread", "-lm"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise NativeBuildError(f"compiling {name}.c failed: {' '.join(cmd)}\n{proc.stderr.strip()}")
            os.replace(tmp, lib)  # atomic: concurrent builders (ranks) agree on the result
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.PyDLL(lib)  # PyDLL: calls from Python keep the GIL; py_object arguments allowed
