"""Optional libraries (DeepSpeed, torch.distributed wrappers) hook into ORTWrap through one seam.

An :class:`Integration` can act at four documented points; ``ORTWrap`` calls them and never names
an integration:

- **wrap time**: :meth:`Integration.check_wrappable` refuses a module the integration knows cannot
  work inside ORTWrap (``DistributedDataParallel(model)`` inside ORTWrap, ...).
- **around a step**: :meth:`Integration.step` runs a call it takes over (DeepSpeed ZeRO-3: gather
  the partitioned parameters, run, release them after the backward). The wrapper hands it a
  :class:`Step`: ``step.run()`` runs the wrapper's own forward and returns a :class:`StepOutcome`
  (the output, and ``fell_back``: whether the call ran in PyTorch); ``step.fall_back(error)`` makes
  the call's input signature fall back. :meth:`Integration.applies` is asked on every call and must
  be cheap.
- **before export**: :meth:`Integration.export_context` surrounds each export (DeepSpeed's module
  hooks hidden while tracing).
- **after the gradient build**: :meth:`Integration.rewrite_graph` may rewrite the built training
  graph (DeepSpeed ZeRO-3 with ``zero3_gather="submodule"``: per-layer gathers in the backward).
- **parameter gather and release**: :meth:`Integration.gather` and :meth:`Integration.release`,
  which :meth:`step` implementations use, and which ``ORTWrap`` calls around work that reads all
  parameters outside a step (``verify=True``'s eager run).

:data:`INTEGRATIONS` lists them; each imports its library lazily, so importing ortwrap imports none.
What an integration may use of the wrapper is :class:`Wrapper` (it imports nothing of ``api.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

    from ..errors import ORTWrapError
    from ..grad.builder import TrainingGraph
    from ..options import Options
    from ..runtime.program import Program

__all__ = [
    "INTEGRATIONS",
    "Integration",
    "Step",
    "StepOutcome",
    "Wrapper",
    "check_wrappable",
    "export_context",
    "register",
    "rewrite_graph",
    "step_integration",
    "wrapper_attribute",
]


class Wrapper(Protocol):
    """What an integration may use of the wrapper (an ``ortwrap.ORTWrap``). Its own bookkeeping it
    keeps in the wrapper's ``__dict__``, under the names its ``wrapper_attributes`` declare."""

    module: nn.Module
    __dict__: dict[str, Any]

    @property
    def options(self) -> Options: ...

    def programs(self) -> list[Program]:
        """Every compiled program of the wrapper."""
        ...


@dataclass(frozen=True)
class StepOutcome:
    """What the wrapper's forward did with a call an integration took over (:meth:`Step.run`)."""

    #: the call's output
    output: Any
    #: the call ran in PyTorch: its input signature fell back (on this call or an earlier one).
    #: The module then ran under its own hooks (the integration's, which gather what they need).
    fell_back: bool


class Step(Protocol):
    """One call an integration takes over (:meth:`Integration.step`)."""

    args: tuple
    kwargs: dict

    @property
    def fell_back_before(self) -> bool:
        """Whether some earlier call of this wrapper fell back (some input signature runs in PyTorch)."""
        ...

    def run(self) -> StepOutcome:
        """Run the call through the wrapper's own forward."""
        ...

    def fall_back(self, error: ORTWrapError) -> Any:
        """Fall back for this call's input signature (said once, remembered) and run the call in PyTorch."""
        ...


class Integration:
    """The seam's default: every hook does nothing."""

    name = "integration"

    def check_wrappable(self, module: nn.Module) -> None:
        """Raise if ``module`` cannot be wrapped (called once, by ``ORTWrap.__init__``)."""

    def applies(self, wrapper: Wrapper) -> bool:
        """Whether :meth:`step` takes over this wrapper's calls now (asked on every call: keep it cheap)."""
        return False

    def step(self, wrapper: Wrapper, step: Step) -> Any:
        """Run the call (``step.run()``, the wrapper's own forward) with what the integration needs
        around it; return its output."""
        return step.run().output

    def export_context(self, wrapper: Wrapper) -> contextlib.AbstractContextManager:
        """What surrounds an export of ``wrapper``'s module."""
        return contextlib.nullcontext()

    def rewrite_graph(self, graph: TrainingGraph) -> TrainingGraph:
        """The built (forward+backward or inference) graph, rewritten before its session is created."""
        return graph

    #: Prefixes of attribute names the integration sets on the wrapper itself (its bookkeeping);
    #: other attributes set on a wrapper go to the wrapped module.
    wrapper_attributes: tuple[str, ...] = ()


#: Every integration, in the order their hooks run: filled by :func:`register` (ortwrap's own by
#: ``integrations/builtin.py``, which the package imports; the seam imports none of them).
INTEGRATIONS: list[Integration] = []
#: Those that may take a step over (asked on every call, so only these are asked).
_STEPPING: tuple[Integration, ...] = ()
_WRAPPER_ATTRIBUTES: tuple[str, ...] = ()


def register(integration: Integration) -> None:
    """Add ``integration`` after those registered before it (its hooks run in that order)."""
    global _STEPPING, _WRAPPER_ATTRIBUTES
    INTEGRATIONS.append(integration)
    _STEPPING = tuple(i for i in INTEGRATIONS if type(i).applies is not Integration.applies)
    _WRAPPER_ATTRIBUTES = tuple(p for i in INTEGRATIONS for p in i.wrapper_attributes)


def check_wrappable(module: nn.Module) -> None:
    """Every integration's wrap-time check."""
    for integration in INTEGRATIONS:
        integration.check_wrappable(module)


def wrapper_attribute(name: str) -> bool:
    """Whether an integration keeps attribute ``name`` on the wrapper rather than on the wrapped module."""
    return name.startswith(_WRAPPER_ATTRIBUTES) if _WRAPPER_ATTRIBUTES else False


def step_integration(wrapper: Wrapper) -> Integration | None:
    """The integration that takes over this call, if any (per step: a cheap check each)."""
    for integration in _STEPPING:
        if integration.applies(wrapper):
            return integration
    return None


@contextlib.contextmanager
def export_context(wrapper: Wrapper) -> Iterator[None]:
    """Every integration's export context, nested in list order."""
    with contextlib.ExitStack() as stack:
        for integration in INTEGRATIONS:
            stack.enter_context(integration.export_context(wrapper))
        yield


def rewrite_graph(graph: TrainingGraph) -> TrainingGraph:
    """Every integration's rewrite of a built graph, in list order."""
    for integration in INTEGRATIONS:
        graph = integration.rewrite_graph(graph)
    return graph
