"""A compiled program: what one input schema of one module runs (the runner), and how the call's
flat inputs and the module's parameters and buffers map to the graph's feeds (``Program.bind``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._compat import torch as compat
from .._ort import C
from ..export import ExportedModel
from ..grad import TrainingGraph
from ..passes.pythonop_context import CONTEXT_OUTPUT_PREFIX
from .dlpack import StateValueCache, push_tensor
from .host_shapes import HostShapeRunner

__all__ = ["FROM_STATE", "FROM_STATE_AS_FLOAT", "Program"]

#: ``Program._plan``'s feed source for module state: the owner's table, read at ``attr`` each step.
FROM_STATE = -1
#: The same, fed as a float32 copy of the half-precision tensor (``graph.float_feeds``).
FROM_STATE_AS_FLOAT = -2


@dataclass
class _StateRef:
    """Where a parameter or buffer lives, so each step feeds the module's current tensor."""

    owner: nn.Module
    attr: str
    is_param: bool

    def table(self) -> dict[str, torch.Tensor]:
        """The owner's ``_parameters`` or ``_buffers``: the dict that ``table()[attr]`` reads."""
        return compat.parameter_table(self.owner) if self.is_param else compat.buffer_table(self.owner)


_dict_item = dict.__getitem__


class Program:
    """One compiled input schema: the runner, and how flat inputs map to graph feeds."""

    def __str__(self) -> str:
        return self._label

    def __init__(self, exported: ExportedModel, graph: TrainingGraph, runner, module: nn.Module) -> None:
        self.graph = graph
        self.runner = runner
        self.with_backward = graph.has_backward
        #: Non-batch dimensions are part of the graph: each new one needs its own program.
        self.static_spatial = exported.static_spatial
        #: dynamo exports: dims the capture fixed or tied; a call that breaks them needs a new program.
        self.shape_guards = exported.shape_guards or None
        self.out_spec = exported.out_spec
        index_of = {name: i for i, name in enumerate(exported.user_input_names) if name is not None}
        refs = _state_refs(module)
        # Each feed is (flat index, None, None) for a user input, or (FROM_STATE, table, attr) for
        # module state: the owning submodule's _parameters or _buffers dict, read at ``attr`` every
        # step; FROM_STATE_AS_FLOAT instead feeds a float32 copy of half-precision state
        # (``graph.float_feeds``).
        self._plan: list[tuple[int, dict[str, torch.Tensor] | None, str | None]] = []
        for name in graph.feed_names:
            if name in index_of:
                self._plan.append((index_of[name], None, None))
            else:
                ref = refs[exported.state_names[name]]
                source = FROM_STATE_AS_FLOAT if name in graph.float_feeds else FROM_STATE
                self._plan.append((source, ref.table(), ref.attr))
        outputs = list(graph.info.user_output_names)
        #: outputs that depend on no graph input, ``(index, value)``: not outputs of the graph, put
        #: back by ``outputs`` (grad/builder.py's split_constant_outputs)
        self.constant_outputs = tuple((i, value.to(runner.device)) for i, _, value in graph.constant_outputs)
        for i, name, _ in graph.constant_outputs:
            outputs.insert(i, name)
        self.n_outputs = len(exported.output_names)
        # the graph's own user outputs (RunTrainingGraph's indices count only the graph's outputs)
        n_graph = self.n_outputs - sum(i < self.n_outputs for i, _ in self.constant_outputs)
        self._label = f"{'training' if self.with_backward else 'inference'} program for {type(module).__name__}"
        #: forward runs that succeeded (the first failure of a program that never ran falls back)
        self.runs = 0
        if outputs[: self.n_outputs] != exported.output_names:
            raise AssertionError(f"graph outputs {outputs} do not start with {exported.output_names}")
        rest = outputs[self.n_outputs :]
        #: PythonOp context ids, the last outputs (see passes/pythonop_context.py).
        self.n_contexts = sum(name.startswith(CONTEXT_OUTPUT_PREFIX) for name in rest)
        buffer_names = rest[: len(rest) - self.n_contexts]
        self.buffer_outputs = [exported.buffer_outputs[name] for name in buffer_names]
        #: Outputs autograd must not differentiate: ORT's non-differentiable ones, buffers, context ids.
        self.non_differentiable = tuple(
            i
            for i in range(len(graph.info.user_output_names))
            if i in graph.info.non_differentiable_outputs or i >= n_graph
        )
        #: User outputs ORT's backward reads: saved with save_for_backward, so that autograd's
        #: version counters catch an in-place edit before the backward, as in eager.
        self.saved_outputs = tuple(i for i in graph.info.saved_output_indices if i < n_graph)
        self._state_cache = StateValueCache(len(self._plan))
        # NOTE: the graph's PythonOps hold the addresses of these objects: they live exactly as long
        # as this program (and its session) can run.
        self.keepalive = exported.keepalive
        self.n_pythonops = len(exported.functions)
        #: with aggressive_cpu_fallback: computes the host-fed inputs from the user's tensors
        self.host_shapes_runner: HostShapeRunner | None = None

    def forget_state_values(self) -> None:
        """Drop the cached OrtValues of parameters and buffers, and the memory they keep alive (DeepSpeed
        ZeRO-3 partitions the parameters between steps: their gathered memory must be freed)."""
        self._state_cache = StateValueCache(len(self._plan))

    def bind(self, leaves: list[torch.Tensor]) -> tuple[list[torch.Tensor], C.OrtValueVector]:
        """The tensors of every graph feed, in feed order (user inputs, then parameters and buffers),
        and the same as an OrtValueVector; parameters and buffers reuse their cached OrtValues.

        One pass over the feeds: this runs on every step (see runtime/function.py's NOTE)."""
        if self.host_shapes_runner is not None:  # the host-fed inputs follow the user's tensors
            leaves = [*leaves, *self.host_shapes_runner(leaves)]
        vec = C.OrtValueVector()
        push = vec.push_back
        cache = self._state_cache
        cached_tensors, pointers, values = cache.tensors, cache.pointers, cache.values
        feeds: list[torch.Tensor] = []
        append = feeds.append
        as_float = FROM_STATE_AS_FLOAT
        for j, (i, table, attr) in enumerate(self._plan):
            if table is None:
                t = leaves[i]
                push_tensor(vec, t)
            else:
                # NOTE: dict's own lookup: DeepSpeed ZeRO-3's parameter dicts gather a partitioned
                # parameter on item access (and register it as its module's external parameter);
                # the graph feeds what the module holds now (zero3_gather="submodule" gathers inside).
                t = _dict_item(table, attr)
                if i == as_float:  # (fuse_initializers)
                    push(cache.float_copy(j, t))
                elif cached_tensors[j] is t and pointers[j] == t.data_ptr():
                    push(values[j])
                else:
                    push(cache.refresh(j, t))
            append(t)
        return feeds, vec


def _state_refs(module: nn.Module) -> dict[str, _StateRef]:
    refs: dict[str, _StateRef] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr in compat.parameter_table(sub):
            refs.setdefault(f"{prefix}.{attr}" if prefix else attr, _StateRef(sub, attr, True))
        for attr in compat.buffer_table(sub):
            refs.setdefault(f"{prefix}.{attr}" if prefix else attr, _StateRef(sub, attr, False))
    return refs
