"""Split capture: a module whose torch.export capture stops on a data-dependent guard (a Python loop
over the experts a batch routes to, ``for e in mask.nonzero(): ...``) runs under ``torch.compile``
with ortwrap's own backend. The Python code that depends on the values (the loop, its count, its
branches) stays Python, and each graph fragment dynamo hands the backend trains on ONNX Runtime as a
wrapper of its own (``ORTWrap(fragment, exporter="dynamo", fallback=False)``).

What runs where, said to the user (``ORTWrap.split_capture``, :meth:`SplitCapture.summary`):

- each fragment runs on ONNX Runtime; one whose build fails runs in PyTorch, with a
  ``FallbackWarning`` naming it (never silently);
- dynamo runs the rest of a frame in PyTorch where it cannot resume after a graph break: a graph
  break inside a loop (``torch.where`` in the loop over the routed experts) skips the frame's
  remaining code. Those ops are eager PyTorch's, so their numbers are eager's; the summary names
  the parameters that no fragment takes (their gradients come from PyTorch).

Fragments are captured with dynamic sizes (``torch.compile(dynamic=True)``, as the main dynamo
path marks every dim ``Dim.AUTO``): one fragment program serves every sequence length and every
count of tokens an expert gets. dynamo captures a frame again only where a guard it made fails (a
size of 0 or 1, a Python value the code branched on). The ints dynamo passes for symbolic sizes are
read from the inputs' shapes inside the fragment (:func:`_size_sources`). Parameters reach the
fragments as inputs (dynamo lifts them), so their gradients accumulate on the module's own
parameters, and ``state_dict`` and the optimizer see one set.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._compat import torch as compat
from ._logging import logger, warn_at_user_line
from .errors import FallbackWarning, ORTWrapError, sentence

__all__ = ["SplitCapture", "is_data_dependent"]

#: torch.compile's recompile limits under a split capture: per code object, and over all
_PER_CODE = 256
_TOTAL = 4096

#: what torch.export's error says when its capture stops on a value it would need to know
_DATA_DEPENDENT = ("data-dependent", "data dependent", "GuardOnDataDependentSymNode")


def is_data_dependent(error: BaseException) -> bool:
    """Whether ``error`` (an export error, its causes included) is a data-dependent guard."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(s in str(e) for s in _DATA_DEPENDENT):
            return True
        e = e.__cause__ or e.__context__
    return False


#: a graph input that is an int dynamo made symbolic, fed to ORT as the length of a tensor, less
#: _OFFSET (torch.export specializes sizes 0 and 1, and a zero-size input runs in PyTorch: dynamo
#: leaves an int argument of 0, transformers' ``logits_to_keep``, symbolic)
_LENGTH = (-1, 0)
_OFFSET = 2


def _size_sources(gm: torch.fx.GraphModule) -> list[tuple[int, int] | None]:
    """For each graph input of a fragment dynamo captured with dynamic shapes: ``(k, d)`` where the
    input is an int that is the size of dim ``d`` of tensor input ``k`` (the same symbol),
    :data:`_LENGTH` for another int dynamo made symbolic, else None (fed as it is).

    dynamo passes a symbolic size a frame reads as a Python int (``batch_size, seq_len = x.shape``,
    an int argument) as a graph input of its own. Fed to ORTWrap as an int, each value would be a
    constant of its own graph (a build per length). Read from a tensor input's shape inside the
    graph, it is a symbolic dim of one program; an int that is no input's dim (``batch_size`` where
    the input is ``[batch * seq, hidden]``) is fed as the length (less 2) of a 1-D uint8 tensor,
    whose dim is symbolic in the export as well; a negative one is fed as an int."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    dims: dict[str, tuple[int, int]] = {}
    values = [n.meta.get("example_value") for n in placeholders]
    for k, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            for d, size in enumerate(v.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(str(size), (k, d))
    return [dims.get(str(v), _LENGTH) if isinstance(v, torch.SymInt) else None for v in values]


class _SizesFromShapes(nn.Module):
    """A fragment whose symbolic int inputs are read from shapes (:func:`_size_sources`): it takes
    the other inputs, in order, an int fed as a length as a tensor of that length."""

    def __init__(self, gm: torch.fx.GraphModule, sizes: list[tuple[int, int] | None]) -> None:
        super().__init__()
        self.gm = gm
        self.sizes = sizes

    def forward(self, *passed: Any) -> Any:
        given = iter(passed)
        args = [next(given) if source is None or source == _LENGTH else None for source in self.sizes]
        for i, source in enumerate(self.sizes):
            if source == _LENGTH:
                args[i] = args[i].shape[0] - _OFFSET if isinstance(args[i], torch.Tensor) else args[i]
            elif source is not None:
                args[i] = args[source[0]].shape[source[1]]
        return self.gm(*args)


def _fed(args: tuple, sizes: list[tuple[int, int] | None]) -> tuple:
    """A fragment's call arguments as its :class:`_SizesFromShapes` takes them."""
    fed = []
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)  # (ORTWrap takes one device)
    for a, source in zip(args, sizes):
        if source is None:
            fed.append(a)
        elif source == _LENGTH:
            fed.append(torch.empty(int(a) + _OFFSET, dtype=torch.uint8, device=device) if a >= 0 else a)
    return tuple(fed)


