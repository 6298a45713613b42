"""Observers that need no data: fixed qparams and qparams derived from other observers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from _quantplug.observers.base import ObserverBase


class FixedQParamsObserver(ObserverBase):
    """Always returns the spec's scale and zero point (sigmoid, tanh, softmax outputs)."""

    needs_data: ClassVar[bool] = False

    def __init__(self, scale: float, zero_point: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scale = float(scale)
        self.zero_point = int(zero_point)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([self.scale]), torch.tensor([self.zero_point], dtype=torch.int64)


class DerivedObserver(ObserverBase):
    """qparams computed from other observers (bias scale = input scale x weight scale).

    The sources are held in a plain list, not as submodules, so the module tree stays a tree.
    """

    needs_data: ClassVar[bool] = False

    def __init__(
        self,
        obs_or_fqs: Sequence[nn.Module],
        derive_qparams_fn: Callable[[list[Any]], tuple[torch.Tensor, torch.Tensor]],
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.obs_or_fqs = list(obs_or_fqs)
        self.derive_qparams_fn = derive_qparams_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.derive_qparams_fn(self.obs_or_fqs)
