"""torch.Tensor <-> OrtValue without copies, through DLPack.

NOTE: ownership. ``push_tensor`` hands ORT a DLPack capsule that keeps the torch storage alive for
as long as the OrtValue lives; ``to_tensors`` hands torch a capsule that keeps ORT's buffer alive
for as long as the tensor lives. No bytes are copied either way. Bool tensors cross as uint8 views
(ORT 1.19.2 predates DLPack's bool type) and are viewed back as bool.
"""

from __future__ import annotations

import torch

from .._compat import torch as compat
from .._ort import C

#: torch.utils.dlpack.to_dlpack is autograd's C entry point itself. (Its from_dlpack adds Python
#: checks that cost about a microsecond a tensor on every step: runners take the C entry point
#: from ``compat.from_dlpack()`` when they are created, never at import.)
to_dlpack = torch.utils.dlpack.to_dlpack


def push_tensor(vec: C.OrtValueVector, t: torch.Tensor) -> None:
    """Append ``t`` (made contiguous if it is not; bool as a uint8 view) to ``vec`` without a copy."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype is torch.bool:
        vec.push_back(to_dlpack(t.view(torch.uint8)), True)
    else:
        vec.push_back(to_dlpack(t), False)


def ortvalue(t: torch.Tensor) -> C.OrtValue:
    """One OrtValue sharing ``t``'s memory (``t`` must be contiguous); it keeps ``t`` alive."""
    if t.dtype is torch.bool:
        return C.OrtValue.from_dlpack(to_dlpack(t.view(torch.uint8)), True)
    return C.OrtValue.from_dlpack(to_dlpack(t), False)


class StateValueCache:
    """OrtValues for parameters and buffers, reused across steps while their memory is unchanged.

    NOTE: an optimizer updates parameters in place, so the OrtValue wrapping a parameter's memory
    stays valid from step to step; wrapping it again each step would cost about a microsecond per
    tensor. A cached OrtValue is reused only while the tensor is the same object with the same data
    pointer, shape and dtype; otherwise (``load_state_dict(assign=True)``, ``param.data = ...``) it
    is rebuilt. The cache keeps the wrapped tensors alive until they are replaced.
    """

    __slots__ = ("copies", "pointers", "tensors", "values", "versions")

    def __init__(self, n: int) -> None:
        self.tensors: list[torch.Tensor | None] = [None] * n
        self.pointers: list[int] = [0] * n
        self.values: list[C.OrtValue | None] = [None] * n
        self.versions: list[int] = [-1] * n
        #: the float32 copies fed for half-precision state (``float_copy``)
        self.copies: list[torch.Tensor | None] = [None] * n

    def float_copy(self, i: int, t: torch.Tensor) -> C.OrtValue:
        """The OrtValue of a float32 copy of ``t`` (feed ``i``), made again only when ``t`` is another
        tensor, moved, or written in place since (its version counter)."""
        version = compat.tensor_version(t)
        if self.tensors[i] is t and self.pointers[i] == t.data_ptr() and self.versions[i] == version:
            return self.values[i]
        with torch.no_grad():
            copy = t.detach().to(torch.float32, memory_format=torch.contiguous_format)
        ov = ortvalue(copy)
        self.tensors[i], self.pointers[i], self.values[i] = t, t.data_ptr(), ov
        self.versions[i], self.copies[i] = version, copy
        return ov

    def refresh(self, i: int, t: torch.Tensor) -> C.OrtValue:
        """Wrap ``t`` (the feed at index ``i``) anew and remember it."""
        if not t.is_contiguous():
            t = t.contiguous()
        ov = ortvalue(t)
        self.tensors[i], self.pointers[i], self.values[i] = t, t.data_ptr(), ov
        return ov


def to_tensors(values: C.OrtValueVector, may_hold_bool: bool = True) -> list[torch.Tensor]:
    """Turn every OrtValue of ``values`` into a torch tensor sharing its memory.

    ``may_hold_bool=False`` skips looking for bool tensors (which cross as uint8).
    """
    out = values.to_dlpacks(compat.from_dlpack())
    if may_hold_bool:
        for i in values.bool_tensor_indices():
            out[i] = out[i].view(torch.bool)
    return out
