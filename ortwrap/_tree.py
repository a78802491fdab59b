"""Flattening of nested inputs and outputs into tensor leaves and a hashable spec.

Containers: tuple, namedtuple, list, dict (and subclasses such as OrderedDict and transformers'
``ModelOutput``) and dataclasses. Leaves are tensors or constants. The spec is hashable when its
constants are, so the input spec is a cache key: a new structure or constant value means a new
export.

Outputs (``objects=True``) also take apart the objects a module returns that hold tensors: a type
registered with torch's pytree by its children, any other object by its attributes (``__dict__``
and ``__slots__``: transformers' ``DynamicCache`` and its layers, a user's result class). Each call then rebuilds a new object of
the class from that call's tensors (``cls.__new__`` and the attributes; ``__init__`` does not run).
Objects that hold no tensor stay opaque: the same object every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TENSOR", "flatten", "holds_tensors", "unflatten"]

#: Spec of a tensor leaf.
TENSOR = ("T",)
#: Spec of an ``int`` input fed as a 0-d int64 tensor leaf (``promote_ints``): inside an export it
#: reaches the module as that tensor (TorchScript) or as its ``.item()`` (torch.export: a symbolic int).
INT = ("I",)

_CONST_TYPES = (int, float, bool, type(None), str, torch.dtype, torch.device)
#: Spec of a symbolic float output, returned as a 0-d float64 tensor leaf (``.item()`` on each call).
FLOAT = ("F",)
#: Spec of a complex tensor output, carried as its ``view_as_real`` (a real leaf with a trailing dim
#: of 2: ONNX Runtime has no complex tensors) and returned as ``view_as_complex`` of it, through
#: which autograd takes the gradient back.
COMPLEX = ("Z",)
_SYMBOLIC_TYPES = (torch.SymInt, torch.SymFloat)


def flatten(
    obj: Any, path: str, leaves: list[torch.Tensor], on_other: Callable[[str, Any], Any], objects: bool = False
) -> tuple:
    """Append the tensors of ``obj`` to ``leaves`` and return the spec of ``obj``.

    Args:
        obj: the object to flatten.
        path: where ``obj`` sits, for error messages (``"x"``, ``"batch['ids']"``).
        leaves: list the tensor leaves are appended to, depth first.
        on_other: called as ``on_other(path, value)`` for a leaf that is neither a tensor nor a
            constant; returns the spec to store or raises.
        objects: take apart objects that hold tensors (see the module docstring); for outputs.
    """
    if isinstance(obj, torch.Tensor):
        if objects and obj.is_complex():
            # (resolve_conj: ``fft.ifft`` of a real tensor is a lazy conjugate, which has no real view)
            leaves.append(torch.view_as_real(obj.resolve_conj()))
            return COMPLEX
        leaves.append(obj)
        return TENSOR
    cls = type(obj)
    if cls in _CONST_TYPES:
        return ("C", cls, obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # Dataclasses, including transformers' ModelOutput (an OrderedDict and a dataclass): keep
        # the fields that are set, in field order.
        names = tuple(f.name for f in dataclasses.fields(obj) if getattr(obj, f.name) is not None)
        return (
            "D",
            cls,
            names,
            tuple(flatten(getattr(obj, n), f"{path}.{n}", leaves, on_other, objects) for n in names),
        )
    if isinstance(obj, dict):
        keys = tuple(obj.keys())
        return ("M", cls, keys, tuple(flatten(obj[k], f"{path}[{k!r}]", leaves, on_other, objects) for k in keys))
    if isinstance(obj, (tuple, list)):
        children = tuple(flatten(v, f"{path}[{i}]", leaves, on_other, objects) for i, v in enumerate(obj))
        return ("S", cls, children)
    if objects and cls in _SYMBOLIC_TYPES:
        # NOTE: a size a torch.export capture keeps symbolic (a cache layer's length): an int64
        # graph output, an int again on every call (its ShapeEnv must not be taken apart).
        leaves.append(torch.scalar_tensor(obj, dtype=torch.int64 if cls is torch.SymInt else torch.float64))
        return INT if cls is torch.SymInt else FLOAT
    if objects and id(obj) not in _active and holds_tensors(obj) and not isinstance(obj, (torch.nn.Module, type)):
        _active.add(id(obj))  # an object that holds itself (a parent link) is opaque the second time
        try:
            return _object(obj, path, leaves, on_other)
        finally:
            _active.discard(id(obj))
    return on_other(path, obj)


#: ids of the objects being taken apart (``flatten(objects=True)``), against reference cycles.
_active: set[int] = set()


def _object(obj: Any, path: str, leaves: list[torch.Tensor], on_other: Callable[[str, Any], Any]) -> tuple:
    """The spec of an object that holds tensors: by its pytree children, or by its attributes."""
    from ._compat import torch as compat

    cls = type(obj)
    node = compat.pytree_children(obj)
    if node is not None:
        children, context = node
        specs = tuple(flatten(c, f"{path}<{i}>", leaves, on_other, True) for i, c in enumerate(children))
        return ("P", cls, context, specs)
    attributes = _attributes(obj)
    if attributes is not None:
        names = tuple(attributes)
        specs = tuple(flatten(attributes[n], f"{path}.{n}", leaves, on_other, True) for n in names)
        return ("A", cls, names, specs)
    return on_other(path, obj)


def _attributes(obj: Any) -> dict[str, Any] | None:
    """An object's attributes: its ``__dict__`` and the ``__slots__`` it has set; None if it has neither."""
    attributes = getattr(obj, "__dict__", None)
    out = dict(attributes) if isinstance(attributes, dict) else None
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                out = {} if out is None else out
                out[name] = getattr(obj, name)
    return out


