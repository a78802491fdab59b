"""Load ortwrap's small native libraries (Python.h only): prebuilt, or compiled with the system C compiler.

ONNX Runtime 1.19.2 calls its PythonOp runners and its ATen executor through raw function
pointers, so they must be native code: a few hundred lines of C that use only the Python C API
(``_runner.c``, ``_aten.c``). A wheel or sdist install builds them as extension modules
(``setup.py``), so the core path needs no C compiler at run time; ortwrap loads them with ctypes.
Where none was built for this Python (a source checkout on ``PYTHONPATH``), or its source has been
edited since (each carries its source's digest, ``_digest.py``), they are compiled on first use
(about 0.2 s), as are ortwrap's CPU kernels (``kernels/_cpu.c``, plain C, about 1 s, always:
``-march=native`` code for the CPU that runs them). Compiled libraries are cached by the source,
the Python version and the platform. One C++ file, ``_compat/_cpu_region.cpp``, is compiled on first
use against the installed torch's headers (about 0.8 s; ``load_torch_cxx``, compiler ``$CXX`` or the
first of ``c++``/``g++``/``clang++``). ``torch.utils.cpp_extension`` is deliberately not used: its
builds take about a minute and were a common source of ORTModule install failures.

The cache directory is ``$ORTWRAP_CACHE_DIR`` or ``~/.cache/ortwrap``; the compiler is ``$CC`` or
the first of ``cc``/``gcc``/``clang`` found.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from functools import cache

from ..errors import ORTWrapError
from ..options import c_compiler_override, cache_dir, cxx_compiler_override
from ._digest import HEADERS, source_digest

logger = logging.getLogger(__name__)


class NativeBuildError(ORTWrapError):
    """A native helper library of ortwrap could not be compiled."""

    phase = "native-build"


_HERE = os.path.dirname(os.path.abspath(__file__))


#: What each C file is for, in NativeBuildError's message.
_PURPOSE = {
    "_runner": "the runners that call torch.autograd.Functions inside ONNX Runtime (this ortwrap has no "
    "prebuilt copy for this Python: a source checkout, which `pip install -e .` builds them for)",
    "_aten": "the executor that runs ATen ops inside ONNX Runtime (this ortwrap has no prebuilt copy for "
    "this Python: a source checkout, which `pip install -e .` builds them for)",
    "_cpu": "ortwrap's CPU kernels, compiled on first use for the CPU that runs them (-march=native)",
    "_cpu_region": "the region PyTorch's large CPU blocks come from while ONNX Runtime runs (runtime/cpu_region.py), "
    "compiled on first use against the installed torch's C++ headers",
}

#: name -> path of each native library loaded in this process (prebuilt module or compiled in the cache).
LOADED: dict[str, str] = {}


#: language -> (its environment variable's reader, the variable, the compilers tried, the source suffix, how
#: to install one)
_COMPILERS = {
    "C": (
        c_compiler_override,
        "CC",
        ("cc", "gcc", "clang"),
        ".c",
        "Debian/Ubuntu: `apt-get install gcc`; Fedora/RHEL: `dnf install gcc`; conda: `conda install -c conda-forge "
        "c-compiler`",
    ),
    "C++": (
        cxx_compiler_override,
        "CXX",
        ("c++", "g++", "clang++"),
        ".cpp",
        "Debian/Ubuntu: `apt-get install g++`; Fedora/RHEL: `dnf install gcc-c++`; conda: `conda install -c "
        "conda-forge cxx-compiler`",
    ),
}


def _compiler(name: str, language: str = "C") -> str:
    """The compiler for ``<name>`` in ``language``: ``$CC``/``$CXX``, else the first candidate on PATH."""
    read_override, variable, defaults, suffix, install = _COMPILERS[language]
    override = read_override()
    candidates = [override] if override else list(defaults)
    for c in candidates:
        path = shutil.which(c)
        if path:
            return path
    raise NativeBuildError(
        f"no {language} compiler in this environment (Python {platform.python_version()} at {sys.prefix}, "
        f"{platform.system()} {platform.machine()}; tried "
        f"{f'{variable}={override}' if override else ', '.join(candidates)}) to compile {name}{suffix}, "
        f"{_PURPOSE.get(name, 'a native helper of ortwrap')}. Install a {language} compiler ({install}) or point "
        f"{variable} at one"
    )


def _cpu_signature() -> bytes:
    """What ``-march=native`` code depends on: the CPU's model and feature flags (Linux), else the platform."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith((b"flags", b"model name", b"Features"))]
        return b"\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor().encode()


