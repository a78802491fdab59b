"""The build cache never serves a stale program (issue 23, section 2), keeps to its size cap, runs no
code from files it did not sign, and ``python -m ortwrap env`` / ``cache info`` / ``cache clear``.

The key is made from the capture (``ortwrap/build/cache.py``), so every edit below, each of which a key
made from the module's classes and source files missed, rebuilds: each test first shows the cache
serving the unedited code, then edits, then trains next to eager on the edited code. The user's
code lives in files written to ``tmp_path`` and imported from there; an edit rewrites a file and
reloads the module (bytecode is not written, so a reload always reads the new source), or changes
state at run time. ``test_a_helper_edited_between_processes_rebuilds`` does the same across fresh
processes, as a restarted job would.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
from torch import nn

import ortwrap.build.cache as cache
from ortwrap import ORTWrap
from ortwrap.build.cache import BuildCacheWarning

HERE = os.path.dirname(os.path.abspath(__file__))


class UserCode:
    """Files of "user code" in a directory on ``sys.path``; module names unique to the test."""

    def __init__(self, root, monkeypatch) -> None:
        self.root = root
        self.tag = uuid.uuid4().hex[:8]
        self.names: list[str] = []
        monkeypatch.syspath_prepend(str(root))

    def name(self, base: str) -> str:
        return f"{base}_{self.tag}"

    def write(self, base: str, code: str, subdir: str = "") -> None:
        directory = self.root / subdir if subdir else self.root
        directory.mkdir(parents=True, exist_ok=True)
        name = self.name(base)
        path = directory / (f"{name}.py" if not subdir else os.path.join(name, "__init__.py"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(code).replace("{tag}", self.tag))
        importlib.invalidate_caches()

    def load(self, base: str):
        """Import the module, or reload it (re-reading its file)."""
        name = self.name(base)
        if name in sys.modules:
            return importlib.reload(sys.modules[name])
        self.names.append(name)
        return importlib.import_module(name)

    def cleanup(self) -> None:
        for name in self.names:
            sys.modules.pop(name, None)


@pytest.fixture
def user(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTWRAP_BUILD_CACHE_DIR", str(tmp_path / "builds"))
    monkeypatch.setenv("ORTWRAP_BUILD_CACHE_SECRET", str(tmp_path / "secret"))
    monkeypatch.setattr(cache, "_secret", [], raising=False)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    code = UserCode(tmp_path / "src", monkeypatch)
    yield code
    code.cleanup()


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _train(make, exporter: str, x: torch.Tensor | None = None) -> bool:
    """One step of ``make()`` under ORTWrap next to eager: outputs and every gradient must match.
    Returns whether the program came from the build cache."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)) if x is None else x
    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    w = ORTWrap(make(), fallback=False, exporter=exporter)
    out_e, grads_e = _step(eager, x)
    out_o, grads_o = _step(w, x)
    torch.testing.assert_close(out_o, out_e, msg=lambda m: f"output differs from eager (a stale program?): {m}")
    assert len(grads_o) == len(grads_e)
    for a, b in zip(grads_o, grads_e):
        torch.testing.assert_close(a, b)
    return w.last_artifacts.cached


def _served_then_rebuilt(make, exporter: str, edit) -> None:
    """The cache serves the unedited code; after ``edit()`` the build is new and matches eager."""
    assert not _train(make, exporter), "the cache was not empty"
    assert _train(make, exporter), "the unedited code was not served from the cache"
    edit()
    assert not _train(make, exporter), "a program built from the code before the edit was served"


_MODEL = """
import torch
from torch import nn
import helpers_{tag} as helpers

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.l2(helpers.act(self.l1(x)))
"""


def test_a_helper_function_edited_in_another_file(user, exporter):
    user.write("helpers", "import torch\ndef act(x):\n    return torch.relu(x)\n")
    user.write("model", _MODEL)
    model = user.load("model")
    user.load("helpers")

    def edit():
        user.write("helpers", "import torch\ndef act(x):\n    return torch.tanh(x) * 10\n")
        user.load("helpers")

    _served_then_rebuilt(lambda: model.Model(), exporter, edit)


