"""An AOTAutograd graph with ops ONNX cannot hold, run as ORT segments with those ops in PyTorch between.

The ops that stay in PyTorch: an untraceable autograd.Function's ``function_forward`` and
``function_backward`` (``functions.py``), and every op that neither ortwrap's translation table nor
torchlib translates (a user's ``torch.library`` op, an ATen op torchlib lacks), and random ops and ops
on complex values (``in_torch.py``: torch's generator, no complex kernels in ORT). Walking the graph in
its (topological) order, each maximal run of translatable nodes is one segment
(``torch.fx.passes.split_module``), translated and run in its own InferenceSession
(:class:`GraphRunner`); the others stay FX code. The forward and the backward graph are split each on
its own: AOTAutograd's autograd.Function still chains them, with the saved values of the whole
forward (ORT's outputs or PyTorch's) handed to the backward.

A ``getitem`` of a multi-output op goes where its op goes (an ORT segment takes tensors, not tuples).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx.passes.split_module import split_module

from .functions import FUNCTION_OPS
from .in_torch import random_op, touches_complex
from .session import GraphRunner
from .translate import engine_registry, translate_cached

#: op -> whether the engine's registry translates it (the registry takes ~0.1 s to build: asked once per op)
_TRANSLATES: dict[Any, bool] = {}


def _translates(target: Any) -> bool:
    if target not in _TRANSLATES:
        registry = engine_registry()
        _TRANSLATES[target] = target not in FUNCTION_OPS and bool(registry.is_registered(target))
    return _TRANSLATES[target]


def untranslatable(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """The nodes of ``gm`` that must run in PyTorch, with the op's name."""
    found: dict[torch.fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            if node.args[0] in found:
                found[node] = found[node.args[0]]
        elif not _translates(node.target):
            found[node] = str(node.target)
        elif random_op(node.target) or touches_complex(node):  # (torch's generator; complex values: in_torch.py)
            found[node] = str(node.target)
    return found


class _Segment(torch.nn.Module):
    """One ORT segment in the split graph: calls its runner, returns what the FX submodule did."""

    def __init__(self, runner: GraphRunner, single: bool) -> None:
        super().__init__()
        self.runner = runner
        self.single = single

    def forward(self, *args: Any) -> Any:
        outs = self.runner(list(args))
        return outs[0] if self.single else tuple(outs)


class SplitRunner:
    """A graph split at its untranslatable nodes (a boxed callable for AOTAutograd).

    Attributes:
        module: the split FX module (``submod_<i>``: ORT segments as :class:`_Segment`, the rest FX).
        segments: the ORT segments' runners, in order.
        in_torch: the ops that run in PyTorch.
    """

    def __init__(self, gm: torch.fx.GraphModule, what: str, device: torch.device, options, fusions: bool,
                 in_torch: dict[torch.fx.Node, str]) -> None:  # fmt: skip
        self.in_torch = sorted(set(in_torch.values()))
        part: dict[torch.fx.Node, int] = {}
        current, state = 0, None
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            here = node in in_torch
            if state is not None and here != state:
                current += 1
            state = here
            part[node] = current

        def callback(node: torch.fx.Node) -> int:
            return part.get(node, 0)

        module = split_module(gm, None, callback, keep_original_order=True)
        self.segments: list[GraphRunner] = []
        torch_parts = {part[n] for n in in_torch}
        for i in sorted(set(part.values())):
            if i in torch_parts:
                continue
            name = f"submod_{i}"
            sub = getattr(module, name)
            (out,) = [n for n in sub.graph.nodes if n.op == "output"]
            graph = translate_cached(sub, f"{what} segment {i}", fusions, options.build_cache)
            runner = GraphRunner(graph, device, options, what)
            self.segments.append(runner)
            setattr(module, name, _Segment(runner, not isinstance(out.args[0], (tuple, list))))
        self.module = module

    def __call__(self, args: list) -> Any:
        flat = list(args)
        args.clear()
        return list(self.module(*flat))
