"""The compat boundary (``ortwrap/_compat/torch.py``): it owns every private torch name, touches none
at import time, resolves every declared one on this torch, and reports a missing one clearly."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ortwrap
from ortwrap._compat import torch as compat

PACKAGE = os.path.dirname(os.path.abspath(ortwrap.__file__))
BOUNDARY = os.path.join(PACKAGE, "_compat")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private_attribute_names() -> set[str]:
    """Private attribute names of the torch classes ortwrap handles (modules, tensors, Functions,
    their contexts, TorchScript graphs and nodes, FX graphs, op overloads, exported programs)."""
    import torch.fx

    objects: list[object] = [
        torch.nn.Module(),
        torch.nn.Linear(1, 1),
        torch.Tensor,
        torch.nn.Parameter,
        torch.autograd.Function,
        torch.autograd.function.FunctionCtx,
        torch.autograd.graph.Node,
        torch.fx.Graph,
        torch.fx.Node,
        torch.fx.GraphModule,
        torch.export.ExportedProgram,
        torch.ops.aten.add.Tensor,
        torch.ops.aten.add,
        torch.Generator,
    ]
    import torch.jit

    objects += [torch.jit.ScriptModule]
    names = set()
    for obj in objects:
        names |= {n for n in dir(obj) if _private(n)}
    return names


def _torch_private_module_names() -> set[str]:
    """Private names of the torch namespaces ortwrap looks things up in by name (``getattr(dist,
    name)``, ``namespace.__dict__.get(name)``): a string naming one is a private name too
    (``"_all_gather_base"``). Not ``torch`` itself, whose private names include ATen op names
    (``_softmax``), which ortwrap writes as op names."""
    import torch.autograd
    import torch.distributed
    import torch.nn.modules.module

    modules: list[object] = [torch.nn.modules.module, torch.autograd, torch.distributed]
    if torch.distributed.is_available():
        import torch.distributed.distributed_c10d

        modules.append(torch.distributed.distributed_c10d)
    return {n for m in modules for n in dir(m) if _private(n)}


def _torch_aliases(tree: ast.Module) -> set[str]:
    """Local names bound to torch or one of its submodules (``torch``, ``nn``, ``F``, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    names.add((a.asname or a.name).split(".")[0])
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and (node.module == "torch" or node.module.startswith("torch."))
        ):
            for a in node.names:
                names.add(a.asname or a.name)
    return names


def _violations(path: str, private_attrs: set[str], private_module_names: set[str] = frozenset()) -> list[str]:
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source)
    aliases = _torch_aliases(tree)
    rel = os.path.relpath(path, PACKAGE)
    found = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"ortwrap/{rel}:{node.lineno}: {what}")

    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch.") and any(_private(p) for p in a.name.split(".")):
                    report(node, f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            if any(_private(p) for p in node.module.split(".")) or any(_private(a.name) for a in node.names):
                report(node, f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute):
            if _private(node.attr):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in aliases:
                    report(node, f"{ast.unparse(node)} (a private name under torch)")
                elif node.attr in private_attrs:
                    report(node, f"{ast.unparse(node)} ({node.attr} is private to a torch class)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value in private_attrs:
                report(node, f"the string {node.value!r} (a torch class's private attribute, by name)")
            elif node.value in private_module_names:
                report(node, f"the string {node.value!r} (a private name of a torch namespace, by name)")
    return found


def test_no_private_torch_name_outside_the_boundary():
    private_attrs = _torch_private_attribute_names()
    private_module_names = _torch_private_module_names()
    found = []
    for root, _, files in os.walk(PACKAGE):
        if root.startswith(BOUNDARY):
            continue
        for name in files:
            if name.endswith(".py"):
                found += _violations(os.path.join(root, name), private_attrs, private_module_names)
    assert not found, "private torch names used outside ortwrap/_compat (move them there):\n" + "\n".join(found)


def test_the_checker_finds_what_it_must():
    """The source check itself: each kind of private use it must catch, in a scratch file."""
    sample = textwrap.dedent(
        """
        import torch
        import torch.nn as nn
        from torch.onnx._internal import registration
        from torch.autograd.function import _SingleLevelFunction
        x = torch._C._from_dlpack
        y = nn.modules.module._global_forward_hooks
        def f(module, op):
            return module._parameters, op._schema, module.__dict__.get("_forward_hooks")
        COLLECTIVES = ("all_gather", "_all_gather_base")
        """
    )
    path = os.path.join(PACKAGE, "_scratch_compat_check.py")
    with open(path, "w") as f:
        f.write(sample)
    try:
        found = "\n".join(_violations(path, _torch_private_attribute_names(), _torch_private_module_names()))
    finally:
        os.remove(path)
    for what in ("torch.onnx._internal", "_SingleLevelFunction", "torch._C._from_dlpack", "_global_forward_hooks",
                 "module._parameters", "op._schema", "'_forward_hooks'", "'_all_gather_base'"):  # fmt: skip
        assert what in found, f"the check missed {what}:\n{found}"


def test_no_frame_inspection_and_no_apply_rewriting():
    """ortwrap decides nothing from its callers' frames. The one reader of the stack is
    ``_logging.warn_at_user_line``, which only chooses the line a warning is reported at."""
    offenders = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            tree = ast.parse(open(path).read())
            allowed: set[int] = set()
            if os.path.relpath(path, PACKAGE) == "_logging.py":
                fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "warn_at_user_line")
                allowed = {id(n) for n in ast.walk(fn)}
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in ("extract_stack", "walk_stack", "format_stack", "print_stack")
                    and id(node) not in allowed
                ):
                    offenders.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
                if isinstance(node, ast.Attribute) and node.attr in ("_getframe", "f_back", "currentframe", "stack"):
                    if (
                        ast.unparse(node) in ("sys._getframe", "inspect.currentframe", "inspect.stack")
                        or node.attr == "f_back"
                    ):
                        offenders.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr in ("__code__", "apply") for t in node.targets
                ):
                    offenders.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
                if isinstance(node, ast.Attribute) and node.attr == "__func__" and "apply" in ast.unparse(node):
                    offenders.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


