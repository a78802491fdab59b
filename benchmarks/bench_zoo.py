"""The model zoo benchmark (issue 26): eager, ``torch.compile`` and ortwrap training steps on every
architecture of the coverage suite (``tests/model_zoo.py``), fp32 and bf16 autocast, 1 thread and
all cores, with the geometric mean of the ratios on the last line.

    python benchmarks/bench_zoo.py                 # the full run: every model, fp32+bf16, 1 thread + all cores
    python benchmarks/bench_zoo.py --quick         # 6 models, fp32+bf16, 1 thread (~10-15 min on 2 idle cores)
    python benchmarks/bench_zoo.py --models gpt2,bert --dtypes fp32 --threads 1 --no-cold
    python benchmarks/bench_zoo.py --quick --engine onnxruntime   # ortwrap's path on engine="onnxruntime"
    python benchmarks/bench_zoo.py --quick --paths eager,ortwrap  # without torch.compile

Per model and configuration (dtype x threads):

- **steady step**: one process builds the three paths from the same seed (same weights), on the case's
  inputs at ``--batch``, each with its own AdamW (``lr=1e-3, eps=1e-5``), and times training steps
  (forward under ``torch.autocast("cpu", bfloat16)`` for bf16, loss, backward, AdamW step, zero_grad)
  INTERLEAVED (``_harness.interleaved``: every round runs each path once, rotating the order) after
  ``--warmup`` rounds; the median of ``--iters`` rounds and its ratio to eager. The clock is CPU
  seconds of the process (``time.process_time``) at 1 thread, which other processes on a shared machine
  do not inflate, and wall seconds with more threads (where CPU seconds would count spinning pools).
  ``torch.compile`` is the default (inductor) on the module; the optimizer step runs eagerly on all
  three paths. ortwrap is ``ORTWrap(model)`` with its defaults (``gemm="auto"``, ``half_compute="auto"``,
  fallback on: a refused graph runs eagerly and the row says ``fallback``), on ``--engine`` (default
  ``auto``: the training build where it is installed, else ``onnxruntime``; docs/engines.md); the row and
  the table name the engine that ran. One run per venv gives each engine's rows (``.venv``: training,
  ``.venv-ort``: onnxruntime); ``--render`` of both zoo.json files puts them in one table.
- **cold first step and peak RSS** (skipped with ``--no-cold``): each path again in a fresh process of
  its own, with a private, empty ``ORTWRAP_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` (ortwrap's first
  step includes compiling its C kernels, inductor's its C++ kernels), three steps; its first step
  (wall seconds; the import of torch/transformers/ortwrap not included), its peak RSS (VmHWM, MiB) and,
  after the steps, its anonymous (heap) RSS (RssAnon; file-backed library pages excluded).
  The steady-step process runs afterwards with those caches warm (it only needs them to start fast).
- the loss each path reaches after the same number of steps (the paths must agree).

Writes ``<out>/zoo.json`` (every row), ``<out>/zoo.md`` (the markdown table, with the CPU: lscpu's model
name and the avx512_bf16 / amx flags) and ``<out>/zoo.png`` (per-model ratios, one panel per
configuration; needs matplotlib: ``pip install -e '.[bench]'``). The models are the suite's tiny
configurations (hidden sizes around 32): their steps take milliseconds, so the ratios weigh each path's
fixed per-step cost (ortwrap's crossings, dynamo's guards) more than GEMM speed (bench_scale.py and
bench_amp.py measure GPT-2-small-sized LMs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from _harness import interleaved  # noqa: E402

PATHS = ("eager", "ortwrap", "compile")
#: the --quick subset (~1 CPU minute per model and dtype, most of it torch.compile's cold and warm
#: compiles and the processes' imports): decoder LM, encoder, MoE, three CNN families
QUICK = ("gpt2", "bert", "mixtral", "resnetish", "convnextish", "mobilenetv3ish")
#: from tests/model_zoo.py's FAMILY_CASES, besides every model of CASES
EXTRA = ("mistral",)


def cpu_description() -> str:
    """lscpu's model name, the core count and the bf16 flags (what the GEMM routes depend on)."""
    name, flags = "unknown CPU", []
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), name)
        flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    except (OSError, subprocess.SubprocessError):
        pass
    feats = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    missing = [f for f in ("avx512_bf16", "amx_bf16") if f not in flags]
    return f"{name}, {os.cpu_count()} cores; {' '.join(feats) or 'no AVX-512'}" + (
        f" (no {', no '.join(missing)})" if missing else ""
    )


def _case(name: str):
    from model_zoo import BY_NAME

    return BY_NAME[name]