def holds_tensors(value: Any, depth: int = 8) -> bool:
    """Whether an object, its attributes (or their lists, tuples and dicts) hold tensors."""
    if isinstance(value, torch.Tensor):
        return True
    if depth < 0 or isinstance(value, (torch.nn.Module, type)) or type(value) in _CONST_TYPES:
        return False
    if isinstance(value, dict):
        return any(holds_tensors(v, depth - 1) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(holds_tensors(v, depth - 1) for v in value)
    if type(value) in _SYMBOLIC_TYPES:
        return True  # (as a tensor output: see flatten)
    attributes = _attributes(value)
    return attributes is not None and any(holds_tensors(v, depth - 1) for v in attributes.values())


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
    if kind == "Z":
        value = next(it)
        return torch.view_as_complex(value if value.stride(-1) == 1 else value.contiguous())
    if kind == "I" or kind == "F":
        value = next(it)
        return value if torch.jit.is_tracing() else value.item()
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
    if kind == "P":  # a registered pytree type (outputs only)
        from ._compat import torch as compat

        cls, context, children = spec[1], spec[2], spec[3]
        return compat.pytree_rebuild(cls, [_build(c, it) for c in children], context)
    if kind == "A":  # an object rebuilt from its attributes (outputs only)
        cls, names, children = spec[1], spec[2], spec[3]
        obj = cls.__new__(cls)
        for n, c in zip(names, children):
            object.__setattr__(obj, n, _build(c, it))  # past a frozen class's __setattr__
        return obj
    raise AssertionError(f"unknown spec kind {kind!r}")


def _is_int(spec: tuple) -> bool:
    return spec[0] == "C" and spec[1] is int


def int_constants(spec: tuple) -> list[int]:
    """The ``int`` constants of an input spec, in flattening order."""
    out: list[int] = []

    def walk(s: tuple) -> None:
        if _is_int(s):
            out.append(s[2])
        elif s[0] == "S":
            for c in s[2]:
                walk(c)
        elif s[0] in ("M", "D"):
            for c in s[3]:
                walk(c)

    walk(spec)
    return out


def rewrite_ints(
    spec: tuple, leaves: list[torch.Tensor], change: Callable[[int, int], Any], device: torch.device | None = None
) -> tuple:
    """``spec`` with each ``int`` constant (the ``i``-th, value ``v``) replaced by ``change(i, v)``:
    an int (a new constant), :data:`INT` (fed as a leaf: a 0-d int64 tensor of ``v`` is inserted
    into ``leaves`` where the spec consumes it, on ``device``), or None (no value: a key for every
    value). ``leaves`` (the spec's tensors, in order) is updated in place."""
    source = list(leaves)
    leaves.clear()
    position = [0, 0]  # next int, next source leaf

    def walk(s: tuple) -> tuple:
        kind = s[0]
        if kind == "T":
            leaves.append(source[position[1]])
            position[1] += 1
            return s
        if kind == "I":
            leaves.append(source[position[1]])
            position[1] += 1
            return s
        if _is_int(s):
            i = position[0]
            position[0] += 1
            new = change(i, s[2])
            if new is INT:
                leaves.append(torch.tensor(s[2], dtype=torch.int64, device=device))
                return INT
            return ("C", int, new)
        if kind == "S":
            return ("S", s[1], tuple(walk(c) for c in s[2]))
        if kind in ("M", "D"):
            return (kind, s[1], s[2], tuple(walk(c) for c in s[3]))
        return s

    return walk(spec)