def _resolve_declared(name: str) -> object:
    cls, _, attr = name.partition(".")
    if cls == "Module":
        module = torch.nn.Linear(1, 1)
        assert attr in module.__dict__ or hasattr(module, attr), f"nn.Module has no {attr}"
        return getattr(module, attr)
    if cls == "OpOverload":
        return getattr(torch.ops.aten.add.Tensor, attr)
    if cls == "Tensor":
        return getattr(torch.zeros(1), attr)
    if cls == "ExportedProgram":
        program = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
        assert attr in vars(program), f"ExportedProgram has no {attr}"
        return getattr(program, attr)
    if cls == "_SymbolicFunctionGroup":
        group = compat._ts_registry().get_function_group("aten::add")
        return getattr(group, attr)
    return compat._resolve(name)


@pytest.mark.parametrize("name", sorted(compat.PRIVATE_APIS))
def test_every_declared_private_api_exists_on_this_torch(name):
    """Each name the boundary declares resolves here; the release it runs on is among those it
    names (or this run is the check that adds it)."""
    assert compat.PRIVATE_APIS[name], f"{name} names no release it was checked on"
    _resolve_declared(name)


def test_the_running_torch_is_in_the_supported_range():
    assert compat.MIN_VERSION <= compat.TORCH_VERSION[:2] < compat.MAX_VERSION_EXCLUSIVE
    assert torch.__version__.split("+")[0] in compat.CHECKED_RELEASES or os.environ.get("ORTWRAP_NEW_TORCH_CHECK")


def test_a_missing_private_api_gets_a_clear_error():
    with pytest.raises(ortwrap.UnsupportedTorchError) as info:
        compat._resolve("torch._C._ortwrap_no_such_entry_point")
    text = str(info.value)
    assert "torch._C._ortwrap_no_such_entry_point" in text
    assert torch.__version__ in text and compat.SUPPORTED_RANGE in text


def test_public_fallbacks_when_a_private_entry_point_is_missing(monkeypatch):
    """Where a public equivalent exists, a missing private name costs speed, not correctness."""
    monkeypatch.setattr(compat, "_resolve", lambda name: (_ for _ in ()).throw(compat._missing(name)))
    for accessor in (
        compat.from_dlpack,
        compat.set_grad_enabled,
        compat.functorch_transforms_active,
        compat.tracing_state,
    ):
        accessor.cache_clear()
    try:
        t = torch.arange(3.0)
        assert torch.equal(compat.from_dlpack()(torch.utils.dlpack.to_dlpack(t)), t)
        assert compat.functorch_transforms_active()() is True  # callers then take Function.apply
        assert compat.tracing_state()() is False
        assert compat.autograd_c_apply(torch.autograd.Function) == torch.autograd.Function.apply
        assert compat.call_skips_hooks(torch.nn.Linear(1, 1)) in (True, False)
    finally:
        for accessor in (compat.from_dlpack, compat.set_grad_enabled, compat.functorch_transforms_active,
                         compat.tracing_state):  # fmt: skip
            accessor.cache_clear()
        compat._global_hook_tables.cache_clear()


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="default")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )


def test_import_touches_no_private_torch_name():
    """``import ortwrap`` resolves no private name: the boundary's resolver is never called, and no
    private torch module is imported because of it."""
    proc = _run(
        """
        import sys
        import torch
        before = set(sys.modules)
        calls = []
        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_name in ("_resolve", "_first") and frame.f_code.co_filename.endswith("_compat/torch.py"):
                calls.append(frame.f_locals.get("name") or frame.f_locals.get("names"))
        sys.setprofile(profile)
        import ortwrap
        sys.setprofile(None)
        new = sorted(m for m in set(sys.modules) - before if m.startswith("torch") and any(p.startswith("_") for p in m.split(".")))
        assert not calls, calls
        assert not new, new
        assert not any(m.startswith("onnxruntime.training") for m in sys.modules), "ORTModule was imported"
        print("ok")
        """
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("version", ["2.12.1", "1.13.0"])
def test_import_on_an_older_torch_says_what_is_supported(version):
    proc = _run(
        f"""
        import torch
        torch.__version__ = "{version}"
        try:
            import ortwrap
        except ImportError as e:
            print("IMPORT-ERROR", e)
        """
    )
    assert "IMPORT-ERROR" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert compat.SUPPORTED_RANGE in proc.stdout and version in proc.stdout
    assert "AttributeError" not in proc.stdout + proc.stderr


def test_import_on_a_newer_torch_warns_and_names_the_tested_releases():
    proc = _run(
        """
        import warnings
        import torch
        torch.__version__ = "2.99.0"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            import ortwrap
        print([str(w.message) for w in seen if w.category is ortwrap.UnsupportedTorchWarning])
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2.99.0 is newer" in proc.stdout and compat.CHECKED_RELEASES[0] in proc.stdout


def test_api_names_no_integration():
    """Integrations hook in through ``ortwrap.integrations``' seam: the wrapper does not know them."""
    with open(os.path.join(PACKAGE, "api.py")) as f:
        source = f.read().lower()
    for name in ("deepspeed", "ds_id", "zero3", "distributeddataparallel", "fsdp"):
        assert name not in source, f"api.py names {name!r}"
