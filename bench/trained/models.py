"""The trained bench's language models, torch only (a peer's venv imports them without quantplug).

Both read bytes (vocabulary 256) and return next-byte logits for every position, so their
perplexity is per byte and ``log2(perplexity)`` is bits per byte.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


class Block(nn.Module):
    """Pre-norm decoder block written with plain ops (matmul, softmax, masked_fill), as a
    quantizer's annotation rules see a hand-written GPT, not a fused attention kernel."""

    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.register_buffer("causal", torch.ones(context, context).triu(1).bool(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        scores = scores.masked_fill(self.causal[:t, :t], float("-inf"))
        attended = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attended)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharGPT(nn.Module):
    """Byte-level GPT: token and position embeddings, ``layers`` blocks, a final LayerNorm and an
    untied head (the embedding tables are weights a weight-only preset may or may not quantize)."""

    def __init__(self, dim: int = 128, layers: int = 4, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, context) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class LSTMLM(nn.Module):
    """Byte-level LSTM language model: embedding, a 2-layer LSTM, a linear head."""

    def __init__(self, dim: int = 64, hidden: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.lstm = nn.LSTM(dim, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.tok(tokens))[0])


ARCHITECTURES = {"char_gpt": CharGPT, "lstm_lm": LSTMLM}
