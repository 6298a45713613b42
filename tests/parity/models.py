"""Small float models shared by the torchao parity tests.

Each model is deterministic given a seed and comes with a factory for its example input, so a
test can export it once and draw calibration and held-out batches of the same shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class ConvNet(nn.Module):
    """conv-bn-relu, maxpool, a residual conv-bn-relu block with an add, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        y = F.relu(self.bn2(self.conv2(x)))
        y = self.bn3(self.conv3(y))
        x = F.relu(x + y)
        return self.fc(torch.flatten(x, 1))


class AttentionBlock(nn.Module):
    """Pre-norm transformer block: LN, qkv linear, 4-head attention, proj, add, LN, GELU MLP, add."""

    def __init__(self, dim: int = 32, heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.heads = heads
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
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        att = torch.softmax(att, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CatBranches(nn.Module):
    """Two conv branches (one with relu, one with maxpool-free stride) joined by cat, then a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.left = nn.Conv2d(8, 8, 3, padding=1)
        self.right = nn.Conv2d(8, 4, 1)
        self.head = nn.Conv2d(12, 6, 1)
        self.fc = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        a = F.relu(self.left(x))
        b = self.right(x)
        y = torch.cat([a, b], dim=1)
        y = self.head(y)
        y = F.adaptive_avg_pool2d(y, 1).flatten(1)
        return self.fc(y)


@dataclass(frozen=True)
class ModelCase:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    #: strict (dynamo) export records ``source_fn_stack``, which source-partition based annotators
    #: (e.g. XNNPACK's cat rule) need; non-strict export in torch 2.13 does not record it for cat.
    strict: bool = False

    def export(self, seed: int = 0) -> torch.export.ExportedProgram:
        return torch.export.export(self.model(seed), self.batch(0), strict=self.strict)

    def model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        m = self.build()
        _randomize_norm_stats(m, seed)
        return m.eval()

    def batch(self, seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(self.input_shape, generator=g),)


def _randomize_norm_stats(model: nn.Module, seed: int) -> None:
    """Non-trivial BN/LN parameters, so folding them is actually exercised."""
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):
                n = mod.num_features
                assert mod.running_mean is not None and mod.running_var is not None
                mod.running_mean.copy_(torch.rand(n, generator=g) * 0.4 - 0.2)
                mod.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                mod.weight.copy_(torch.rand(n, generator=g) + 0.5)
                mod.bias.copy_(torch.rand(n, generator=g) * 0.4 - 0.2)
            elif isinstance(mod, nn.LayerNorm) and mod.weight is not None:
                n = mod.weight.numel()
                mod.weight.copy_(torch.rand(n, generator=g) + 0.5)
                mod.bias.copy_(torch.rand(n, generator=g) * 0.4 - 0.2)


MODEL_CASES = [
    ModelCase("convnet", ConvNet, (2, 3, 16, 16)),
    ModelCase("attention", AttentionBlock, (2, 8, 32)),
    ModelCase("cat_branches", CatBranches, (2, 3, 12, 12)),
    ModelCase("cat_branches_strict", CatBranches, (2, 3, 12, 12), strict=True),
]
