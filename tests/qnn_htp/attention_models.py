"""Attention variants for the qnn_htp decomposition and completeness tests (random weights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SdpaBlock(nn.Module):
    """q/k/v projections -> ``F.scaled_dot_product_attention`` -> output projection + residual.

    ``mask``: None, ``"bool"`` (True = attend) or ``"float"`` (additive); ``causal``: is_causal;
    ``kv_heads < heads``: grouped-query attention through ``enable_gqa``.
    """

    def __init__(
        self,
        d: int = 32,
        heads: int = 4,
        kv_heads: int | None = None,
        mask: str | None = None,
        causal: bool = False,
        t: int = 8,
    ) -> None:
        super().__init__()
        self.h, self.kv = heads, kv_heads or heads
        self.dh = d // heads
        self.q, self.o = nn.Linear(d, d), nn.Linear(d, d)
        self.k, self.v = nn.Linear(d, self.dh * self.kv), nn.Linear(d, self.dh * self.kv)
        self.causal = causal
        g = torch.Generator().manual_seed(7)
        self.mask: torch.Tensor | None
        if mask == "bool":
            allowed = torch.rand(t, t, generator=g) > 0.3
            allowed |= torch.eye(t, dtype=torch.bool)  # every row attends somewhere
            self.register_buffer("mask", allowed)
        elif mask == "float":
            self.register_buffer("mask", torch.randn(t, t, generator=g))
        else:
            self.mask = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.h, self.dh).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv, self.dh).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv, self.dh).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, is_causal=self.causal, enable_gqa=self.kv != self.h
        )
        return self.o(y.transpose(1, 2).reshape(b, t, d)) + x


class MhaBlock(nn.Module):
    """``nn.MultiheadAttention`` after a layer norm (self-attention: one packed projection)."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return self.attn(h, h, h, need_weights=False)[0] + x


class CrossMhaBlock(nn.Module):
    """``nn.MultiheadAttention`` with distinct query and key/value: ``in_proj_weight.chunk(3)``."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.attn(x, memory, memory, need_weights=False)[0] + x
