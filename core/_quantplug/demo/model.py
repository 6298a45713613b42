"""The built-in demo: a small conv net and deterministic synthetic data, so the CLI runs with no input."""

from __future__ import annotations

import torch
from torch import nn


class DemoNet(nn.Module):
    """Conv-BN-ReLU stem, a residual block, pooling and a classifier: the ops most models use."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = self.pool(y + self.block(y))
        return self.head(y.mean(dim=(2, 3)))


def demo_model(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The demo model (deterministic weights, eval mode) and one example input."""
    torch.manual_seed(seed)
    model = DemoNet().eval()
    with torch.no_grad():  # give batch norms non-trivial statistics
        for bn in (model.stem[1], model.block[1]):
            bn.running_mean.uniform_(-0.2, 0.2)  # type: ignore[operator]
            bn.running_var.uniform_(0.5, 1.5)  # type: ignore[operator]
    return model, (torch.randn(1, 3, 32, 32),)


def demo_calibration(batches: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 3, 32, 32, generator=gen),) for _ in range(batches)]
