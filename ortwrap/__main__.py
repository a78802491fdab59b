"""``python -m ortwrap``: what to paste into a bug report, and the build cache's upkeep.

python -m ortwrap env            # versions, CPU and its flags, native kernels, cache, torch range
python -m ortwrap cache info     # where the build cache is, its entries and size, its cap
python -m ortwrap cache clear    # delete every entry
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import time

#: Distributions ``env`` reports (the first found of each row).
_DISTS = (
    ("torch", ("torch",)),
    ("onnxruntime", ("onnxruntime-training-cpu", "onnxruntime-training", "onnxruntime")),
    ("onnx", ("onnx",)),
    ("onnxscript", ("onnxscript",)),
    ("onnx-ir", ("onnx-ir",)),
    ("transformers", ("transformers",)),
    ("deepspeed", ("deepspeed",)),
)

#: The CPU flags ortwrap's choices depend on (kernels, ``half_compute``, ``gemm``).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def _version(dists: tuple[str, ...]) -> str:
    for dist in dists:
        try:
            return f"{importlib.metadata.version(dist)}" + ("" if dist == dists[0] else f" ({dist})")
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _cpu() -> tuple[str, list[str], str]:
    """(model name, flags, vendor) from /proc/cpuinfo (Linux), else what ``platform`` says."""
    model, flags, vendor = platform.processor() or platform.machine(), [], ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "flags" and not flags:
                    flags = value.split()
    except OSError:
        pass
    return model, flags, vendor


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def _native_status() -> list[tuple[str, str]]:
    """Whether each native helper compiles and loads here (building it now if needed)."""
    rows = []
    from .bridge import _native

    for name in ("_runner", "_aten"):
        try:
            _native.load(name)
            rows.append((f"bridge/{name}.c", "ok"))
        except Exception as e:
            rows.append((f"bridge/{name}.c", f"FAILED: {type(e).__name__}: {e}"))
    try:
        from . import kernels

        lib = kernels.install()
        gemm = getattr(lib, "ortwrap_bf16_gemm", None)
        rows.append(("kernels/_cpu.c (CPU kernels)", f"ok (bf16 attention GEMM: {gemm or 'none'})"))
    except Exception as e:
        rows.append(("kernels/_cpu.c (CPU kernels)", f"FAILED: {type(e).__name__}: {e} (ONNX Runtime's kernels run)"))
    return rows


def env(out=sys.stdout) -> None:
    """Print what a bug report needs (``python -m ortwrap env``)."""
    from . import __version__
    from ._compat.torch import CHECKED_RELEASES, SUPPORTED_RANGE
    from .build.cache import entries_info
    from .options import Options, build_cache_dir, build_cache_max_bytes, cache_dir

    w = out.write
    w(f"ortwrap: {__version__} ({os.path.dirname(os.path.abspath(__file__))})\n")
    w(f"python: {platform.python_version()} ({sys.executable})\n")
    w(f"platform: {platform.platform()}\n")
    for label, dists in _DISTS:
        version = _version(dists)
        if label == "torch":
            import torch

            version = torch.__version__  # with its local tag (+cpu, +cu130): which build
        w(f"{label}: {version}\n")
    w(f"supported torch: {SUPPORTED_RANGE} (tested on {', '.join(CHECKED_RELEASES)})\n")
    model, flags, vendor = _cpu()
    w(f"cpu: {model}{f' ({vendor})' if vendor else ''}, {os.cpu_count()} logical cores\n")
    present = set(flags)
    w("cpu flags: " + ", ".join(f"{f} {'yes' if f in present else 'no'}" for f in CPU_FLAGS) + "\n")
    try:
        import torch

        w(f"torch threads: {torch.get_num_threads()}, cuda: {torch.cuda.is_available()}\n")
        o = Options.resolve()
        w(
            f"threads: ORT intra-op {o.intra_op_threads or torch.get_num_threads()} "
            f"({'intra_op_threads' if o.intra_op_threads else 'torch.get_num_threads(); 1 for a CPU training graph of small kernels'}), ORT spinning "
            f"{'on' if o.allow_spinning else 'off'}; PyTorch's OpenMP: OMP_WAIT_POLICY="
            f"{os.environ.get('OMP_WAIT_POLICY', 'unset')} (docs/performance.md, Threads)\n"
        )
    except Exception as e:  # pragma: no cover
        w(f"torch: cannot import ({type(e).__name__}: {e})\n")
    for name, status in _native_status():
        w(f"native {name}: {status}\n")
    w(f"native helper cache (ORTWRAP_CACHE_DIR): {cache_dir()}\n")
    directory = build_cache_dir()
    rows = entries_info(directory)
    w(
        f"build cache (ORTWRAP_BUILD_CACHE_DIR): {directory}: {len(rows)} entries, "
        f"{_size(sum(r[1] for r in rows))} of {_size(build_cache_max_bytes())}\n"
    )
    w(f"ORTWRAP_* set: {', '.join(sorted(k for k in os.environ if k.startswith('ORTWRAP_'))) or 'none'}\n")


def cache_info(out=sys.stdout) -> None:
    """Print the build cache's location, entries and size (``python -m ortwrap cache info``)."""
    from .build.cache import entries_info
    from .options import build_cache_dir, build_cache_max_bytes, build_cache_secret_path

    directory = build_cache_dir()
    rows = entries_info(directory)
    total = sum(size for _, size, _ in rows)
    out.write(f"build cache: {directory}\n")
    out.write(
        f"entries: {len(rows)}, {_size(total)} (cap {_size(build_cache_max_bytes())}, ORTWRAP_BUILD_CACHE_MAX_MB)\n"
    )
    out.write(f"signing secret: {build_cache_secret_path()[0]}\n")
    now = time.time()
    for path, size, used in rows:
        out.write(f"  {os.path.basename(path)}  {_size(size):>10}  used {(now - used) / 3600:.1f} h ago\n")


def cache_clear(out=sys.stdout) -> None:
    """Delete every build cache entry (``python -m ortwrap cache clear``)."""
    from .build.cache import clear
    from .options import build_cache_dir

    directory = build_cache_dir()
    out.write(f"removed {clear(directory)} entries from {directory}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ortwrap", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="versions, CPU flags, native kernels, cache: paste this into bug reports")
    cache = sub.add_parser("cache", help="the build cache")
    cache.add_argument("action", choices=("info", "clear"))
    args = parser.parse_args(argv)
    if args.command == "env":
        env()
    elif args.action == "info":
        cache_info()
    else:
        cache_clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
