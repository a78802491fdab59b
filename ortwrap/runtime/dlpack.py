"""torch.Tensor <-> OrtValue without copies, through DLPack.

NOTE: ownership. ``to_ortvalues`` hands ORT a DLPack capsule that keeps the torch storage alive for
as long as the OrtValue lives; ``to_tensors`` hands torch a capsule that keeps ORT's buffer alive
for as long as the tensor lives. No bytes are copied either way. Bool tensors cross as uint8 views
(ORT 1.19.2 predates DLPack's bool type) and are viewed back as bool.
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from .._ort import C


def to_ortvalues(tensors: list[torch.Tensor]) -> C.OrtValueVector:
    """Wrap ``tensors`` (made contiguous if they are not) as an OrtValueVector."""
    vec = C.OrtValueVector()
    vec.reserve(len(tensors))
    push = vec.push_back
    for t in tensors:
        if not t.is_contiguous():
            t = t.contiguous()
        if t.dtype is torch.bool:
            push(to_dlpack(t.view(torch.uint8)), True)
        else:
            push(to_dlpack(t), False)
    return vec


def to_tensors(values: C.OrtValueVector) -> list[torch.Tensor]:
    """Turn every OrtValue of ``values`` into a torch tensor sharing its memory."""
    out = values.to_dlpacks(from_dlpack)
    for i in values.bool_tensor_indices():
        out[i] = out[i].view(torch.bool)
    return out
