"""PyTorch's OpInfo samples through ortwrap, under both exporters (issue 24).

For every op of ``torch.testing._internal.common_methods_invocations.op_db`` with autograd and
float32 on CPU, the first ``--samples`` samples (2 by default) each become a module whose tensor
inputs are its forward's arguments (the ones OpInfo makes require grad keep requiring it; the other
arguments are constants). ``ORTWrap(module, fallback=False, exporter=...)`` runs it; its outputs and
input gradients are compared with eager PyTorch at ``torch.testing.assert_close``'s float32
tolerances. Where they disagree, a float64 eager run judges: ortwrap passes where it is at least
(about) as close to float64 as eager float32 is.

Outcome per case (key ``op[.variant]#sample|exporter``):

- ``PASS``: outputs and gradients agree (``NONDET`` for a random op: shapes, dtypes and which
  gradients exist agree; the values are not compared);
- ``REFUSED: <reason>``: ortwrap raised an error at build or run (the reason is its class and first
  line);
- ``WRONG: <what>``: it ran and gave different numbers, shapes, dtypes or grad-ness: never allowed;
- ``CRASH: <signal>``: the process died (each op runs in a forked child, so the sweep survives it);
  ``TIMEOUT`` likewise.

A sample that eager PyTorch itself cannot run forward and backward is left out.

``tests/opinfo_expected.json`` holds the expected outcome of every case; ``tests/test_opinfo.py``
checks the whole table (slow) and a quick subset (default). Regenerate (or merge in the cases of some
ops) with::

    OMP_NUM_THREADS=1 nice -n 10 python tests/opinfo_sweep.py --update [--ops abs,std ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
import traceback
import types
import unittest
import warnings
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = os.path.join(HERE, "opinfo_expected.json")
EXPORTERS = ("dynamo", "torchscript")
SAMPLES = 2
CASE_TIMEOUT_S = 600.0


def op_db():
    """OpInfo's op list (``expecttest``, which its test utilities import, is stubbed where absent)."""
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            stub = types.ModuleType("expecttest")
            stub.TestCase = unittest.TestCase
            sys.modules["expecttest"] = stub
    import torch
    from torch.testing._internal.common_methods_invocations import op_db as db

    return [o for o in db if o.supports_autograd and torch.float32 in o.supported_dtypes("cpu")]


def op_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def case_key(name: str, sample: int, exporter: str) -> str:
    return f"{name}#{sample}|{exporter}"


# ---------------------------------------------------------------------------------------------------
# One case (in the child)


def _make_module(fn, treespec, leaves, tensor_slots, post):
    import torch
    import torch.utils._pytree as pytree

    class OpModule(torch.nn.Module):
        def forward(self, *tensors):
            flat = list(leaves)
            for slot, t in zip(tensor_slots, tensors):
                flat[slot] = t
            inp, args, kwargs = pytree.tree_unflatten(flat, treespec)
            out = post(fn(inp, *args, **kwargs))
            return tuple(x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor))

    return OpModule()


def _prepare(sample):
    """(treespec, leaves, tensor slots, tensors) of a sample's (input, args, kwargs)."""
    import torch
    import torch.utils._pytree as pytree

    leaves, spec = pytree.tree_flatten((sample.input, list(sample.args), dict(sample.kwargs)))
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    return spec, leaves, slots, [leaves[i] for i in slots]


def _fresh(tensors, dtype=None):
    import torch

    out = []
    for t in tensors:
        c = t.detach().clone()
        if dtype is not None:
            if c.is_floating_point():
                c = c.to(dtype)
            elif c.is_complex():
                c = c.to(torch.complex128)
        out.append(c.requires_grad_(t.requires_grad))
    return out


def _weights(outs):
    import torch

    g = torch.Generator().manual_seed(1234)
    return [
        torch.rand(torch.view_as_real(o.resolve_conj()).shape if o.is_complex() else o.shape, generator=g) + 0.5
        for o in outs
    ]


def _differentiable(o) -> bool:
    return (o.is_floating_point() or o.is_complex()) and o.requires_grad


def _run(module, tensors, weights=None):
    """Outputs (detached) and input gradients (None where there is none) of one forward+backward."""
    import torch

    outs = module(*tensors)
    if weights is None:
        weights = _weights(outs)
    loss = None
    for o, w in zip(outs, weights):
        if _differentiable(o):
            v = torch.view_as_real(o.resolve_conj()) if o.is_complex() else o
            term = (v * w.to(v.dtype)).sum()
            loss = term if loss is None else loss + term
    want = [t for t in tensors if t.requires_grad]
    grads = [None] * len(want)
    if loss is not None and want:
        grads = list(torch.autograd.grad(loss, want, allow_unused=True))
    return [o.detach() for o in outs], [bool(_differentiable(o)) for o in outs], grads, weights


