"""The digits models: small networks for scikit-learn's bundled digits (8x8 images), and how
they are trained. Torch only, so that ``bench.digits_weights`` and peers' venvs (NNCF, AIMET)
import them without the test's dependencies."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: the last images of the seeded order are held out (test set); the rest train and calibrate
HELD_OUT = 360


def images() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (bundled with it, no download) scaled to [0, 1], in one seeded order."""
    from sklearn import datasets

    data = datasets.load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return x[order], y[order]


class DigitsMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 1, 8, 8)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int) -> nn.Module:
    """A second or two of Adam. One thread: tiny ops gain nothing from more, and on a busy
    machine several threads per op slow training down by an order of magnitude."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    gen = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(epochs):
            order = torch.randperm(len(y), generator=gen)
            for i in range(0, len(y), 64):
                batch = order[i : i + 64]
                loss = F.cross_entropy(model(x[batch]), y[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return 100.0 * float((logits.argmax(dim=-1) == y).float().mean())