def _prebuilt(name: str, directory: str, src: str) -> ctypes.PyDLL | None:
    """The extension module ``setup.py`` built from ``<name>.c`` for this Python, if there is one and
    the source beside it (where present) is still the one it was built from."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(directory, name + suffix)
        if not os.path.exists(path):
            continue
        try:
            lib = ctypes.PyDLL(path)
            built = (ctypes.c_char * 65).in_dll(lib, "ortwrap_source_sha256").value.decode()
        except (OSError, ValueError) as e:  # not loadable here, or not built by setup.py
            logger.debug("%s cannot be used: %s", path, e)
            continue
        if os.path.exists(src) and built != source_digest(src):
            logger.debug("%s was built from another %s.c: compiling the source instead", path, name)
            return None
        LOADED[name] = path
        return lib
    return None


@cache
def load(name: str, directory: str = _HERE, native_code: bool = False) -> ctypes.PyDLL:
    """Load ``<directory>/<name>.c``'s prebuilt extension module, or compile the file (once, cached on
    disk) and load that.

    ``native_code``: never prebuilt; compile with ``-O3 -march=native`` for the CPU it runs on (the
    cache key then includes the CPU's model and feature flags, so a shared cache never serves another
    CPU's code).

    Raises:
        NativeBuildError: no compiler, or the compilation failed (the compiler's output is included).
    """
    src = os.path.join(directory, f"{name}.c")
    if not native_code:
        lib = _prebuilt(name, directory, src)
        if lib is not None:
            return lib
    with open(src, "rb") as f:
        source = f.read()
    for header in HEADERS:
        with open(header, "rb") as f:
            source += f.read()
    include = sysconfig.get_paths()["include"]
    # -fno-trapping-math: without it GCC 12 does not if-convert the kernels' selects (GELU's sign
    # branches, exp's underflow clamp) on AVX2-only CPUs, and their loops stay scalar: 4.3x slower
    # GELU on an AMD EPYC without AVX-512 (AVX-512's masked ops vectorize either way). The kernels
    # never read floating-point exception flags.
    flags = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math"] if native_code else ["-O2"]
    key = hashlib.sha256(source + sys.version.encode() + platform.platform().encode() + include.encode())
    key.update(" ".join(flags).encode() + (_cpu_signature() if native_code else b""))
    lib = _compile(
        name, src, key.hexdigest(), _compiler(name), [*flags, "-Wall", f"-I{include}"], ["-ldl", "-lpthread", "-lm"]
    )
    LOADED[name] = lib
    return ctypes.PyDLL(lib)  # PyDLL: calls from Python keep the GIL; py_object arguments allowed


def _compile(name: str, src: str, digest: str, compiler: str, flags: list[str], libs: list[str]) -> str:
    """Compile ``src`` into the cache as ``<name>-<digest[:16]>.so`` unless it is there; its path."""
    cache = cache_dir()
    os.makedirs(cache, exist_ok=True)
    lib = os.path.join(cache, f"{name}-{digest[:16]}.so")
    if os.path.exists(lib):
        return lib
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    cmd = [compiler, "-shared", "-fPIC", *flags, src, "-o", tmp, *libs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise NativeBuildError(f"compiling {os.path.basename(src)} failed: {' '.join(cmd)}\n{proc.stderr.strip()}")
        os.replace(tmp, lib)  # atomic: concurrent builders (ranks) agree on the result
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@cache
def load_torch_cxx(name: str, directory: str, torch_dir: str, torch_version: str, cxx11_abi: bool) -> ctypes.CDLL:
    """Compile ``<directory>/<name>.cpp`` against the C++ API of the torch installed at ``torch_dir``
    (its headers; linked to its ``libc10``), once per source, torch release and compiler (cached on
    disk), and load it. No Python in it: a plain ``CDLL``.

    Raises:
        NativeBuildError: no C++ compiler, no torch headers, or the compilation failed.
    """
    src = os.path.join(directory, f"{name}.cpp")
    include, libdir = os.path.join(torch_dir, "include"), os.path.join(torch_dir, "lib")
    if not os.path.isdir(os.path.join(include, "c10")):
        raise NativeBuildError(
            f"torch {torch_version} at {torch_dir} ships no C++ headers ({include}/c10) to compile {name}.cpp"
        )
    compiler = _compiler(name, "C++")
    flags = ["-O2", "-std=c++17", "-Wall", f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}", f"-I{include}"]
    with open(src, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + torch_version.encode() + torch_dir.encode() + compiler.encode())
    key.update(" ".join(flags).encode() + platform.platform().encode())
    lib = _compile(name, src, key.hexdigest(), compiler, flags, [f"-L{libdir}", "-lc10", f"-Wl,-rpath,{libdir}"])
    LOADED[name] = lib
    return ctypes.CDLL(lib)
