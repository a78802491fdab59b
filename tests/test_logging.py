"""ortwrap logs like a library (issue 23, sections 3-5): the ``ortwrap`` logger propagates to the
application's handlers and keeps the levels the user set; verbosity is one setting for the process;
a build says nothing at WARNING, and at INFO shows progress while a long stage runs, then one
summary line; ONNX Runtime's C++ log shows only at DEBUG; a batch of a bad shape gets eager's error
without torch's capture logs and without a new export each time; errors and FallbackWarnings name
the user's code; ORTModule's variables with a direct equivalent are read, with a warning."""

from __future__ import annotations

import copy
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from parity import assert_close
from torch import nn

import ortwrap
from ortwrap import FallbackWarning, Options, ORTWrap
from ortwrap import _logging as ortwrap_logging
from ortwrap.errors import PassError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGGER = logging.getLogger("ortwrap")


@pytest.fixture(autouse=True)
def _keep_verbosity():
    level = LOGGER.level
    yield
    LOGGER.setLevel(level)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return [out.detach(), *[p.grad.clone() for p in model.parameters()]]


# ------------------------------------------------------------------------------------ the user's settings


def test_the_ortwrap_logger_propagates_and_keeps_the_users_level():
    LOGGER.setLevel(logging.ERROR)
    LOGGER.propagate = True
    ORTWrap(MLP())
    ORTWrap(MLP(), fallback=False)
    assert LOGGER.level == logging.ERROR, "ORTWrap() changed the level the user set on the 'ortwrap' logger"
    assert LOGGER.propagate, "ORTWrap() stopped the 'ortwrap' logger from propagating to the user's handlers"
    assert any(isinstance(h, logging.NullHandler) for h in LOGGER.handlers)


def test_a_build_logs_one_summary_line_to_the_applications_handlers(caplog, capsys, exporter):
    caplog.set_level(logging.INFO, logger="ortwrap")  # (caplog's handler is the root's: records must propagate)
    w = ORTWrap(MLP(), exporter=exporter, build_cache=False)
    eager = copy.deepcopy(w.module)
    x = torch.randn(5, 4)
    for a, b in zip(_step(w, x), _step(eager, x)):
        assert_close(a, b, "a step")
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ortwrap")]
    assert [m for m in lines if m.startswith("built training program for MLP in")], lines
    assert len(lines) == 1, f"one summary line per build at INFO, got {lines}"
    assert "[ortwrap" not in capsys.readouterr().err, "printed to stderr as well as to the application's handler"


