"""A built program keeps nothing of the capture alive (issue 26 §2: peak RSS): once a build has
returned, the torch.export program, its fx graph and the onnx_ir models the passes rewrote are
garbage (``build/compile.py``'s ``_release_capture``, ``passes/fusions.py``'s ``forget_matches``).
What stays is the program (its session) and ``last_artifacts``'s ONNX protos (graphs without the
weights). (The last dynamo capture's ShapeEnv and a few fake tensors stay reachable from torch's C++
side through SymNodes; not checked here.)"""

from __future__ import annotations

import copy
import gc
import weakref

import onnx_ir as ir
import torch
from parity import assert_close
from torch import nn

from ortwrap import ORTWrap

#: What the capture and the passes create, none of which a built program needs.
CAPTURE_TYPES = (torch.fx.GraphModule, torch.fx.Graph, torch.export.ExportedProgram, ir.Model, ir.Graph)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(12, 24)
        self.norm = nn.LayerNorm(24)
        self.out = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.inp(x), approximate="tanh")
        return self.out(self.norm(h) * x.sum(-1, keepdim=True))


def _alive(types: tuple[type, ...]) -> set[int]:
    gc.collect()
    return {id(o) for o in gc.get_objects() if isinstance(o, types)}


def test_a_built_program_keeps_no_capture_artifacts(exporter, monkeypatch):
    exports: list[weakref.ref] = []
    real_export = torch.export.export

    def recording_export(*args, **kwargs):
        program = real_export(*args, **kwargs)
        exports.append(weakref.ref(program))
        exports.append(weakref.ref(program.graph_module))
        return program

    monkeypatch.setattr(torch.export, "export", recording_export)
    # a first build: what a process creates once (the exporter's function library) is not the build's
    warm = ORTWrap(Block(), fallback=False, exporter=exporter, build_cache=False)
    warm(torch.randn(2, 12)).sum().backward()
    del warm
    exports.clear()
    eager = Block()
    w = ORTWrap(copy.deepcopy(eager), fallback=False, exporter=exporter, build_cache=False)
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(1))
    before = _alive(CAPTURE_TYPES)
    out = w(x)
    out_e = eager(x)
    assert_close(out.detach(), out_e.detach(), "output")
    out.square().sum().backward()
    out_e.square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), w.parameters()):
        assert_close(q.grad, p.grad, f"{name}.grad")
    assert w.fallback_reason is None and len(w.programs()) == 1
    assert w.last_artifacts.exporter == exporter
    assert bool(exports) == (exporter == "dynamo")
    gc.collect()
    assert [r for r in exports if r() is not None] == []
    left = _alive(CAPTURE_TYPES) - before
    kinds = sorted({f"{type(o).__module__}.{type(o).__name__}" for o in gc.get_objects() if id(o) in left})
    assert not left, f"the build left {len(left)} capture objects alive: {kinds}"
    # the program still trains after the release: a second step matches eager's
    out, out_e = w(x * 2), eager(x * 2)
    assert_close(out.detach(), out_e.detach(), "output, second step")
