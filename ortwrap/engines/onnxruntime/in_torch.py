"""Ops of an AOTAutograd graph that this engine runs in PyTorch between ORT segments (``split.py``) even
though ONNX could express them: random draws and complex values.

**Random ops draw from torch's generator.** The contract is eager's numbers under the same
``torch.manual_seed``: a dropout mask, ``torch.rand_like``, ``uniform_``, ``normal_``, ``bernoulli``,
``exponential_``, ``randperm``, ``randint``, ``multinomial`` are the draws eager would make. ONNX's
random ops (``Dropout``, ``RandomUniformLike``, ``Bernoulli``, ...) draw from ORT's own generator, seeded
apart from torch's, so they cannot give eager's mask (before this, ``nn.Dropout`` in training mode ran
as ORT's Dropout: a different mask each step). Every node whose op carries torch's
``nondeterministic_seeded`` tag runs as its ATen op in PyTorch, in graph order (the order eager draws
in; AOTAutograd's min-cut partitioner never recomputes a random op in the backward, so each is drawn
once). The trace also keeps the draws as eager makes them: ``aten.bernoulli`` (CPU eager: its own
kernel) is not decomposed into ``rand_like(p) < p`` (:data:`KEEP_WHOLE`); ``nn.Dropout`` is traced as
``aten.native_dropout``, whose CPU kernel draws ``bernoulli_(1 - p)`` on a tensor of the input's shape,
the draw eager's ``dropout`` makes. ``uniform_`` on a fresh tensor is ``prims.uniform`` (an
``empty(...).uniform_`` in PyTorch: the same draw).

**Complex values stay in PyTorch.** ORT has no complex kernels and IOBinding no complex type: a node
that takes or gives a complex tensor (``view_as_complex``, ``polar``, a complex ``mul``, ``view_as_real``,
their backward's ``conj``) runs in PyTorch, so ORT segments see only real tensors and the complex
values the forward saves for the backward (DeepSeek-V2's RoPE frequencies) are torch tensors handed
over as they are. Rewriting the complex ops as real pairs (``[..., 2]``, torchlib's convention, as the
training engine's graphs do) would keep the region in ORT; the split needs no rewrite of the forward
and of the backward's conjugates, and costs a segment boundary per complex region (DeepSeek-V2: the
RoPE of q and k, per layer).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KEEP_WHOLE", "random_op", "touches_complex"]

#: random ops torch.export's default table decomposes into other draws: kept whole, so that PyTorch
#: draws as eager does (``bernoulli(p)``'s decomposition is ``rand_like(p) < p``, another stream)
KEEP_WHOLE = (torch.ops.aten.bernoulli.default,)


def random_op(target: Any) -> bool:
    """Whether ``target`` draws from torch's generator (the op's ``nondeterministic_seeded`` tag)."""
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _complex(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_complex()
    if isinstance(value, (tuple, list)):
        return any(_complex(v) for v in value)
    return False


def touches_complex(node: torch.fx.Node) -> bool:
    """Whether ``node`` takes or gives a complex tensor (its FX ``val`` metadata)."""
    return _complex(node.meta.get("val")) or any(_complex(n.meta.get("val")) for n in node.all_input_nodes)
