"""Factories the CLI tests load as ``tests.cli._models:NAME`` (run with the repository root as cwd)."""

from __future__ import annotations

import torch
from torch import nn


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(4, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.a(x) + self.b(y)))


def two_inputs():
    torch.manual_seed(0)
    return TwoInputs(), (torch.randn(2, 8), torch.randn(2, 4))


def deep_mlp():
    """About 60 compared nodes, for a plot with many bars."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(20):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(32, 10)), (torch.randn(4, 32),)


def raises():
    raise RuntimeError("weights file /data/missing.bin does not exist")


def not_a_model():
    return "model", (torch.randn(1),)


class KeywordInputs(nn.Module):
    """Takes its inputs by keyword, as exported language models do (``input_ids=..., mask=...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, *, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(x)) * mask)


def keyword_inputs():
    torch.manual_seed(0)
    return KeywordInputs(), {"x": torch.randn(2, 8), "mask": torch.ones(2, 4)}


def keyword_batches(count: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(2, 8, generator=g), "mask": (torch.rand(2, 4, generator=g) > 0.2).float()}
        for _ in range(count)
    ]
