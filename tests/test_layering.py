"""The package's layers (docs/architecture.md, "Layers"): a module imports only from its own layer or
from layers below it, at module level and inside functions alike, and no two modules import each
other, directly or around a loop.

The order is :data:`LAYERS`, one table: edit it (and the doc) when a file moves. Imports are read
with ``ast``, so lazy imports inside functions count; ``if TYPE_CHECKING:`` blocks do not (they never
run).
"""

from __future__ import annotations

import ast
import os

import ortwrap

PACKAGE = os.path.dirname(os.path.abspath(ortwrap.__file__))

#: Lowest first. A module belongs to the layer of its longest matching entry: ``"ortwrap.x"`` is the
#: module (or package) ``x`` and everything under it; ``"ortwrap.x."`` only what is under it (its
#: ``__init__`` then goes by ``"ortwrap.x"``). Inside one layer, imports may go either way (the cycle
#: test still applies).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # the contract under every stage: names, node builders, ExportedModel, the host-shape types
    ("graph", ("ortwrap.graph",)),
    # leaves every stage may use: errors, options, logging, the torch and ORT boundaries
    (
        "base",
        (
            "ortwrap.errors",
            "ortwrap._version",
            "ortwrap._compat",
            "ortwrap.options",
            "ortwrap._logging",
            "ortwrap._ort",
            "ortwrap._tree",
            "ortwrap.cpu",
        ),
    ),
    # the op declarations (ops/: one declaration per op and kernel, every table derived)
    ("ops", ("ortwrap.ops",)),
    # the PythonOp and ATen bridges: what runs PyTorch inside an ORT graph
    ("bridge", ("ortwrap.bridge",)),
    # stage 1: module -> ONNX
    ("export", ("ortwrap.export",)),
    # stage 3, below stage 2 in the import order: passes ask ORT's gradient builder whether it can
    # differentiate a node (grad/probe.py) before they rewrite it
    ("grad", ("ortwrap.grad",)),
    # ortwrap's own C kernels (their loader registers their gradients: grad/aten.py)
    ("kernels", ("ortwrap.kernels",)),
    # stage 2: ONNX rewrites
    ("passes", ("ortwrap.passes",)),
    # stage 4: sessions, the autograd Function, DLPack, host shapes
    ("runtime", ("ortwrap.runtime",)),
    # the integration seam (the protocol; the integrations themselves are at the top)
    ("seam", ("ortwrap.integrations",)),
    # running the stages: the stage framework, the build cache, the GEMM route, verification, Program
    (
        "build",
        (
            "ortwrap.build",
            "ortwrap.gemm_choice",
            "ortwrap.verify",
        ),
    ),
    # the other engine (AOTAutograd on plain InferenceSessions), chosen at one dispatch point
    ("engines", ("ortwrap.engines", "ortwrap.split_capture")),
    ("dispatch", ("ortwrap.dispatch",)),
    # the module's face
    ("api", ("ortwrap.api",)),
    # DeepSpeed, torch.distributed wrappers
    ("integrations", ("ortwrap.integrations.",)),
    # the package's face and command line
    ("package", ("ortwrap.__init__", "ortwrap.__main__")),
]

#: (importer, imported) -> why it is allowed to run against the order. Keep it short: each entry is
#: a debt with its reason, and each is also an import cycle (:func:`test_no_import_cycles` lists the
#: cycles that remain once these edges are gone). An entry no longer needed fails
#: :func:`test_allowed_exceptions_are_still_needed`.
ALLOWED: dict[tuple[str, str], str] = {}


def _layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if entry.endswith("."):
                hit = module.startswith(entry)
            else:
                hit = module == entry or module.startswith(entry + ".")
            if hit and len(entry) > best_len:
                best, best_len = index, len(entry)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (tests/test_layering.py)"
    return best


