"""The six parity models of issue #4 and their calibration data (shared by the qnn_htp tests).

Each factory returns a fresh eval-mode model (seeded weights) and a function drawing one input
tuple from a ``torch.Generator``, so both flows see the same example and calibration batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Inputs = tuple[torch.Tensor, ...]


class ConvNet(nn.Module):
    """conv->relu->maxpool ; conv(stride 2)->sigmoid ; cat ; 1x1 conv + cat (ExecuTorch study model)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.conv3 = nn.Conv2d(32, 32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.max_pool2d(F.relu(self.conv1(x)), 2)
        b = torch.sigmoid(self.conv2(x))
        c = torch.cat([a, b], dim=1)
        return self.conv3(c) + c


class DepthwiseNet(nn.Module):
    """stem conv -> depthwise 3x3 -> hardswish -> pointwise 1x1."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.pw = nn.Conv2d(32, 16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pw(F.hardswish(self.dw(self.stem(x))))


class AttnBlock(nn.Module):
    """layer_norm -> q/k/v -> q k^T * 1/sqrt(d) -> causal masked_fill(-inf) -> softmax -> @ v -> o + x."""

    def __init__(self, d: int = 32, t: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.register_buffer("mask", torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        s = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(32))
        s = s.masked_fill(self.mask, float("-inf"))
        return self.o(torch.matmul(torch.softmax(s, dim=-1), v)) + x


class EmbedNet(nn.Module):
    """embedding(100, 32) -> linear(32, 16) -> relu -> linear(16, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.fc1 = nn.Linear(32, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(self.emb(tok))))


class TransposeConvNet(nn.Module):
    """conv -> relu -> transpose conv (stride 2) -> relu."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.up(F.relu(self.conv(x))))


class GroupNormNet(nn.Module):
    """conv -> group_norm(8 groups) -> relu -> 1x1 conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.gn = nn.GroupNorm(8, 32)
        self.conv2 = nn.Conv2d(32, 16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.gn(self.conv1(x))))


class PassesNet(nn.Module):
    """Ops the qnn_htp passes rewrite before annotation (a 7th parity model, beyond issue #4's six):
    silu, reciprocal, expm1 (decomposed), add with alpha, scalar operands (lifted), where with a
    scalar branch, a comparison with a scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        y = F.silu(h) + torch.reciprocal(h.abs() + 1.0) + torch.expm1(h * 0.5)
        y = torch.add(y, h, alpha=2)
        return torch.where(h > 0.1, y, 0.0) - 3.0


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], nn.Module]
    draw: Callable[[torch.Generator], Inputs]
    #: ExecuTorch-style LPBQ map for 16a4w_block: every conv/linear with more input channels
    #: than the block (16), so both flows block exactly the same layers
    lpbq: dict[str, tuple[int, ...]]


def _image(*shape: int) -> Callable[[torch.Generator], Inputs]:
    return lambda g: (torch.randn(*shape, generator=g),)


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("convnet", ConvNet, _image(1, 3, 16, 16), {"conv2d_2": (1, 16, 1, 1)}),
        Case("depthwise", DepthwiseNet, _image(1, 3, 16, 16), {"conv2d_2": (1, 16, 1, 1)}),
        Case(
            "attention",
            AttnBlock,
            _image(1, 8, 32),
            {n: (1, 16) for n in ("linear", "linear_1", "linear_2", "linear_3")},
        ),
        Case(
            "embedding",
            EmbedNet,
            lambda g: (torch.randint(0, 100, (1, 6), generator=g),),
            {"linear": (1, 16)},
        ),
        Case("transpose_conv", TransposeConvNet, _image(1, 3, 8, 8), {}),
        Case("group_norm", GroupNormNet, _image(1, 3, 8, 8), {"conv2d_1": (1, 16, 1, 1)}),
        Case("passes", PassesNet, _image(2, 16), {}),
    )
}


def build(name: str) -> tuple[nn.Module, Inputs, list[Inputs]]:
    """A seeded model, its example input and 6 calibration batches (the example is not among them)."""
    case = CASES[name]
    torch.manual_seed(0)
    model = case.make().eval()
    g = torch.Generator().manual_seed(1)
    example = case.draw(g)
    batches = [case.draw(g) for _ in range(6)]
    return model, example, batches