class _Fragment:
    """One graph fragment of a split capture: a wrapper that trains it on ONNX Runtime, or (its
    build failed) the fragment itself in PyTorch."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        index: int,
        owner: str,
        options: dict,
        training: bool,
        fallback: bool,
        wrap: Callable[..., nn.Module],
    ) -> None:
        self.gm = gm
        self.index = index
        ops = [str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes if n.op == "call_function"]
        shown = ", ".join(dict.fromkeys(ops[:6]))
        self.name = (
            f"fragment {index} of {owner}'s split capture ({len(ops)} ops: {shown}{', ...' if len(ops) > 6 else ''})"
        )
        self.ops = len(ops)
        #: per graph input: (input, dim) whose size it is (an int dynamo passes for a symbolic size), or None
        self.sizes = _size_sources(gm)
        self.module: nn.Module = _SizesFromShapes(gm, self.sizes) if any(self.sizes) else gm
        self.module.train(training)
        self.wrapper = wrap(self.module, **{**options, "exporter": "dynamo", "fallback": False})
        self.fallback = fallback
        self.fallback_reason: str | None = None
        #: ids of the parameters this fragment has taken as inputs (over all its calls)
        self.parameter_ids: set[int] = set()

    @property
    def on_ort(self) -> bool:
        return self.fallback_reason is None and bool(self.programs)

    @property
    def programs(self) -> int:
        """How many ONNX Runtime programs this fragment's wrapper holds."""
        return len(self.wrapper.programs())

    def __call__(self, *args: Any) -> Any:
        # (one fragment can serve several module instances: the layers of a stack share their code)
        self.parameter_ids.update(id(a) for a in args if isinstance(a, nn.Parameter))
        if self.fallback_reason is not None:
            return self.gm(*args)
        # (the sizes come from the inputs' shapes, inside the graph)
        fed = _fed(args, self.sizes) if self.module is not self.gm else args
        try:
            return self.wrapper(*fed)
        except ORTWrapError as e:
            if not self.fallback:
                raise
            self.fallback_reason = f"the {e.phase} phase failed: {e.detail}"
            warn_at_user_line(
                f"ORTWrap runs {self.name} in PyTorch: {sentence(self.fallback_reason)} The other fragments "
                "still run on ONNX Runtime.",
                FallbackWarning,
            )
            return self.gm(*args)