def test_log_level_option_takes_ints_and_critical_and_is_not_undone_by_the_next_wrapper():
    with pytest.warns(FutureWarning, match=r"set_verbosity"):
        ORTWrap(MLP(), log_level=logging.INFO)
    assert ortwrap.get_verbosity() == logging.INFO
    ORTWrap(MLP())  # a later wrapper that does not say
    assert ortwrap.get_verbosity() == logging.INFO, "the next wrapper undid the first one's log_level"
    with pytest.warns(FutureWarning):
        w = ORTWrap(MLP(), log_level="CRITICAL")
    assert ortwrap.get_verbosity() == logging.CRITICAL
    ortwrap.set_verbosity("warning")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy.deepcopy(w)  # a copy of a wrapper made with log_level does not set the verbosity again
    assert ortwrap.get_verbosity() == logging.WARNING
    with pytest.raises(ValueError, match=r"allowed: DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        ortwrap.set_verbosity("LOUD")


def test_ranks_other_than_zero_pass_on_only_warnings_and_errors(caplog, monkeypatch):
    import torch.distributed as dist

    caplog.set_level(logging.INFO, logger="ortwrap")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    ortwrap_logging.logger.info("an info line on rank 1")
    ortwrap_logging.progress.info("a progress line on rank 1")
    ortwrap_logging.logger.warning("a warning on rank 1")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    ortwrap_logging.logger.info("an info line on rank 0")
    seen = [r.getMessage() for r in caplog.records]
    assert seen == ["a warning on rank 1", "an info line on rank 0"], seen


class Slow(nn.Module):
    """Its forward (run by the capture) takes a while: progress must show while it runs."""

    def __init__(self, records: list[logging.LogRecord], seen_during: list[int]) -> None:
        super().__init__()
        self.l = nn.Linear(4, 3)
        self.records, self.seen_during = records, seen_during

    def forward(self, x):
        time.sleep(0.5)
        self.seen_during.append(sum("still in" in r.getMessage() for r in self.records))
        return self.l(x)


def test_a_long_build_shows_progress_while_the_slow_stage_runs(caplog, monkeypatch, exporter):
    monkeypatch.setattr(ortwrap_logging, "PROGRESS_EVERY_S", 0.1)
    caplog.set_level(logging.INFO, logger="ortwrap")
    seen_during: list[int] = []
    w = ORTWrap(Slow(caplog.records, seen_during), exporter=exporter, build_cache=False)
    w(torch.randn(5, 4)).sum().backward()
    assert seen_during and max(seen_during) > 0, "no progress line while the capture ran"
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ortwrap")]
    assert any(re.match(r"building training program for Slow: still in export \(\d+ s so far\)", m) for m in lines)
    summaries = [m for m in lines if m.startswith("built ")]
    assert len(summaries) == 1 and lines[-1] == summaries[0], lines


# ------------------------------------------------------------------------------------ what a user sees

_SCRIPT = textwrap.dedent(
    """
    import logging, sys, time
    import torch
    from torch import nn
    import ortwrap

    class M(nn.Module):
        def __init__(self, slow):
            super().__init__()
            self.l, self.n = nn.Linear(4, 3), nn.LayerNorm(3)
            self.slow = slow
        def forward(self, x):
            time.sleep(self.slow)  # (run by the capture only)
            self.slow = 0.0
            return nn.functional.gelu(self.n(self.l(x))).sum()

    def build(level):
        print(f"--- {level}", file=sys.stderr, flush=True)
        torch.manual_seed(0)
        # (the build at WARNING is a long one: progress must not print there either)
        w = ortwrap.ORTWrap(M(3.5 if level == "WARNING" else 0.0), exporter=sys.argv[1], build_cache=False)
        w(torch.randn(5, 4)).backward()
        w(torch.randn(6, 4)).backward()
        sys.stderr.flush()

    build("WARNING")
    ortwrap.set_verbosity("INFO")
    build("INFO")
    ortwrap.set_verbosity(logging.DEBUG)
    build("DEBUG")
    """
)


def test_what_a_script_prints_at_each_verbosity(exporter, tmp_path):
    """No logging set up by the script: nothing at WARNING; one line at INFO, without ORT's C++ log;
    ORT's C++ log at DEBUG."""
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("ORTWRAP_LOG_LEVEL", None)
    done = subprocess.run(
        [sys.executable, str(script), exporter], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sections = dict(re.findall(r"--- (\w+)\n(.*?)(?=--- |\Z)", done.stderr, re.S))
    assert sections["WARNING"] == "", f"a normal build printed at WARNING:\n{sections['WARNING'][:3000]}"
    info = sections["INFO"].splitlines()
    assert len(info) == 1 and info[0].startswith("[ortwrap INFO] built training program for M in "), info[:80]
    assert "onnxruntime" in sections["DEBUG"], "ONNX Runtime's C++ log did not show at DEBUG"


# ------------------------------------------------------------------------------------ a batch of a bad shape


def test_a_bad_batch_gets_eagers_error_without_capture_logs_or_a_new_export_each_time(exporter, capfd):
    eager = MLP()
    w = ORTWrap(copy.deepcopy(eager), exporter=exporter, build_cache=False)
    x = torch.randn(5, 4)
    for a, b in zip(_step(w, x), _step(eager, x)):
        assert_close(a, b, "good batch")
    capfd.readouterr()
    exports = w.export_count
    for _ in range(3):
        with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied"):
            w(torch.randn(5, 7))
    assert w.export_count - exports <= 1, f"the same bad batch exported {w.export_count - exports} times"
    err = capfd.readouterr().err
    assert "Traceback" not in err and "fake_tensor" not in err, err[:3000]
    x = torch.randn(6, 4)
    for a, b in zip(_step(w, x), _step(eager, x)):
        assert_close(a, b, "good batch after the bad ones")
    assert w.fallback_reason is None and w.programs()


# ------------------------------------------------------------------------------------ errors name the user's code


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(10, 4, mode="mean")
        self.l = nn.Linear(4, 2)

    def forward(self, x):
        return self.l(self.bag(x))


def test_an_unsupported_op_is_named_by_module_class_and_torch_op(exporter):
    w = ORTWrap(Bag(), exporter=exporter, fallback=False, build_cache=False)
    with pytest.raises(PassError) as info:
        w(torch.randint(0, 10, (3, 5))).sum().backward()
    message = str(info.value)
    assert "module `bag` (EmbeddingBag)" in message, message
    assert message.count("[ortwrap:") == 1 and "PassError:" not in message, message
    if exporter == "dynamo":
        assert "torch op aten.embedding_bag" in message and 'aten_ops=("embedding_bag",)' in message, message
        assert "squeeze" not in message, message
        assert f"{__file__}:" in message, message  # the user's line


def test_fallback_warning_has_one_prefix_and_no_double_period(exporter):
    w = ORTWrap(Bag(), exporter=exporter, build_cache=False)
    eager = copy.deepcopy(w.module)
    x = torch.randint(0, 10, (3, 5))
    with pytest.warns(FallbackWarning) as record:
        out = w(x)
    assert_close(out, eager(x), "the fallen-back call")
    (warned,) = [w for w in record if issubclass(w.category, FallbackWarning)]
    message = str(warned.message)
    assert message.count("[ortwrap:") == 0 and not re.search(r"\w\.\.", message), message
    assert "module `bag` (EmbeddingBag)" in message, message


class ReturnsInt(torch.autograd.Function):
    """A Function with a non-tensor output: it cannot run inside ONNX Runtime."""

    @staticmethod
    def forward(ctx, x):
        return x * 2, 3

    @staticmethod
    def backward(ctx, g, _):
        return g * 2


class Unbuildable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(4, 3)

    def forward(self, x):
        h, k = ReturnsInt.apply(self.l(x))
        return h * k


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("path", ["direct", "hook", "ddp", "compile"])
def test_fallback_warning_points_at_the_users_line(path, exporter, request):
    w = ORTWrap(Unbuildable(), exporter=exporter, build_cache=False)
    eager = copy.deepcopy(w.module)
    model: nn.Module = w
    if path == "hook":
        w.register_forward_hook(lambda m, a, out: out)  # (the call goes through nn.Module.__call__)
    elif path == "ddp":
        request.getfixturevalue("one_rank_group")
        model = nn.parallel.DistributedDataParallel(w)
    elif path == "compile":
        model = torch.compile(w)
    x = torch.randn(5, 4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model(x)  # <- the user's line
    (warned,) = [r for r in record if issubclass(r.category, FallbackWarning)]
    assert (warned.filename, warned.lineno) == (__file__, _line_of("out = model(x)  # <- the user's line")), (
        f"the warning points at {warned.filename}:{warned.lineno}"
    )
    assert_close(out, eager(x), "the fallen-back call")


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.strip() == text)


# ------------------------------------------------------------------------------------ coming from ORTModule


@pytest.mark.parametrize(
    ("env", "value", "option", "expected", "own"),
    [
        ("ORTMODULE_ONNX_OPSET_VERSION", "15", "opset", 15, "ORTWRAP_OPSET"),
        ("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE", "fallback", False, "ORTWRAP_FALLBACK"),
        ("ORTMODULE_FALLBACK_POLICY", "FALLBACK_UNSUPPORTED_DATA", "fallback", True, "ORTWRAP_FALLBACK"),
        ("ORTMODULE_MEMORY_OPT_LEVEL", "1", "recompute", "layers", "ORTWRAP_RECOMPUTE"),
    ],
)
def test_ortmodule_variables_with_an_equivalent_are_read_with_a_warning(monkeypatch, env, value, option, expected, own):
    monkeypatch.setenv(env, value)
    monkeypatch.setattr(ortwrap.options, "_ortmodule_warned", set())
    with pytest.warns(FutureWarning, match=rf"{env}={value} is ORTModule's.*{option}=.*Set {own} instead"):
        assert getattr(Options.resolve(), option) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Options.resolve()  # said once
    other = {"opset": "16", "fallback": "0" if expected else "1", "recompute": "none"}[option]
    monkeypatch.setenv(own, other)
    assert getattr(Options.resolve(), option) != expected  # ortwrap's own variable wins


def test_ortmodule_log_level_sets_the_verbosity(monkeypatch):
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "VERBOSE")
    monkeypatch.setattr(ortwrap.options, "_ortmodule_warned", set())
    with pytest.warns(FutureWarning, match=r"ORTMODULE_LOG_LEVEL=VERBOSE.*set_verbosity\('DEBUG'\).*ORTWRAP_LOG_LEVEL"):
        assert ortwrap.options.env_log_level() == logging.DEBUG
    assert Options.resolve().log_level is None  # the process's verbosity (read at import), not a wrapper's option
    monkeypatch.setenv("ORTWRAP_LOG_LEVEL", "ERROR")
    assert ortwrap.options.env_log_level() == logging.ERROR


def _ortmodule_folder() -> str:
    """The installed wheel's ``onnxruntime/training/ortmodule`` (its sources are read as text: never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("onnxruntime is not installed")
    folder = os.path.join(spec.submodule_search_locations[0], "training", "ortmodule")
    if not os.path.isdir(folder):
        pytest.skip("this onnxruntime has no ortmodule sources")
    return folder


def _ortmodule_variables() -> set[str]:
    """Every ORTMODULE_* environment variable ORTModule reads."""
    folder = _ortmodule_folder()
    found: set[str] = set()
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(root, name)).read()
                found |= set(
                    re.findall(r"""(?:getenv|environ(?:\.get)?|_defined_from_envvar)\(\s*["'](ORTMODULE_\w+)""", text)
                )
                found |= set(re.findall(r"""["'](ORTMODULE_\w+)["']\s+in\s+os\.environ""", text))
                found |= set(re.findall(r"""_environment_key\s*=\s*["'](ORTMODULE_\w+)""", text))
    return found


def test_the_guide_maps_every_ortmodule_variable_and_debug_option():
    guide = open(os.path.join(ROOT, "docs", "user-guide.md")).read()
    section = guide.split("## Coming from ORTModule", 1)
    assert len(section) == 2, "docs/user-guide.md has no 'Coming from ORTModule' section"
    table = section[1].split("\n## ", 1)[0]
    variables = _ortmodule_variables()
    assert len(variables) >= 20, sorted(variables)
    missing = sorted(v for v in variables if f"`{v}`" not in table)
    assert not missing, f"ORTModule variables missing from the guide's table: {missing}"
    source = open(os.path.join(_ortmodule_folder(), "options.py")).read()
    signature = re.search(r"class DebugOptions\b.*?def __init__\(self, (.*?)\):", source, re.S).group(1)
    arguments = [a.split("=")[0].strip() for a in signature.split(",")]
    assert "save_onnx" in arguments, arguments
    missing = [a for a in arguments if f"{a}=" not in table]
    assert not missing, f"DebugOptions arguments missing from the guide's table: {missing}"
    for env in ortwrap.options.ORTMODULE_ENV_VARS:
        assert re.search(rf"`{env}`[^\n]*read", table), f"the table does not say that {env} is read"


def test_node_origin_reads_what_each_exporter_records():
    from ortwrap.errors import describe_origin, node_origin

    dynamo = {
        "pkg.torch.onnx.name_scopes": "['', 'module', 'module.enc', 'module.enc.bag', 'embedding_bag']",
        "pkg.torch.onnx.class_hierarchy": "['ortwrap.export.adapter.Adapter', 'model.Net', 'model.Encoder', "
        "'torch.nn.modules.sparse.EmbeddingBag', 'aten.embedding_bag.padding_idx']",
        "pkg.torch.onnx.stack_trace": 'File "/x/ortwrap/api.py", line 3, in forward\n    f()\n'
        'File "/home/u/model.py", line 12, in forward\n    return self.bag(x)\n'
        'File "/x/torch/nn/modules/sparse.py", line 9, in forward\n    F.embedding_bag()',
    }
    origin = node_origin("n19_2", dynamo)
    assert origin == {
        "path": "enc.bag",
        "cls": "EmbeddingBag",
        "op": "aten.embedding_bag",
        "line": "/home/u/model.py:12",
    }
    assert describe_origin(origin) == (
        "module `enc.bag` (EmbeddingBag), torch op aten.embedding_bag, at /home/u/model.py:12"
    )
    top = {"pkg.torch.onnx.name_scopes": "['', 'module', 'squeeze']",
           "pkg.torch.onnx.class_hierarchy": "['ortwrap.export.adapter.Adapter', 'model.Net', 'aten.squeeze.dim']"}  # fmt: skip
    assert describe_origin(node_origin("n3", top)) == "the wrapped module (Net), torch op aten.squeeze"
    assert node_origin("/module/enc/bag/Loop", {}) == {"path": "enc.bag"}
    assert node_origin("Loop_7", {}) == {}


def test_the_hint_for_embedding_bag_trains_it_like_eager(exporter):
    from parity import check_parity

    def inputs(batch: int, g: torch.Generator):
        return (torch.randint(0, 10, (batch, 5), generator=g),), {}

    w = check_parity(Bag, inputs, wrap_options={"aten_ops": ("embedding_bag",), "fallback": False})
    assert w.fallback_reason is None and w.programs()
