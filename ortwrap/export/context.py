"""What surrounds each capture and translation of a module, registered from above.

The exporters enter :func:`capture_context` around running the user's module (capture) and around
the translation (which may run it again). A higher layer registers what must be active then:
``integrations/distributed.py`` registers its collective stubs (``torch.distributed`` calls made
while exporting do not communicate). The exporters never import an integration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["capture_context", "register_capture_context"]

_FACTORIES: list[Callable[[], contextlib.AbstractContextManager]] = []


def register_capture_context(factory: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Enter ``factory()`` around every capture and translation from now on (once per factory)."""
    if factory not in _FACTORIES:
        _FACTORIES.append(factory)


@contextlib.contextmanager
def capture_context() -> Iterator[None]:
    """Every registered context, nested in registration order."""
    with contextlib.ExitStack() as stack:
        for factory in _FACTORIES:
            stack.enter_context(factory())
        yield
