"""What the dynamo translation does when torchlib's translation of one call fails.

torchlib's translations are written for the calls inference models make; some raise on a call they
did not foresee (``aten.amax`` of a 0-d tensor without ``dim``: "Required parameter 'dim' is not
provided"; ``aten.roll``/``diff`` with arguments ortwrap's or torchlib's form does not take; SDPA on
3-D inputs), and the exporter's decompositions leave ``prims`` ops that torchlib translates only for
some arguments (``cumprod`` -> ``prims.prod``). The general rule: an op whose translation fails runs
as an ATen node (PyTorch's kernel forward, PyTorch's autograd for its gradient), so
:func:`retry_plan` reads the failed call from the exporter's error and says what the next attempt
changes: that aten op joins the ATen-node ops, or (a ``prims`` op a decomposition left) the graph is
translated without decompositions, every op without a translation an ATen node. An attempt that
changes nothing re-raises (the refusal names the op and the translation's own error).

:func:`drop_error_checks`: ``torch.export`` wraps ``aten._linalg_check_errors`` (``linalg.inv``,
``solve``, ``cholesky``, ``lu_factor`` raise on a singular input in eager) in a ``with_effects``
call threaded by an effect token, which the exporter cannot translate at all. The check has no
output; ortwrap drops it (with the tokens): on a singular input ORT's run returns eager's kernel's
inf/NaN instead of raising. The exporter's decompositions trace the call again: the decomposed
program is cleaned the same way before its translation.
"""

from __future__ import annotations

import re

import torch

from .._compat import torch as compat

_FAILED_NODE = re.compile(r"Error when translating node %\S+ : .*?target=torch\.ops\.(\w+)\.(\w+)(?:\.\w+)?\]")


def drop_error_checks(program: torch.export.ExportedProgram) -> None:
    """Remove the effect tokens of ``program`` and its ``_linalg_check_errors`` calls (in place)."""
    graph = program.graph_module.graph
    effects = torch.ops.higher_order.with_effects
    if not any(n.op == "call_function" and n.target is effects for n in graph.nodes):
        return
    compat.remove_effect_tokens(program)
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in list(module.graph.nodes):
            if node.op == "call_function" and compat.is_linalg_check_errors(node.target):
                if not node.users:
                    module.graph.erase_node(node)
        module.recompile()


def failed_call(error: BaseException) -> tuple[str, str] | None:
    """(namespace, op name) of the call whose translation raised ``error`` (the exporter's
    ``ConversionError`` in its chain), or None."""
    seen = 0
    while error is not None and seen < 12:
        match = _FAILED_NODE.search(" ".join(str(error).split()))
        if match and type(error).__name__ == "ConversionError":
            return match.group(1), match.group(2)
        error = error.__cause__ or error.__context__
        seen += 1
    return None


def retry_plan(error: BaseException, aten_ops: list[str], keep_ops: bool) -> tuple[list[str], bool] | None:
    """The next attempt's (extra ATen-node ops, translate without decompositions) after ``error``,
    or None when retrying would change nothing."""
    failed = failed_call(error)
    if failed is None:
        return None
    namespace, name = failed
    if namespace == "aten" and name not in aten_ops:
        return [*aten_ops, name], keep_ops
    if namespace == "prims" and not keep_ops:  # left by the decompositions
        return aten_ops, True
    return None