def _err(a, b):
    import torch

    a, b = a.detach(), b.detach()
    if a.is_complex():
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.to(a.dtype).resolve_conj())
    a64, b64 = a.double(), b.double()
    both_nan = torch.isnan(a64) & torch.isnan(b64)
    same_inf = torch.isinf(a64) & (a64 == b64)
    d = (a64 - b64).abs()
    d = torch.where(both_nan | same_inf, torch.zeros_like(d), d)
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    return float(d.max()) if d.numel() else 0.0


def _judge(what, got, e32, e64) -> str | None:
    """None where ``got`` is acceptable next to eager fp32 ``e32`` (and float64 ``e64``), else why not."""
    import torch

    if got is None and e32 is None:
        return None
    if got is None or e32 is None:
        present = got if got is not None else e32
        if not bool((present == 0).all()):
            return (
                f"{what}: {'None' if got is None else 'a gradient'} where eager has {'None' if e32 is None else 'one'}"
            )
        return None
    if tuple(got.shape) != tuple(e32.shape):
        return f"{what}: shape {tuple(got.shape)} vs eager {tuple(e32.shape)}"
    if got.dtype != e32.dtype:
        return f"{what}: dtype {got.dtype} vs eager {e32.dtype}"
    if not (got.is_floating_point() or got.is_complex()):
        return None if torch.equal(got, e32) else f"{what}: integer values differ"
    try:
        torch.testing.assert_close(got, e32, equal_nan=True)
        return None
    except AssertionError:
        pass
    if e64 is None:
        return f"{what}: max abs diff {_err(got, e32):.3g} from eager"
    ref = e64.abs().double()
    ref = ref[torch.isfinite(ref)]
    scale = float(ref.max()) if ref.numel() else 0.0
    e_got, e_eager = _err(got, e64), _err(e32, e64)
    if e_got <= max(2.0 * e_eager, 1e-5 + 1.3e-6 * scale):
        return None
    return f"{what}: {e_got:.3g} from float64 (eager fp32: {e_eager:.3g})"


def _reason(e: BaseException) -> str:
    """The error's class and message, short and stable: ortwrap's phase tags, ORT's source paths,
    addresses and temporary paths dropped."""
    text = " ".join(str(e).split())
    text = re.sub(r"\[ortwrap:[a-z-]+\]\s*", "", text)
    text = re.sub(r"/onnxruntime_src/\S+ onnxruntime::.*?\[ONNXRuntimeError\] : \d+ : ", "", text)
    text = re.sub(r"/onnxruntime_src/\S+|\S+\.(cc|h|cpp):\d+\S*", "", text)
    text = re.sub(r"\. Ops in the graph: .*|If an op above lacks .*|Error in forward pass execution: ", "", text)
    text = re.sub(r"0x[0-9a-fA-F]+", "0x…", text)
    text = re.sub(r"/tmp/\S+", "/tmp/…", text)
    text = re.sub(r"\s+", " ", text).strip()
    return f"{type(e).__name__}: {text}"[:200]