def test_a_module_constant_edited_in_another_file(user, exporter):
    user.write("helpers", "import torch\nSCALE = 2.0\ndef act(x):\n    return torch.tanh(x) * SCALE\n")
    user.write("model", _MODEL)
    model = user.load("model")
    user.load("helpers")

    def edit():
        user.write("helpers", "import torch\nSCALE = 7.0\ndef act(x):\n    return torch.tanh(x) * SCALE\n")
        user.load("helpers")

    _served_then_rebuilt(lambda: model.Model(), exporter, edit)


def test_a_module_constant_of_the_models_own_file_changed(user, exporter):
    user.write(
        "model",
        """
        import torch
        from torch import nn

        SCALE = 2.0  # a setting a script changes before training

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.l1 = nn.Linear(4, 8)
                self.l2 = nn.Linear(8, 3)

            def forward(self, x):
                return self.l2(torch.tanh(self.l1(x)) * SCALE)
        """,
    )
    model = user.load("model")

    def edit():
        model.SCALE = 7.0

    _served_then_rebuilt(lambda: model.Model(), exporter, edit)


def test_a_closure_variable_changed(user, exporter):
    user.write(
        "model",
        """
        import torch
        from torch import nn

        def _make_act():
            k = 2.0

            def act(x):
                return torch.tanh(x) * k

            def set_k(value):
                nonlocal k
                k = value

            return act, set_k

        act, set_k = _make_act()

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.l1 = nn.Linear(4, 8)
                self.l2 = nn.Linear(8, 3)

            def forward(self, x):
                return self.l2(act(self.l1(x)))
        """,
    )
    model = user.load("model")
    _served_then_rebuilt(lambda: model.Model(), exporter, lambda: model.set_k(7.0))


def test_a_monkeypatched_method(user, exporter, monkeypatch):
    user.write(
        "helpers",
        """
        import torch
        from torch import nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.l = nn.Linear(4, 8)

            def forward(self, x):
                return torch.relu(self.l(x))
        """,
    )
    user.write(
        "model",
        """
        from torch import nn
        import helpers_{tag} as helpers

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.block = helpers.Block()
                self.head = nn.Linear(8, 3)

            def forward(self, x):
                return self.head(self.block(x))
        """,
    )
    helpers = user.load("helpers")
    model = user.load("model")

    def edit():
        monkeypatch.setattr(helpers.Block, "forward", lambda self, x: torch.tanh(self.l(x)) * 3)

    _served_then_rebuilt(lambda: model.Model(), exporter, edit)


_PARENT = """
import torch
from torch import nn

class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.l2({act}(self.l1(x)))
"""


def test_a_subclass_overriding_forward_of_a_parent_defined_elsewhere(user, exporter):
    """The parent comes from an installed library (a dist-info with a version), patched in place
    without a new version, as an editable fork or a hot-fixed site-packages is."""
    lib = user.name("parentlib")
    site = user.root / "site-packages"
    (site / f"{lib}-1.0.dist-info").mkdir(parents=True)
    (site / f"{lib}-1.0.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {lib}\nVersion: 1.0\n")
    sys.path.insert(0, str(site))
    try:
        user.write("parentlib", _PARENT.replace("{act}", "torch.relu"), subdir="site-packages")
        user.write(
            "model",
            """
            import parentlib_{tag} as parentlib

            class Model(parentlib.Parent):
                def forward(self, x):
                    return super().forward(x) * 2 - 1
            """,
        )
        user.load("parentlib")
        model = user.load("model")

        def edit():
            nonlocal model
            user.write("parentlib", _PARENT.replace("{act}", "10 * torch.tanh"), subdir="site-packages")
            user.load("parentlib")
            model = user.load("model")

        _served_then_rebuilt(lambda: model.Model(), exporter, edit)
    finally:
        sys.path.remove(str(site))


