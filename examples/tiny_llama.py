"""A llama-style decoder block, used by the CPU-fallback tests and benchmark.

RMSNorm, rotary position embeddings from a precomputed table sliced to the sequence length,
causal attention with an explicit mask built from the sequence length, and a SwiGLU MLP. Every
sequence-length-dependent size is computed from ``x.shape`` inside ``forward``, so an exported
graph is full of shape computations (``Slice`` ends, ``ConstantOfShape``/``Range`` inputs,
``Reshape`` shapes) that kernels read on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    d: int = 64
    heads: int = 4
    hidden: int = 172
    max_len: int = 64
    layers: int = 1
    eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.d // cfg.heads
        self.attn_norm = RMSNorm(cfg.d, cfg.eps)
        self.q = nn.Linear(cfg.d, cfg.d, bias=False)
        self.k = nn.Linear(cfg.d, cfg.d, bias=False)
        self.v = nn.Linear(cfg.d, cfg.d, bias=False)
        self.o = nn.Linear(cfg.d, cfg.d, bias=False)
        self.mlp_norm = RMSNorm(cfg.d, cfg.eps)
        self.gate = nn.Linear(cfg.d, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.d, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.d, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(cfg.max_len).float(), inv_freq)
        table = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", table.cos(), persistent=True)
        self.register_buffer("sin", table.sin(), persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        cos, sin = self.cos[:t], self.sin[:t]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5 + mask
        a = torch.softmax(scores, dim=-1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    """Token embedding, ``cfg.layers`` llama blocks, a final RMSNorm and an LM head."""

    def __init__(self, cfg: LlamaConfig | None = None, vocab: int = 256) -> None:
        super().__init__()
        cfg = cfg or LlamaConfig()
        self.tok = nn.Embedding(vocab, cfg.d)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d, cfg.eps)
        self.head = nn.Linear(cfg.d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))
