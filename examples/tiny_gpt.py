"""A small GPT-style language model, used by the demo, the benchmarks and the tests.

Token + position embeddings, pre-LayerNorm blocks with causal self-attention
(``F.scaled_dot_product_attention``) and a GELU MLP, a tied LM head, and the cross-entropy loss
computed inside the module, as training code commonly does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab: int = 512
    d: int = 256
    heads: int = 4
    layers: int = 4
    max_len: int = 128
    dropout: float = 0.0


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d)
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d)
        self.proj = nn.Linear(cfg.d, cfg.d)
        self.ln2 = nn.LayerNorm(cfg.d)
        self.fc = nn.Linear(cfg.d, 4 * cfg.d)
        self.out = nn.Linear(4 * cfg.d, cfg.d)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d)
        self.pos = nn.Embedding(cfg.max_len, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)
        for mod in self.modules():  # GPT-2 style initialization
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)
            if isinstance(mod, nn.Linear):
                nn.init.zeros_(mod.bias)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None):
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.tok.weight.t()
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss, logits


def batch(cfg: GPTConfig, batch_size: int, seq: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic (ids, targets) batch: targets are ids shifted by one position."""
    data = torch.randint(0, cfg.vocab, (batch_size, seq + 1), generator=generator)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