def test_a_changed_transformers_config_field(user, exporter):
    transformers = pytest.importorskip("transformers")

    class LM(nn.Module):
        def __init__(self, epsilon: float) -> None:
            super().__init__()
            cfg = transformers.GPT2Config(
                vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16, layer_norm_epsilon=epsilon,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            )  # fmt: skip
            self.lm = transformers.GPT2LMHeadModel(cfg)

        def forward(self, x):
            return self.lm(input_ids=x).logits

    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(3))
    assert not _train(lambda: LM(1e-5), exporter, ids)
    # layer_norm_epsilon is built into the graph as a constant; 0.5 changes every logit
    assert not _train(lambda: LM(0.5), exporter, ids)


def test_a_changed_torch_or_transformers_version_rebuilds(user, monkeypatch):
    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 3)

        def forward(self, x):
            return torch.tanh(self.l(x))

    read = cache._dist_version
    assert not _train(Small, "torchscript")
    assert _train(Small, "torchscript")
    for dist in ("torch", "transformers"):
        monkeypatch.setattr(cache, "_dist_version", lambda d, dist=dist: "0.0.1-other" if d == dist else read(d))
        cache._versions.cache_clear()
        assert not _train(Small, "torchscript"), f"another {dist} version was served this one's program"
    monkeypatch.setattr(cache, "_dist_version", read)
    cache._versions.cache_clear()
    assert _train(Small, "torchscript")


def test_a_capture_the_key_cannot_describe_is_built_without_the_cache(user, tmp_path, monkeypatch):
    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 3)

        def forward(self, x):
            return torch.tanh(self.l(x))

    def fails(exporter, capture):
        raise RuntimeError("a capture from a torch release the key does not know")

    monkeypatch.setattr(cache, "_capture_digest", fails)
    assert not _train(Small, "torchscript")
    assert not _train(Small, "torchscript")
    assert not os.path.exists(tmp_path / "builds") or not os.listdir(tmp_path / "builds")


class ZeroDimCounter(nn.Module):
    """A 0-d int64 tensor kept as a plain attribute and one as a buffer (Funnel keeps such
    attributes: issue 28, item 5, where the build-cache key died on ``.view(torch.uint8)``)."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.l = nn.Linear(4, 3)
        self.k = torch.tensor(k)
        self.register_buffer("steps", torch.tensor(0))

    def forward(self, x):
        return self.l(x) * self.k + self.steps


def test_a_zero_dim_int64_attribute_builds_twice_and_its_value_is_keyed(user, exporter):
    x = torch.randn(5, 4)
    assert not _train(ZeroDimCounter, exporter, x)
    assert _train(ZeroDimCounter, exporter, x)  # the second build
    assert cache.tensor_digest(torch.tensor(5)) != cache.tensor_digest(torch.tensor(6))
    # the attribute is built into the graph: another value is another program
    assert not _train(lambda: ZeroDimCounter(k=5), exporter, x)
    torch.manual_seed(0)
    w = ORTWrap(ZeroDimCounter(), fallback=False, exporter=exporter)
    torch.manual_seed(0)
    eager = ZeroDimCounter()
    w.eval()
    eager.eval()
    torch.testing.assert_close(w(x), eager(x))  # an inference build of the same module


@pytest.mark.slow
def test_funnel_trains_at_three_lengths(user, exporter):
    """Issue 28, item 5, as found: transformers' Funnel, steps at lengths 8, 12 and 10 with a padded
    row; the second length's build died computing the cache key (a 0-d int64 module attribute)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.FunnelConfig(
        vocab_size=64, block_sizes=[1, 1], block_repeats=None, d_model=16, n_head=2, d_head=8, d_inner=32,
        num_decoder_layers=1, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.FunnelForSequenceClassification(cfg)
    torch.manual_seed(0)
    eager = transformers.FunnelForSequenceClassification(cfg)
    w = ORTWrap(model, fallback=False, exporter=exporter)
    for length in (8, 12, 10):
        ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, length - 3 :] = 0
        labels = torch.tensor([0, 1])
        w.zero_grad()
        eager.zero_grad()
        loss = w(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        ref = eager(input_ids=ids, attention_mask=mask, labels=labels).loss
        ref.backward()
        torch.testing.assert_close(loss, ref)
        for (name, a), b in zip(model.named_parameters(), eager.parameters()):
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, msg=lambda m, name=name: f"{name}: {m}")


