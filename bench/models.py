"""The benchmark models: a decoder stack of N blocks and a BasicBlock ResNet.

Decoder: embedding(1000x256), N x [LN, qkv Linear 256->768, split into 4 heads, q@k^T*scale,
softmax, @v, Linear proj, residual add, LN, Linear 256->1024, GELU, Linear 1024->256, residual
add], final LN and a 256->1000 head; input 1x64 tokens. ResNet: BasicBlock layout (2,2,2,2) for
"resnet18" or (3,4,6,3) for "resnet34", width 32, conv-bn-relu, 1x1 downsample, maxpool,
avgpool, fc; input 1x3x64x64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class DecoderBlock(nn.Module):
    """Pre-norm transformer block (attention with an optional causal mask, GELU MLP)."""

    def __init__(self, dim: int = 256, heads: int = 4, hidden: int = 1024, causal: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.reshape(b, t, h, d // h).transpose(1, 2)
        k = k.reshape(b, t, h, d // h).transpose(1, 2)
        v = v.reshape(b, t, h, d // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        if self.causal:
            att = att + torch.full((t, t), float("-inf")).triu(1)
        att = torch.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, n_blocks: int, vocab: int = 1000, dim: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[DecoderBlock(dim) for _ in range(n_blocks)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.embed(tokens))))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, layers: tuple[int, ...] = (2, 2, 2, 2), width: int = 32, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks: list[nn.Module] = []
        cin = width
        for i, n in enumerate(layers):
            cout = width * 2**i
            for j in range(n):
                blocks.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.stem(x), 3, 2, 1)
        x = self.blocks(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


RESNET_LAYERS = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}


def _randomize_bn(model: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                assert m.running_mean is not None and m.running_var is not None
                m.running_mean.copy_(torch.rand(n, generator=gen) * 0.2 - 0.1)
                m.running_var.copy_(torch.rand(n, generator=gen) * 0.5 + 0.75)
                m.weight.copy_(torch.rand(n, generator=gen) * 0.5 + 0.75)
                m.bias.copy_(torch.rand(n, generator=gen) * 0.2 - 0.1)


def build(name: str, seed: int = 0) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, ...]]]:
    """(eval model, batch(seed) -> input tuple) for ``decoder-<N>`` or ``resnet18``/``resnet34``."""
    torch.manual_seed(seed)
    model: nn.Module
    if name.startswith("decoder-"):
        model = Decoder(int(name.split("-", 1)[1])).eval()

        def batch(s: int) -> tuple[torch.Tensor, ...]:
            g = torch.Generator().manual_seed(s)
            return (torch.randint(0, 1000, (1, 64), generator=g),)

        return model, batch
    if name in RESNET_LAYERS:
        model = ResNet(RESNET_LAYERS[name]).eval()
        _randomize_bn(model, torch.Generator().manual_seed(seed + 1))

        def batch(s: int) -> tuple[torch.Tensor, ...]:
            g = torch.Generator().manual_seed(s)
            return (torch.randn(1, 3, 64, 64, generator=g),)

        return model, batch
    raise ValueError(f"unknown bench model {name!r}")