def _modules() -> dict[str, str]:
    """module name -> path, for every module of the package (a package is ``ortwrap.x.__init__``'s
    name without ``.__init__``; ortwrap's own ``__init__`` is ``ortwrap.__init__``)."""
    found = {}
    root = os.path.dirname(PACKAGE)
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            parts = os.path.relpath(path, root)[:-3].split(os.sep)
            if parts[-1] == "__init__" and len(parts) > 2:
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(modules: dict[str, str] | None = None) -> list[tuple[str, str, int, bool]]:
    """(importer, imported module, line, lazy) for every import of an ortwrap module. ``from x import
    y`` names module ``x.y`` where that is a module, else ``x``."""
    modules = _modules() if modules is None else modules
    package_of = {m: m if p.endswith("__init__.py") else m.rpartition(".")[0] for m, p in modules.items()}
    package_of["ortwrap.__init__"] = "ortwrap"

    def known(name: str) -> str | None:
        if name == "ortwrap":
            return "ortwrap.__init__"
        return name if name in modules else None

    found = []
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)

        def visit(node: ast.AST, lazy: bool, module=module) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    for stmt in child.orelse:
                        visit(stmt, lazy)
                    continue
                inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        if alias.name.split(".")[0] == "ortwrap" and (target := known(alias.name)):
                            found.append((module, target, child.lineno, inner))
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = package_of[module].split(".")
                        base = base[: len(base) - (child.level - 1)]
                        source = ".".join(base + ([child.module] if child.module else []))
                    else:
                        source = child.module or ""
                    if source.split(".")[0] != "ortwrap":
                        continue
                    for alias in child.names:
                        target = known(f"{source}.{alias.name}") or known(source)
                        if target:
                            found.append((module, target, child.lineno, inner))
                visit(child, inner)

        visit(tree, False)
    return found


def test_every_module_has_a_layer():
    for module in _modules():
        _layer_of(module)


def test_imports_follow_the_layer_order():
    wrong = []
    for importer, imported, line, lazy in imports():
        low, high = _layer_of(imported), _layer_of(importer)
        if low > high and (importer, imported) not in ALLOWED:
            kind = "lazy import" if lazy else "import"
            wrong.append(
                f"{importer} (layer {LAYERS[high][0]}) line {line}: {kind} of {imported} (layer {LAYERS[low][0]})"
            )
    assert not wrong, "imports against the layer order (tests/test_layering.py LAYERS):\n" + "\n".join(sorted(wrong))


def test_allowed_exceptions_are_still_needed():
    seen = {(a, b) for a, b, _, _ in imports()}
    stale = [pair for pair in ALLOWED if pair not in seen or _layer_of(pair[1]) <= _layer_of(pair[0])]
    assert not stale, f"ALLOWED entries no longer needed: {stale}"


def cycles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        if a != b:
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


#: Import cycles still to break, each with the reason it exists (a debt, like ALLOWED).
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycles():
    found = cycles([(a, b) for a, b, _, _ in imports() if (a, b) not in ALLOWED])
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert not new, "import cycles (module-level and lazy imports):\n" + "\n".join(" <-> ".join(c) for c in new)


def test_the_checks_find_what_they_must():
    """The test's own machinery: a lazy upward import and a two-module cycle in a scratch package."""
    assert cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]
    assert _layer_of("ortwrap.integrations") < _layer_of("ortwrap.api") < _layer_of("ortwrap.integrations.deepspeed")
    assert _layer_of("ortwrap.graph.names") == 0
    sample = "def f():\n    from ..api import ORTWrap\n"
    path = os.path.join(PACKAGE, "graph", "_scratch_layering_check.py")
    with open(path, "w") as f:
        f.write(sample)
    try:
        hits = [(a, b, lazy) for a, b, _, lazy in imports() if a.endswith("_scratch_layering_check")]
    finally:
        os.remove(path)
    assert hits == [("ortwrap.graph._scratch_layering_check", "ortwrap.api", True)]
    assert _layer_of(hits[0][1]) > _layer_of(hits[0][0])