def _loss_of(case):
    from parity import default_loss

    return case.loss or default_loss


def build(case, path: str, *, exporter: str | None = None, options: dict | None = None):
    """The case's model (seed 0: the same weights on every path and in every process) as ``path`` runs it."""
    torch.manual_seed(0)
    model = case.make_model()
    if path == "compile":
        return torch.compile(model)
    if path == "ortwrap":
        from ortwrap import ORTWrap

        return ORTWrap(model, **({"exporter": exporter} if exporter else {}), **(options or {}))
    return model


def make_step(case, model, args, kwargs, amp: bool):
    """One training step (forward, loss, backward, AdamW, zero_grad); ``step.loss`` is the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    loss_of = _loss_of(case)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = loss_of(model(*args, **kwargs))
        loss.float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step.loss = loss.detach()

    step.loss = None
    return step


def _ortwrap_notes(model) -> dict:
    out = {}
    engine = getattr(model, "_engine", False)
    if engine is not False:  # (an ORTWrap: None is the training engine's own path)
        out["engine"] = "training" if engine is None else engine.name
    reason = getattr(model, "fallback_reason", None)
    if reason is not None:
        out["fallback"] = str(reason).splitlines()[0][:200]
    arts = getattr(model, "last_artifacts", None)
    choice = getattr(arts, "gemm_choice", None)
    if choice is not None:
        out["gemm"] = choice.summary()
    return out


def measure(
    case,
    *,
    dtype: str = "fp32",
    threads: int = 1,
    paths=PATHS,
    warmup: int = 2,
    iters: int = 10,
    batch: int = 4,
    exporter: str | None = None,
    options: dict | None = None,
) -> dict:
    """One row: ``paths`` of ``case`` interleaved in this process (see the module docstring).

    The row has, per path ``p``: ``p_ms`` (median step), ``p_iqr_ms``, ``p_first_s`` (first step, in this
    process: cold only if its caches are), ``p_loss`` (the loss of the last step; every path ran
    ``1 + warmup + iters`` steps), ``p_error`` if it failed (then no timing); ``p_ratio`` = ``p_ms /
    eager_ms`` for every path but eager; ``ortwrap_fallback`` / ``ortwrap_gemm`` (its GEMM choice)."""
    torch.set_num_threads(threads)
    amp = dtype == "bf16"
    args, kwargs = case.make_inputs(batch, torch.Generator().manual_seed(1))
    row: dict = {"model": case.name, "dtype": dtype, "threads": threads, "batch": batch}
    clock = time.process_time if threads == 1 else time.perf_counter
    row["clock"] = "cpu" if threads == 1 else "wall"
    steps = {}
    for path in paths:
        try:
            model = build(case, path, exporter=exporter, options=options)
            step = make_step(case, model, args, kwargs, amp)
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                step()
            row[f"{path}_first_s"] = time.perf_counter() - t0
            row[f"{path}_first_loss"] = float(step.loss)
        except Exception as e:  # the row reports it; the other paths still run
            row[f"{path}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            continue
        if path == "ortwrap":
            row.update({f"ortwrap_{k}": v for k, v in _ortwrap_notes(model).items()})
        steps[path] = step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = interleaved(steps, warmup=warmup, iters=iters, clock=clock)
    for path, ts in times.items():
        row[f"{path}_ms"] = statistics.median(ts) * 1e3
        q1, _, q3 = statistics.quantiles(ts, n=4) if len(ts) > 1 else (ts[0],) * 3
        row[f"{path}_iqr_ms"] = [q1 * 1e3, q3 * 1e3]
        row[f"{path}_loss"] = float(steps[path].loss)
    if "eager_ms" in row:
        for path in times:
            if path != "eager":
                row[f"{path}_ratio"] = row[f"{path}_ms"] / row["eager_ms"]
    return row


def cold(case, path: str, *, dtype: str, threads: int, batch: int, steps: int = 3, options: dict | None = None) -> dict:
    """In a fresh process (its caches set by the parent): the first step and peak RSS of one path."""
    torch.set_num_threads(threads)
    args, kwargs = case.make_inputs(batch, torch.Generator().manual_seed(1))
    model = build(case, path, options=options)
    step = make_step(case, model, args, kwargs, dtype == "bf16")
    out: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        out["first_s"], out["first_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        for _ in range(steps - 1):
            step()
    if path == "ortwrap":
        out.update(_ortwrap_notes(model))
    with open("/proc/self/status") as f:
        status = {
            ln.split(":")[0]: int(ln.split()[1]) / 1024 for ln in f if ln.startswith(("VmHWM:", "RssAnon:", "RssFile:"))
        }
    out["peak_rss_mib"] = status["VmHWM"]
    # after the steps: the heap (anonymous) and the library pages mapped from files (shared between
    # processes; ORT's and the exporters' code), see docs/performance.md "Peak memory"
    out["anon_rss_mib"], out["file_rss_mib"] = status.get("RssAnon"), status.get("RssFile")
    return out


# ------------------------------------------------------------------------------ the parent


def _child(job: dict, env: dict, timeout: float) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
    return {"error": tail[0][:200]}


def run_config(name: str, dtype: str, threads: int, a) -> dict:
    """Cold children (unless --no-cold), then the interleaved child, for one model and configuration."""
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONHASHSEED="0")
        env["ORTWRAP_CACHE_DIR"] = os.path.join(tmp, "ortwrap")
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
        env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        base = {"model": name, "dtype": dtype, "threads": threads, "batch": a.batch, "engine": a.engine}
        colds = {}
        if not a.no_cold:
            for path in a.paths:
                try:
                    colds[path] = _child({**base, "kind": "cold", "path": path}, env, a.timeout)
                except subprocess.TimeoutExpired:
                    colds[path] = {"error": f"timeout ({a.timeout} s)"}
        try:
            job = {**base, "kind": "measure", "warmup": a.warmup, "iters": a.iters, "paths": a.paths}
            row = _child(job, env, a.timeout)
        except subprocess.TimeoutExpired:
            row = {"error": f"timeout ({a.timeout} s)"}
    row = {**base, **row}
    for path, c in colds.items():
        if "error" in c:
            row[f"{path}_cold_error"] = c["error"]
            continue
        row[f"{path}_cold_first_s"] = c["first_s"]
        row[f"{path}_peak_rss_mib"] = c["peak_rss_mib"]
        row[f"{path}_anon_rss_mib"] = c.get("anon_rss_mib")
        if path == "ortwrap":  # the cold build made the choice (a build loaded from the cache keeps none)
            row.setdefault("ortwrap_gemm", c.get("gemm"))
            row.setdefault("ortwrap_engine", c.get("engine"))
            if c.get("fallback"):
                row.setdefault("ortwrap_fallback", c["fallback"])
    return row


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _f(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def _mark(r: dict, path: str) -> str:
    if r.get(f"{path}_error") or r.get("error"):
        return "error"
    if path == "ortwrap" and r.get("ortwrap_fallback"):
        return "fallback"
    return ""


def _rss(r: dict, path: str) -> str:
    """``peak (anon)``: the peak RSS and, after the steps, its anonymous part (MiB)."""
    anon = r.get(f"{path}_anon_rss_mib")
    return _f(r.get(f"{path}_peak_rss_mib"), ".0f") + (f" ({anon:.0f})" if anon is not None else "")


def markdown(rows: list[dict], cpu: str, note: str) -> str:
    lines = [f"CPU: {cpu}. torch {torch.__version__}. {note}".rstrip(), ""]
    for dtype, threads in sorted({(r["dtype"], r["threads"]) for r in rows}, key=lambda k: (k[1], k[0] != "fp32")):
        sel = [r for r in rows if r["dtype"] == dtype and r["threads"] == threads]
        clock = "CPU" if threads == 1 else "wall"
        lines += [
            f"**{dtype}, {threads} thread{'s' * (threads > 1)}** (median step, {clock} ms; ratio to eager; "
            "first step: cold, own process, s; RSS: own process, peak MiB (anonymous after the steps))",
            "",
            "| model | engine | eager ms | ortwrap ms | compile ms | ortwrap/eager | compile/eager | ortwrap 1st s | "
            "compile 1st s | RSS eager | RSS ortwrap | RSS compile | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sel:
            note = "; ".join(
                f"{p}: {m}" + (f" ({r.get(f'{p}_error') or r.get('error') or r.get('ortwrap_fallback')})"[:90])
                for p in PATHS
                if (m := _mark(r, p))
            )
            lines.append(
                f"| {r['model']} | {_engine(r)} | {_f(r.get('eager_ms'), '.2f')} | {_f(r.get('ortwrap_ms'), '.2f')} | "
                f"{_f(r.get('compile_ms'), '.2f')} | {_f(r.get('ortwrap_ratio'), '.2f')} | "
                f"{_f(r.get('compile_ratio'), '.2f')} | {_f(r.get('ortwrap_cold_first_s'), '.1f')} | "
                f"{_f(r.get('compile_cold_first_s'), '.1f')} | {_rss(r, 'eager')} | "
                f"{_rss(r, 'ortwrap')} | {_rss(r, 'compile')} | {note} |"
            )
        lines += ["", geomean_line(sel, f"{dtype}, {threads} thread{'s' * (threads > 1)}"), ""]
    lines.append(geomean_line(rows, "all configurations"))
    return "\n".join(lines) + "\n"


def _engine(r: dict) -> str:
    """The engine ortwrap's path ran on (as resolved; the option's value if it never ran)."""
    return r.get("ortwrap_engine") or r.get("engine") or "auto"


def geomean_line(rows: list[dict], label: str) -> str:
    """The geometric mean of ortwrap/eager and compile/eager over the rows where both paths ran (a
    fallback row counts: it is what the user gets); where compile ran on no row (``--paths
    eager,ortwrap``), ortwrap/eager's over the rows with that ratio."""
    if not any("compile_ratio" in r for r in rows):
        own = [r for r in rows if "ortwrap_ratio" in r]
        left = len(rows) - len(own)
        return f"geomean ({label}, {len(own)} rows{f'; {left} without a ratio left out' if left else ''}): " + (
            f"ortwrap/eager {geomean([r['ortwrap_ratio'] for r in own]):.3f}  (compile not run)"
        )
    both = [r for r in rows if "ortwrap_ratio" in r and "compile_ratio" in r]
    o, c = geomean([r["ortwrap_ratio"] for r in both]), geomean([r["compile_ratio"] for r in both])
    left = len(rows) - len(both)
    return f"geomean ({label}, {len(both)} rows{f'; {left} without both ratios left out' if left else ''}): " + (
        f"ortwrap/eager {o:.3f}  compile/eager {c:.3f}"
    )


