"""Flattening of nested inputs and outputs into tensor leaves and a hashable spec.

Containers: tuple, namedtuple, list, dict (and subclasses such as OrderedDict and transformers'
``ModelOutput``) and dataclasses. Leaves are tensors or constants. The spec is hashable when its
constants are, so the input spec is a cache key: a new structure or constant value means a new
export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TENSOR", "flatten", "unflatten"]

#: Spec of a tensor leaf.
TENSOR = ("T",)

_CONST_TYPES = (int, float, bool, type(None), str, torch.dtype, torch.device)


def flatten(obj: Any, path: str, leaves: list[torch.Tensor], on_other: Callable[[str, Any], Any]) -> tuple:
    """Append the tensors of ``obj`` to ``leaves`` and return the spec of ``obj``.

    Args:
        obj: the object to flatten.
        path: where ``obj`` sits, for error messages (``"x"``, ``"batch['ids']"``).
        leaves: list the tensor leaves are appended to, depth first.
        on_other: called as ``on_other(path, value)`` for a leaf that is neither a tensor nor a
            constant; returns the spec to store or raises.
    """
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return TENSOR
    cls = type(obj)
    if cls in _CONST_TYPES:
        return ("C", cls, obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # Dataclasses, including transformers' ModelOutput (an OrderedDict and a dataclass): keep
        # the fields that are set, in field order.
        names = tuple(f.name for f in dataclasses.fields(obj) if getattr(obj, f.name) is not None)
        return ("D", cls, names, tuple(flatten(getattr(obj, n), f"{path}.{n}", leaves, on_other) for n in names))
    if isinstance(obj, dict):
        keys = tuple(obj.keys())
        return ("M", cls, keys, tuple(flatten(obj[k], f"{path}[{k!r}]", leaves, on_other) for k in keys))
    if isinstance(obj, (tuple, list)):
        children = tuple(flatten(v, f"{path}[{i}]", leaves, on_other) for i, v in enumerate(obj))
        return ("S", cls, children)
    return on_other(path, obj)


def unflatten(spec: tuple, leaves: Any) -> Any:
    """Rebuild the object described by ``spec`` from an iterator over its tensor leaves."""
    it = iter(leaves)
    return _build(spec, it)


def _build(spec: tuple, it: Any) -> Any:
    kind = spec[0]
    if kind == "T":
        return next(it)
    if kind == "C":
        return spec[2]
    if kind == "O":  # an opaque object kept by identity (outputs only)
        return spec[1]
    if kind == "S":
        cls, children = spec[1], spec[2]
        values = [_build(c, it) for c in children]
        if cls is tuple or cls is list:
            return cls(values)
        if hasattr(cls, "_fields"):  # namedtuple
            return cls(*values)
        return cls(values)
    if kind == "M":
        cls, keys, children = spec[1], spec[2], spec[3]
        values = [_build(c, it) for c in children]
        if cls is dict:
            return dict(zip(keys, values))
        return cls(zip(keys, values))
    if kind == "D":
        cls, names, children = spec[1], spec[2], spec[3]
        return cls(**{n: _build(c, it) for n, c in zip(names, children)})
    raise AssertionError(f"unknown spec kind {kind!r}")