def _seeded(op) -> bool:
    """A random op whose OpInfo wrapper seeds torch's generator on every call (dropout, rrelu,
    fractional max-pool, ...): eager repeats itself, ORT's generator is another."""
    code = getattr(op.op, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names


def run_case(op, sample_index: int, sample, exporter: str) -> str:
    """The outcome of one (op, sample, exporter) (see the module docstring)."""
    import torch

    from ortwrap import ORTWrap

    spec, leaves, slots, tensors = _prepare(sample)
    if any(t.layout != torch.strided for t in tensors):
        return "SKIP: sparse input"
    fn = op.op
    post = sample.output_process_fn_grad or (lambda x: x)
    module = _make_module(fn, spec, leaves, slots, post)
    # eager fp32 (twice, with different seeds: a random op's values are not compared)
    try:
        torch.manual_seed(0)
        e_outs, _, e_grads, weights = _run(module, _fresh(tensors))
        torch.manual_seed(1)
        e2_outs, _, _, _ = _run(module, _fresh(tensors))
    except Exception as e:
        return f"SKIP: eager fails: {_reason(e)}"
    if not e_outs:
        return "SKIP: no tensor output"
    if any(t.layout != torch.strided for t in e_outs):
        return "SKIP: sparse output"
    nondet = _seeded(op) or any(
        a.shape != b.shape or (a.is_floating_point() and not torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))
        for a, b in zip(e_outs, e2_outs)
    )
    try:
        d_outs, _, d_grads, _ = _run(module, _fresh(tensors, torch.float64), weights)
    except Exception:
        d_outs, d_grads = [None] * len(e_outs), [None] * len(e_grads)
    # build_cache=False: every case is the same OpModule class (its key cannot see the op it calls)
    wrapped = ORTWrap(module, fallback=False, exporter=exporter, build_cache=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            o_outs, _, o_grads, _ = _run(wrapped, _fresh(tensors), weights)
    except Exception as e:
        return f"REFUSED: {_reason(e)}"
    if len(o_outs) != len(e_outs):
        return f"WRONG: {len(o_outs)} outputs vs eager {len(e_outs)}"
    # (whether an output requires grad is not compared: where it matters, a gradient differs)
    problems = []
    for i, (o, e, d) in enumerate(zip(o_outs, e_outs, d_outs)):
        if nondet:
            if tuple(o.shape) != tuple(e.shape) or o.dtype != e.dtype:
                problems.append(f"output {i}: {tuple(o.shape)} {o.dtype} vs eager {tuple(e.shape)} {e.dtype}")
            continue
        p = _judge(f"output {i}", o, e, d if d is not None and d.shape == e.shape else None)
        if p:
            problems.append(p)
    for i, (o, e, d) in enumerate(zip(o_grads, e_grads, d_grads)):
        if nondet:
            if (o is None) != (e is None) or (o is not None and o.shape != e.shape):
                problems.append(f"grad {i}: structure differs")
            continue
        p = _judge(f"grad {i}", o, e, d if d is not None and e is not None and d.shape == e.shape else None)
        if p:
            problems.append(p)
    if problems:
        return "WRONG: " + "; ".join(problems)[:300]
    return "NONDET" if nondet else "PASS"


# ---------------------------------------------------------------------------------------------------
# The sweep (forked child per op, crash guard in the parent)


def _samples(op, n):
    import torch

    torch.manual_seed(0)
    out = []
    for s in op.sample_inputs("cpu", torch.float32, requires_grad=True):
        out.append(s)
        if len(out) >= n:
            break
    return out


def _child(op, cases, samples, out_path):
    # cases: [(sample_index, exporter)]; writes "BEGIN key" then "key\toutcome" lines.
    import torch

    torch.set_num_threads(1)
    name = op_name(op)
    try:
        ss = _samples(op, samples)
    except Exception as e:
        with open(out_path, "a") as f:
            for i, exp in cases:
                f.write(f"{case_key(name, i, exp)}\tSKIP: samples fail: {_reason(e)}\n")
        return
    with open(out_path, "a", buffering=1) as f:
        for i, exp in cases:
            key = case_key(name, i, exp)
            if i >= len(ss):
                continue
            f.write(f"BEGIN {key}\n")
            f.flush()
            os.fsync(f.fileno())
            try:
                outcome = run_case(op, i, ss[i], exp)
            except Exception as e:
                outcome = f"WRONG: harness error {_reason(e)}"
                traceback.print_exc()
            f.write(f"{key}\t{outcome}\n")
            f.flush()
            os.fsync(f.fileno())


def sweep_op(op, exporters=EXPORTERS, samples=SAMPLES, timeout=CASE_TIMEOUT_S, log=None) -> dict[str, str]:
    """Outcomes of one op's cases, each child forked (a crash or hang is recorded, the rest go on)."""
    name = op_name(op)
    todo = [(i, e) for i in range(samples) for e in exporters]
    results: dict[str, str] = {}
    while todo:
        fd, path = tempfile.mkstemp(prefix="opinfo_", suffix=".txt")
        os.close(fd)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                if log is not None:
                    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                    os.dup2(out, 1)
                    os.dup2(out, 2)
                _child(op, todo, samples, path)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        started = time.monotonic()
        status = None
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - started > timeout * len(todo):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = "TIMEOUT"
                break
            time.sleep(0.05)
        begun = None
        with open(path) as f:
            for line in f:
                line = line.rstrip("\n")
                if line.startswith("BEGIN "):
                    begun = line[6:]
                elif "\t" in line:
                    k, v = line.split("\t", 1)
                    results[k] = v
                    begun = None
        os.unlink(path)
        finished = {k for k in results}
        if begun is not None:
            if status == "TIMEOUT":
                results[begun] = "TIMEOUT"
            elif os.WIFSIGNALED(status):
                results[begun] = f"CRASH: {signal.Signals(os.WTERMSIG(status)).name}"
            else:
                results[begun] = f"CRASH: exit {os.waitstatus_to_exitcode(status)}"
            finished.add(begun)
        remaining = [(i, e) for i, e in todo if case_key(name, i, e) not in finished]
        if begun is None or remaining == todo:
            break  # the child finished its list (a case past the op's samples is no case)
        todo = remaining
    return results


def sweep(names=None, exporters=EXPORTERS, samples=SAMPLES, progress=None, log=None, shard=(0, 1)) -> dict[str, str]:
    """Outcomes of the ops named (all by default); ``shard=(k, n)`` takes every n-th op from the k-th."""
    ops = op_db()
    if names is not None:
        wanted = set(names)
        ops = [o for o in ops if op_name(o) in wanted or o.name in wanted]
    ops = ops[shard[0] :: shard[1]]
    results = {}
    for n, op in enumerate(ops):
        r = sweep_op(op, exporters, samples, log=log)
        results.update(r)
        if progress:
            progress(n, len(ops), op_name(op), r)
    return results


def status(outcome: str) -> str:
    return outcome.split(":", 1)[0]


def load_expected() -> dict[str, str]:
    if not os.path.exists(EXPECTED):
        return {}
    with open(EXPECTED) as f:
        return json.load(f)


def save_expected(table: dict[str, str]) -> None:
    with open(EXPECTED, "w") as f:
        json.dump(dict(sorted(table.items())), f, indent=0, sort_keys=True)
        f.write("\n")


def totals(table: dict[str, str]) -> dict[str, Counter]:
    out: dict[str, Counter] = {e: Counter() for e in EXPORTERS}
    for k, v in table.items():
        out[k.rsplit("|", 1)[1]][status(v)] += 1
    return out


def compare(results: dict[str, str], expected: dict[str, str]) -> list[str]:
    """Failures: WRONG, CRASH, TIMEOUT, and a status (PASS / NONDET / REFUSED / SKIP) unlike the table's."""
    bad = []
    for k, v in sorted(results.items()):
        s = status(v)
        if s in ("WRONG", "CRASH", "TIMEOUT"):
            bad.append(f"{k}: {v}")
        elif k not in expected:
            bad.append(f"{k}: {v} (not in the table)")
        elif status(expected[k]) != s:
            bad.append(f"{k}: {v} (the table has {expected[k]})")
    return bad


def _with_fixed_hash_seed() -> None:
    """Re-run this script with ``PYTHONHASHSEED=0``: some OpInfo sample functions iterate over sets
    of strings (``meshgrid``'s ``{'xy', 'ij'}``), so which sample is ``#0`` depends on the hash seed."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})


def main(argv=None):
    if argv is None:
        _with_fixed_hash_seed()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="comma-separated op names (op or op.variant); default: all")
    p.add_argument("--exporters", default=",".join(EXPORTERS))
    p.add_argument("--samples", type=int, default=SAMPLES)
    p.add_argument("--update", action="store_true", help="merge the outcomes into tests/opinfo_expected.json")
    p.add_argument("--out", help="also write the outcomes (JSON lines as they come) here")
    p.add_argument("--log", help="children's stdout/stderr go here (default: /dev/null)", default=os.devnull)
    p.add_argument("--shard", default="0/1", help="K/N: every N-th op from the K-th (run N of them side by side)")
    a = p.parse_args(argv)
    k, n = (int(v) for v in a.shard.split("/"))
    warnings.filterwarnings("ignore")
    names = a.ops.split(",") if a.ops else None
    exporters = tuple(a.exporters.split(","))
    expected = load_expected()
    sink = open(a.out, "a", buffering=1) if a.out else None

    def progress(n, total, name, r):
        for k, v in sorted(r.items()):
            print(f"[{n + 1}/{total}] {k}: {v}", flush=True)
            if sink:
                sink.write(json.dumps({k: v}) + "\n")
        if a.update:  # merge as it goes: an interrupted sweep keeps what finished
            expected.update({k: v for k, v in r.items() if status(v) != "SKIP"})
            save_expected(expected)

    results = sweep(names, exporters, a.samples, progress, log=a.log, shard=(k, n))
    for e, c in totals({k: v for k, v in results.items() if status(v) != "SKIP"}).items():
        if e in exporters:
            print(e, dict(c))
    bad = compare({k: v for k, v in results.items() if status(v) != "SKIP"}, load_expected())
    for b in bad:
        print("FAIL", b)
    return 1 if any(status(b.split(": ", 1)[1]) in ("WRONG", "CRASH", "TIMEOUT") for b in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