def plot(rows: list[dict], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    configs = sorted({(r["dtype"], r["threads"]) for r in rows}, key=lambda k: (k[1], k[0] != "fp32"))
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(configs), figsize=(4.2 * len(configs) + 1, 0.32 * len(models) + 1.6), sharey=True)
    axes = [axes] if len(configs) == 1 else list(axes)
    for ax, (dtype, threads) in zip(axes, configs):
        by = {r["model"]: r for r in rows if r["dtype"] == dtype and r["threads"] == threads}
        ys = range(len(models))
        seen = [1.0]
        for off, key, color, marker in (
            (-0.15, "ortwrap_ratio", "tab:blue", "o"),
            (0.15, "compile_ratio", "tab:orange", "s"),
        ):
            pts = [(y + off, by[m][key]) for y, m in zip(ys, models) if key in by.get(m, {})]
            seen += [v for _, v in pts]
            ax.hlines([y for y, _ in pts], 1.0, [v for _, v in pts], color=color, linewidth=2)  # from eager's 1.0
            ax.scatter([v for _, v in pts], [y for y, _ in pts], color=color, marker=marker, s=18, zorder=3,
                       label=key.replace("_ratio", "/eager"))  # fmt: skip
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlim(min(seen) / 1.3, max(seen) * 1.3)
        ax.grid(axis="x", which="both", linewidth=0.3)
        for axis in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
            axis(matplotlib.ticker.FormatStrFormatter("%.2g"))
        ax.tick_params(axis="x", which="both", labelsize=6)
        ax.set_title(f"{dtype}, {threads} thread{'s' * (threads > 1)}", fontsize=9)
        ax.set_xlabel("step time / eager (lower is faster)", fontsize=8)
        ax.set_yticks(list(ys))
        ax.set_yticklabels(models, fontsize=7)
    axes[0].invert_yaxis()  # the first model on top (the axes share y: once)
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def models_for(a) -> list[str]:
    from model_zoo import CASES

    if a.models:
        return a.models.split(",")
    if a.quick:
        return list(QUICK)
    return [c.name for c in CASES] + list(EXTRA)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"models {','.join(QUICK)}; threads: 1")
    p.add_argument("--models", default="", help="comma-separated case names of tests/model_zoo.py")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--threads", default=None, help="comma-separated: 1 and/or 'all' (default 1,all; --quick: 1)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument(
        "--engine",
        default="auto",
        choices=("auto", "training", "onnxruntime"),
        help="ORTWrap's engine on the ortwrap path (docs/engines.md)",
    )
    p.add_argument("--warmup", type=int, default=None, help="rounds before timing (default 3; --quick 2)")
    p.add_argument("--iters", type=int, default=None, help="timed rounds (default 20; --quick 10)")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of " + ",".join(PATHS))
    p.add_argument("--no-cold", action="store_true", help="skip the cold first step / peak RSS processes")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per child process")
    p.add_argument("--out", default=os.path.join(ROOT, "build", "bench-zoo"))
    p.add_argument("--note", default="", help="a line for the table's head (the machine's load, say)")
    p.add_argument("--render", default="", help="comma-separated zoo.json files: write their rows' table and plot")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.paths = [x for x in a.paths.split(",") if x]
    if a.child is not None:
        job = json.loads(a.child)
        case = _case(job["model"])
        kw = dict(dtype=job["dtype"], threads=job["threads"], batch=job["batch"])
        options = {"engine": job.get("engine", "auto")}
        if job["kind"] == "cold":
            out = cold(case, job["path"], options=options, **kw)
        else:
            paths = job.get("paths", PATHS)
            out = measure(case, warmup=job["warmup"], iters=job["iters"], paths=paths, options=options, **kw)
        print("ROW " + json.dumps(out), flush=True)
        return [out]
    if a.render:
        return render(a.render.split(","), a.out, a.note)
    a.warmup = a.warmup if a.warmup is not None else (2 if a.quick else 3)
    a.iters = a.iters if a.iters is not None else (10 if a.quick else 20)
    threads = [
        os.cpu_count() or 1 if t == "all" else int(t) for t in (a.threads or ("1" if a.quick else "1,all")).split(",")
    ]
    threads = list(dict.fromkeys(threads))
    cpu = cpu_description()
    os.makedirs(a.out, exist_ok=True)
    print(
        f"== model zoo: {cpu}; torch {torch.__version__}; threads {threads}; {a.dtypes}; engine {a.engine}", flush=True
    )
    print(
        f"{'model':<20} {'engine':<11} {'dtype':<5} {'thr':>3} {'eager ms':>9} {'ortwrap ms':>10} {'compile ms':>10} "
        f"{'ort/eag':>7} {'cmp/eag':>7} {'ort 1st':>7} {'cmp 1st':>7} {'RSS e/o/c MiB (anon)':>26}  note",
        flush=True,
    )
    rows, t_start = [], time.perf_counter()
    for th in threads:
        for dtype in a.dtypes.split(","):
            for name in models_for(a):
                r = run_config(name, dtype, th, a)
                rows.append(r)
                rss = "/".join(_f(r.get(f"{p}_peak_rss_mib"), ".0f") for p in PATHS)
                rss += " (" + "/".join(_f(r.get(f"{p}_anon_rss_mib"), ".0f") for p in PATHS) + ")"
                note = "; ".join(f"{p} {m}" for p in PATHS if (m := _mark(r, p)))
                print(
                    f"{name:<20} {_engine(r):<11} {dtype:<5} {th:>3} {_f(r.get('eager_ms'), '9.2f')} {_f(r.get('ortwrap_ms'), '10.2f')} "
                    f"{_f(r.get('compile_ms'), '10.2f')} {_f(r.get('ortwrap_ratio'), '7.2f')} "
                    f"{_f(r.get('compile_ratio'), '7.2f')} {_f(r.get('ortwrap_cold_first_s'), '7.1f')} "
                    f"{_f(r.get('compile_cold_first_s'), '7.1f')} {rss:>26}  {note}",
                    flush=True,
                )
                with open(os.path.join(a.out, "zoo.json"), "w") as f:
                    json.dump({"cpu": cpu, "torch": torch.__version__, "rows": rows}, f, indent=1)
    minutes = (time.perf_counter() - t_start) / 60
    note = f"{a.note + ' ' if a.note else ''}Run took {minutes:.1f} min{' (--quick)' * a.quick}."
    write_report(rows, cpu, a.out, note)
    return rows


def write_report(rows: list[dict], cpu: str, out: str, note: str) -> None:
    """zoo.md and zoo.png in ``out``; the geometric means, the last line the one over every row."""
    with open(os.path.join(out, "zoo.md"), "w") as f:
        f.write(markdown(rows, cpu, note))
    plotted = plot(rows, os.path.join(out, "zoo.png"), f"{cpu}; torch {torch.__version__}")
    print(f"wrote {out}/zoo.md{', zoo.png' * plotted}")
    for dtype, th in sorted({(r["dtype"], r["threads"]) for r in rows}, key=lambda k: (k[1], k[0] != "fp32")):
        print(geomean_line([r for r in rows if r["dtype"] == dtype and r["threads"] == th], f"{dtype}, {th} threads"))
    print(geomean_line(rows, "all configurations"), flush=True)


def render(paths: list[str], out: str, note: str) -> list[dict]:
    """The table and plot of earlier runs' zoo.json files (runs split by dtype or thread count, say)."""
    rows, cpus = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += data["rows"]
        cpus.append(data["cpu"])
    os.makedirs(out, exist_ok=True)
    write_report(rows, " / ".join(dict.fromkeys(cpus)), out, note)
    return rows


if __name__ == "__main__":
    main()