# ----------------------------------------------------------------------------------- across processes

_CHILD = """
import json, sys, torch
sys.path.insert(0, {src!r})
import model_{tag} as model
from ortwrap import ORTWrap
torch.manual_seed(0)
eager = model.Model()
torch.manual_seed(0)
w = ORTWrap(model.Model(), fallback=False, exporter={exporter!r})
x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
out, ref = w(x), eager(x)
out.sum().backward()
ref.sum().backward()
grads = all(torch.allclose(a.grad, b.grad, atol=1e-5) for a, b in zip(w.parameters(), eager.parameters()))
print("RESULT " + json.dumps(dict(cached=w.last_artifacts.cached, out=out.sum().item(), eager=ref.sum().item(),
                                  grads=grads)))
"""


def _child(code: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(proc.stderr[-3000:])


def test_a_helper_edited_between_processes_rebuilds(user, exporter, tmp_path):
    """The issue's case: ``helpers.act`` goes from ``relu`` to ``tanh(x) * 10`` between two runs of a
    training script; the second run must train the new code (it got the old program's numbers)."""
    user.write("helpers", "import torch\ndef act(x):\n    return torch.relu(x)\n")
    user.write("model", _MODEL)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    code = _CHILD.format(src=str(user.root), tag=user.tag, exporter=exporter)
    first = _child(code, env)
    assert first["cached"] is False and first["grads"] and abs(first["out"] - first["eager"]) < 1e-4, first
    assert _child(code, env)["cached"] is True  # a restarted job loads the program
    user.write("helpers", "import torch\ndef act(x):\n    return torch.tanh(x) * 10\n")
    edited = _child(code, env)
    assert abs(edited["out"] - edited["eager"]) < 1e-4, f"stale program: {edited}"
    assert edited["cached"] is False and edited["grads"], edited


# ----------------------------------------------------------------------------------- signed entries


class _Trap:
    """Unpickling this creates a file: what a hostile entry would do (run code)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_dropped_in_pickle_is_never_unpickled(user, tmp_path):
    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 3)

        def forward(self, x):
            return torch.tanh(self.l(x))

    assert not _train(Small, "torchscript")
    directory = str(tmp_path / "builds")
    (entry,) = [os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".build")]
    marker = tmp_path / "pwned"
    payload = pickle.dumps([_Trap(str(marker))])
    import hashlib

    # what the unsigned format accepted: the magic line, the payload's sha256, the payload
    with open(entry, "wb") as f:
        f.write(b"ORTWRAP-BUILD\n" + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    with pytest.warns(BuildCacheWarning, match="rebuilt"):
        assert not _train(Small, "torchscript")
    assert not marker.exists(), "the dropped-in pickle ran"
    # also with a signature line that is not ours
    with open(entry, "wb") as f:
        f.write(b"ORTWRAP-BUILD\nhmac-sha256:" + b"0" * 64 + b"\n" + payload)
    with pytest.warns(BuildCacheWarning, match="bad signature"):
        assert not _train(Small, "torchscript")
    assert not marker.exists(), "the dropped-in pickle ran"
    assert _train(Small, "torchscript")  # the rebuilt entry, signed, is served again


def test_entries_signed_under_another_secret_are_ignored(user, tmp_path, monkeypatch):
    directory = str(tmp_path / "builds")
    assert cache.store(directory, "k" * 40, [])
    assert cache.load(directory, "k" * 40) == []
    secret = tmp_path / "secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("ORTWRAP_BUILD_CACHE_SECRET", str(tmp_path / "other-user-secret"))
    monkeypatch.setattr(cache, "_secret", [])
    with pytest.warns(BuildCacheWarning, match="bad signature"):
        assert cache.load(directory, "k" * 40) is None


def test_the_default_secret_is_the_users_own_and_not_in_the_cache_dir(tmp_path, monkeypatch):
    from ortwrap.options import build_cache_secret_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ORTWRAP_CACHE_DIR", str(tmp_path / "shared"))
    monkeypatch.setenv("ORTWRAP_BUILD_CACHE_DIR", str(tmp_path / "shared" / "builds"))
    monkeypatch.setattr(cache, "_secret", [])
    path, explicit = build_cache_secret_path()
    assert not explicit and path.startswith(str(tmp_path / "home"))
    assert cache.store(str(tmp_path / "shared" / "builds"), "k" * 40, [])
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert not any("secret" in f for _, _, files in os.walk(tmp_path / "shared") for f in files)
    # a default secret others can read signs nothing
    os.chmod(path, 0o644)
    monkeypatch.setattr(cache, "_secret", [])
    assert cache.store(str(tmp_path / "shared" / "builds"), "j" * 40, []) is None


# ----------------------------------------------------------------------------------- size cap, CLI


def test_the_size_cap_evicts_the_least_recently_used(user, tmp_path, monkeypatch):
    directory = str(tmp_path / "builds")
    pad = [cache.CacheEntry(b"x" * 1000, None, b"", b"", [], [], ("T",), {}, {}, [], False, None, "torchscript", 1)]
    cache.store(directory, "a" * 40, pad)
    size = os.path.getsize(os.path.join(directory, "a" * 40 + ".build"))
    monkeypatch.setenv("ORTWRAP_BUILD_CACHE_MAX_MB", str((3 * size + size // 2) / (1 << 20)))  # room for three
    for i, key in enumerate(("a", "b", "c")):
        cache.store(directory, key * 40, pad)
        os.utime(os.path.join(directory, key * 40 + ".build"), (1000 + i, 1000 + i))
    assert cache.load(directory, "a" * 40) is not None  # a use: "a" is now the most recent
    cache.store(directory, "d" * 40, pad)
    left = sorted(f[0] for f in os.listdir(directory) if f.endswith(".build"))
    assert left == ["a", "c", "d"], left  # "b", the least recently used, went


def _cli(*args: str, env: dict) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "ortwrap", *args], capture_output=True, text=True, env=env, timeout=300, cwd=HERE
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_python_m_ortwrap_env_and_cache_info_and_clear(user, tmp_path):
    directory = str(tmp_path / "builds")
    cache.store(directory, "a" * 40, [b"x" * 5000])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = _cli("env", env=env)
    for line in (
        "ortwrap: ",
        "python: ",
        "torch: " + torch.__version__,
        "onnxruntime: ",
        "onnx: ",
        "onnxscript: ",
        "onnx-ir: ",
        "supported torch: >=",
        "cpu flags: avx2 ",
        "avx512_bf16 ",
        "native kernels/_cpu.c",
        "threads: ORT intra-op ",
        "ORT spinning off; PyTorch's OpenMP: OMP_WAIT_POLICY=",
        f"build cache (ORTWRAP_BUILD_CACHE_DIR): {directory}: 1 entries",
    ):
        assert line in out, f"{line!r} missing from:\n{out}"
    info = _cli("cache", "info", env=env)
    assert directory in info and "entries: 1" in info and "a" * 40 in info, info
    assert "removed 1 entries" in _cli("cache", "clear", env=env)
    assert not [f for f in os.listdir(directory) if f.endswith(".build")]
