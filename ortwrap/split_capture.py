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

Fragments are captured with static shapes (``dynamic=False``): dynamo captures a frame again for
each new shape (and each new count of loop iterations), and each capture is its own fragment and
program. Parameters reach the fragments as inputs (dynamo lifts them), so their gradients
accumulate on the module's own parameters, and ``state_dict`` and the optimizer see one set.
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
        gm.train(training)
        self.wrapper = wrap(gm, **{**options, "exporter": "dynamo", "fallback": False})
        self.fallback = fallback
        self.fallback_reason: str | None = None
        #: ids of the parameters this fragment has taken as inputs (over all its calls)
        self.parameter_ids: set[int] = set()

    @property
    def on_ort(self) -> bool:
        return self.fallback_reason is None and bool(self.wrapper.programs())

    def __call__(self, *args: Any) -> Any:
        # (one fragment can serve several module instances: the layers of a stack share their code)
        self.parameter_ids.update(id(a) for a in args if isinstance(a, nn.Parameter))
        if self.fallback_reason is not None:
            return self.gm(*args)
        try:
            return self.wrapper(*args)
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
    Runtime (the module's own parameters, train/eval mode and grad mode; one capture per shape)."""

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
        self._compiled = torch.compile(module, backend=self._backend, dynamic=False)
        logger.warning(
            "the capture of %s stops on a data-dependent guard: %s. It runs as a split capture: "
            "torch.compile keeps the data-dependent Python code in Python and each graph fragment trains on "
            "ONNX Runtime (ORTWrap.split_capture.summary() says which)",
            type(module).__name__,
            self.reason.split(". ")[0][:300].rstrip("."),
        )

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        fragment = _Fragment(
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
            # NOTE: dynamo captures a frame once per shape and per module instance, and past its
            # recompile limit (8 a code object) it runs the frame in PyTorch, said only in torch's log:
            # a stack of layers shares one code object, and so do transformers' decorators across
            # models (Mixtral after DBRX in one process: no fragment at all).
            with compat.dynamo_recompile_limits(_PER_CODE, _TOTAL):
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
            f"split capture of {type(self.module).__name__}: {len(on_ort)} fragments on ONNX Runtime, "
            f"{len(eager)} in PyTorch (build failed)"
        )
        if left:
            text += (
                f"; code dynamo cannot capture (a graph break inside a loop) runs in PyTorch, and no fragment takes "
                f"the parameters {', '.join(left[:8])}{', ...' if len(left) > 8 else ''}"
            )
        return text

    @property
    def parameters_in_pytorch(self) -> list[str]:
        """The trainable parameters that no fragment on ONNX Runtime takes."""
        taken: set[int] = set()
        for f in self.fragments:
            if f.on_ort:
                taken |= f.parameter_ids
        return [n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in taken]