class SplitCapture:
    """``module`` run by ``torch.compile`` with a backend that trains each graph fragment on ONNX
    Runtime (the module's own parameters, train/eval mode and grad mode; sizes dynamic)."""

    #: what holds a fragment (the onnxruntime engine's says whether its wrapper built: engines/onnxruntime/fragments.py)
    fragment_type: type = _Fragment

    def __init__(
        self,
        module: nn.Module,
        option_values: dict,
        options: Any,
        error: BaseException,
        wrap: Callable[..., nn.Module],
    ) -> None:
        self.module = module
        self._wrap = wrap  # what trains a fragment: ORTWrap (api.py hands it to the dispatcher)
        #: why the whole-graph capture failed (torch.export's data-dependent guard)
        self.reason = str(error).removeprefix("[ortwrap:export] ")
        self.options = {k: v for k, v in option_values.items() if k != "log_level"}
        self.fallback = options.fallback
        self.fragments: list[_Fragment] = []
        self.calls = 0
        self._compiled = torch.compile(module, backend=self._backend, dynamic=True)
        logger.warning(
            "the capture of %s stops on a data-dependent guard: %s. It runs as a split capture: "
            "torch.compile keeps the data-dependent Python code in Python and each graph fragment trains on "
            "ONNX Runtime (ORTWrap.split_capture.summary() says which)",
            type(module).__name__,
            self.reason.split(". ")[0][:300].rstrip("."),
        )

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        if not any(n.op == "call_function" for n in gm.graph.nodes):
            # nothing to compute (dynamo's graph before a data-dependent check that reads only the
            # inputs, gaussian_nll_loss's ``torch.any(var < 0)`` with dynamic sizes): it returns its
            # inputs or constants, as it does in PyTorch; no program to build
            return gm
        fragment = self.fragment_type(
            gm,
            len(self.fragments),
            type(self.module).__name__,
            self.options,
            self.module.training,
            self.fallback,
            self._wrap,
        )
        self.fragments.append(fragment)
        logger.debug("split capture: %s", fragment.name)
        return fragment

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        before = len(self.fragments)
        with warnings.catch_warnings():
            # (torch.compile's own warnings about the graph breaks are the summary's to say)
            warnings.filterwarnings("ignore", module=r"torch\._dynamo.*")
            # NOTE: dynamo captures a frame again per module instance and per guard that fails, and
            # past its recompile limit (8 a code object) it runs the frame in PyTorch, said only in
            # torch's log: a stack of layers shares one code object, and so do transformers'
            # decorators across models (Mixtral after DBRX in one process: no fragment at all).
            # NOTE: dynamic=True makes float attributes symbolic too (``self.scaling``, a dropout's
            # ``p``: 0-d tensors read with ``.item()`` in the fragment, on which torch.export cannot
            # decide): floats stay constants. Without duck sizing, a length of 8 and a head dim of 8
            # are not one symbol (the next length would capture the frame again).
            with compat.dynamo_dynamic_capture(_PER_CODE, _TOTAL):
                out = self._compiled(*args, **kwargs)
        if self.calls == 1 or len(self.fragments) != before:
            on_ort = sum(f.on_ort for f in self.fragments)
            if self.calls == 1 and not on_ort:
                warn_at_user_line(
                    f"ORTWrap runs {type(self.module).__name__} in PyTorch: its split capture put no graph fragment "
                    "on ONNX Runtime",
                    FallbackWarning,
                )
            (logger.warning if self.calls == 1 else logger.info)("%s", self.summary())
        return out

    def summary(self) -> str:
        """What runs where: the fragments on ONNX Runtime and in PyTorch, and the parameters that no
        fragment takes (their ops ran in PyTorch, where dynamo could not capture them)."""
        on_ort = [f for f in self.fragments if f.on_ort]
        eager = [f for f in self.fragments if f.fallback_reason is not None]
        left = self.parameters_in_pytorch
        text = (
            f"split capture of {type(self.module).__name__}: {len(on_ort)} fragments on ONNX Runtime "
            f"({self.programs} programs), "
            f"{len(eager)} in PyTorch (build failed)"
        )
        if left:
            text += (
                f"; code dynamo cannot capture (a graph break inside a loop) runs in PyTorch, and no fragment takes "
                f"the parameters {', '.join(left[:8])}{', ...' if len(left) > 8 else ''}"
            )
        return text

    @property
    def programs(self) -> int:
        """How many ONNX Runtime programs the fragments hold (one a fragment for every length it
        was called with, unless a capture fixed a size: then one per size)."""
        return sum(f.programs for f in self.fragments)

    @property
    def parameters_in_pytorch(self) -> list[str]:
        """The trainable parameters that no fragment on ONNX Runtime takes."""
        taken: set[int] = set()
        for f in self.fragments:
            if f.on_ort:
                taken |= f.parameter_ids
        return [n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in taken]
