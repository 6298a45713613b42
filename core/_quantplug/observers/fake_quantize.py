"""Fake quantization for quantization-aware training (``prepare(..., qat=True)``).

Wraps any observer: the forward observes (while observation is enabled) and then rounds the
tensor onto the observer's current grid with a straight-through gradient, so training sees the
quantization error. Works for per-tensor, per-channel and per-block grids alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from _quantplug.observers.merge import merge_state


def _broadcast(param: torch.Tensor, x: torch.Tensor, axis: int | None) -> torch.Tensor:
    if param.numel() == 1:
        return param.reshape(())
    if axis is None:
        return param
    shape = [1] * x.dim()
    shape[axis if axis >= 0 else x.dim() + axis] = -1
    return param.reshape(shape)


def fake_quantize(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, axis: int | None
) -> torch.Tensor:
    """Quantize-dequantize ``x`` with a straight-through estimator for the rounding."""
    s = _broadcast(scale.to(x.dtype), x, axis)
    zp = _broadcast(zero_point.to(x.dtype), x, axis)
    q = torch.clamp(torch.round(x / s) + zp, qmin, qmax)
    dq = (q - zp) * s
    # gradient flows as identity inside the range, zero where clamped (STE)
    inside = ((x / s + zp) >= qmin) & ((x / s + zp) <= qmax)
    return torch.where(inside, x + (dq - x).detach(), dq.detach())


class FakeQuantize(nn.Module):
    """Observer plus fake quantization, with switches to freeze observation or disable rounding."""

    def __init__(self, observer: nn.Module) -> None:
        super().__init__()
        self.activation_post_process = observer
        self.observer_enabled = True
        self.fake_quant_enabled = True

    @property
    def dtype(self) -> torch.dtype:
        dtype: torch.dtype = self._observer.dtype
        return dtype

    @property
    def observed(self) -> bool:
        return bool(getattr(self._observer, "observed", True))

    def enable_observer(self, enabled: bool = True) -> None:
        self.observer_enabled = enabled

    def disable_observer(self) -> None:
        self.observer_enabled = False

    def enable_fake_quant(self, enabled: bool = True) -> None:
        self.fake_quant_enabled = enabled

    def disable_fake_quant(self) -> None:
        self.fake_quant_enabled = False

    @property
    def _observer(self) -> Any:
        """The wrapped observer, typed loosely: any PT2E observer module fits."""
        return self._modules["activation_post_process"]

    def merge_(self, others: Sequence[FakeQuantize]) -> None:
        """Merge the wrapped observers (the switches are settings, not statistics)."""
        merge_state(self._observer, [other._observer for other in others])

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        qparams: tuple[torch.Tensor, torch.Tensor] = self._observer.calculate_qparams()
        return qparams

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        obs = self._observer
        if self.observer_enabled:
            obs(x.detach())
        if not self.fake_quant_enabled or not self.observed:
            return x
        if hasattr(obs, "fake_quantize"):  # per-block observers know their own grid layout
            return obs.fake_quantize(x)
        scale, zp = obs.calculate_qparams()
        return fake_quantize(x, scale, zp, obs.quant_min, obs.quant_max, getattr(obs, "ch_axis", None))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["activation_post_process"], name)
