"""HTP-specific observers: LPBQ weights, concat unification and -inf masks.

* :class:`LpbqObserver` -- per-block weights whose block scales are themselves quantized to 4 bits
  relative to a per-channel scale, exactly as QNN's ``BLOCKWISE_EXPANSION`` encoding stores them.
  ExecuTorch keeps the fp32 block scales in the simulated program and only quantizes them when it
  builds the QNN tensor, so its CPU simulation and the device disagree (up to ~4 % per block).
  Here the effective scale ``per-channel scale x 4-bit integer`` is what the converted program's
  dequantize uses, so simulation and device agree.
* :class:`ConcatMinMaxObserver` -- the absolute running range of everything a ``cat`` joins
  (ExecuTorch's ``ConcatObserver`` intent: one encoding for all inputs and the output).
* :class:`MaskAwareObserver` -- wraps an activation observer and leaves masked values (``±inf``
  and anything at or beyond the fp16 range, e.g. ``-1e9``) out of the statistics. When masked
  values were seen, the grid is extended by ``margin`` below the smallest (above the largest)
  real value, so a masked entry dequantizes to ``min - margin``: far enough below every real score
  that ``softmax`` gives it ``exp(-margin)`` weight, while the real values keep their resolution.
  ExecuTorch instead writes ``-255`` / ``-65535`` into the mask, which stretches the encoding to a
  scale of about 1.0 (anchor section 5.6).

``group_priority``: when several specs share one observer group, the sharing hook
(``plugin.quantplug_resolve_sharing``) builds the group's observer from the spec whose observer
class has the highest priority, so a concat or mask observer governs its whole group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from quantplug.backend import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    ObserverBase,
    ObserverFactory,
    PerBlockMinMaxObserver,
    nonfinite,
)

#: LPBQ block scales are 4-bit multiples (1..16) of the per-channel scale.
LPBQ_SCALE_BITS = 4
LPBQ_SCALE_STEPS = 2**LPBQ_SCALE_BITS
#: |x| at or above this is a mask value (ExecuTorch's threshold: the fp16 range; the core's
#: observers take values at or below its negative as masks too).
MASK_THRESHOLD = -nonfinite.MASK_SENTINEL
DEFAULT_MASK_MARGIN = 16.0


def lpbq_quantize_scales(block_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split fp32 per-block scales ``[C, ...]`` into QNN's LPBQ form.

    Returns ``(per_channel_scale [C], int_scales [C, blocks])`` with
    ``per_channel_scale = max(block scales of the channel) / 16`` and
    ``int_scales = clamp(round(block_scale / per_channel_scale), 1, 16)`` -- the arithmetic of
    ExecuTorch's ``make_qnn_per_block_config`` (float32, round half to even).
    """
    flat = block_scales.detach().to(torch.float32).reshape(block_scales.shape[0], -1)
    per_channel = flat.amax(dim=-1) / LPBQ_SCALE_STEPS
    ints = torch.clamp(torch.round(flat / per_channel.unsqueeze(-1)), 1, LPBQ_SCALE_STEPS)
    return per_channel, ints.to(torch.int64)


def lpbq_effective_scales(block_scales: torch.Tensor) -> torch.Tensor:
    """The scales the device applies: ``per_channel_scale x int_scale``, shaped like the input."""
    per_channel, ints = lpbq_quantize_scales(block_scales)
    return (ints.to(torch.float32) * per_channel.unsqueeze(-1)).reshape(block_scales.shape)


class LpbqObserver(PerBlockMinMaxObserver):
    """Per-block min/max whose qparams are the LPBQ effective scales (4-bit scale quantization).

    ``track_latest=True`` (QAT) makes each call replace the statistics, so fake quantization
    follows the weights being trained instead of the union of every past version of them.
    """

    def __init__(self, block_size: Any, track_latest: bool = False, **kwargs: Any) -> None:
        super().__init__(block_size, **kwargs)
        self.track_latest = bool(track_latest)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.track_latest and self.min_val.numel():
            self.min_val = torch.empty(0)
            self.max_val = torch.empty(0)
        return super().forward(x)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        scale, zero_point = super().calculate_qparams()
        return lpbq_effective_scales(scale), zero_point

    def lpbq_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(per_channel_scale, int_block_scales)`` as QNN stores them."""
        scale, _ = super().calculate_qparams()
        return lpbq_quantize_scales(scale)


class LatestMinMaxObserver(MovingAverageMinMaxObserver):
    """Range of the most recent tensor only (QAT weights: follow the weights being trained)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs["averaging_constant"] = 1.0
        super().__init__(**kwargs)


class LatestPerChannelMinMaxObserver(MovingAveragePerChannelMinMaxObserver):
    """Per-channel range of the most recent tensor only (QAT weights)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs["averaging_constant"] = 1.0
        super().__init__(**kwargs)


class ConcatMinMaxObserver(MinMaxObserver):
    """Absolute running range of a concat's inputs and output: one encoding for all of them."""

    group_priority: ClassVar[int] = 1


class MaskAwareObserver(ObserverBase):
    """An activation observer that ignores mask values and reserves room for them below the data.

    Args:
        inner: the activation observer factory (moving average, min-max, histogram...).
        margin: distance between the smallest real value and the value a ``-inf`` mask entry
            dequantizes to (and symmetrically above the largest for ``+inf``).
        **fields: the spec fields (dtype, range, qscheme...), passed to ``inner`` as well.
    """

    group_priority: ClassVar[int] = 2
    saw_negative_mask: torch.Tensor
    saw_positive_mask: torch.Tensor

    def __init__(self, inner: ObserverFactory, margin: float = DEFAULT_MASK_MARGIN, **fields: Any) -> None:
        super().__init__(**fields)
        self.inner: torch.nn.Module = inner(**fields)
        self.margin = float(margin)
        self.register_buffer("saw_negative_mask", torch.zeros((), dtype=torch.bool), persistent=False)
        self.register_buffer("saw_positive_mask", torch.zeros((), dtype=torch.bool), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        data = x.detach()
        if data.dtype == torch.float32 and data.numel():
            # one reduction tells a batch without masks (most of them) and which ends have some
            lo, hi = torch.stack(list(torch.aminmax(data))).tolist()
            if not (-MASK_THRESHOLD < lo and hi < MASK_THRESHOLD):  # masks, or NaN: False either way
                if math.isnan(lo) or math.isnan(hi):
                    data = self._real_values(data)
                else:
                    if lo <= -MASK_THRESHOLD and not self.saw_negative_mask.item():
                        self.saw_negative_mask.fill_(True)
                    if hi >= MASK_THRESHOLD and not self.saw_positive_mask.item():
                        self.saw_positive_mask.fill_(True)
                    data = self._real_extremes(data, lo, hi)
        else:
            data = self._real_values(data)
        if data.numel():
            self.inner(data)
            self.num_batches.add_(1)
        elif bool(self.saw_negative_mask) or bool(self.saw_positive_mask):
            self.num_batches.add_(1)  # masks alone are data too: see calculate_qparams
        return x

    def _real_extremes(self, data: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
        """What the inner observer is fed from a float32 batch with masks (extremes ``lo``, ``hi``,
        no NaN): its real values (``masked_select``, a copy of them all: 100-200 us for a
        decoder's attention scores); or, for an inner observer that keeps only extremes (min/max,
        moving average), their two extremes, which give it the same state (found by two masked
        reductions: half the copy's time). A zero extreme takes the copy: which zero (+0 or -0) a
        reduction returns depends on the order it meets them, and the inner observer keeps the one
        it is given."""
        forward = getattr(type(self.inner), "forward", None)
        if forward is not MinMaxObserver.forward and forward is not MovingAverageMinMaxObserver.forward:
            return torch.masked_select(data, data.abs() < MASK_THRESHOLD)  # = data[real]
        if hi <= -MASK_THRESHOLD or lo >= MASK_THRESHOLD:
            return data.new_empty(0)  # masks of one sign only
        if lo <= -MASK_THRESHOLD:
            lo = torch.where(data > -MASK_THRESHOLD, data, math.inf).amin().item()
        if hi >= MASK_THRESHOLD:
            hi = torch.where(data < MASK_THRESHOLD, data, -math.inf).amax().item()
        if lo >= MASK_THRESHOLD or hi <= -MASK_THRESHOLD:
            return data.new_empty(0)  # masks of both signs, nothing between them
        if lo == 0.0 or hi == 0.0:
            return torch.masked_select(data, data.abs() < MASK_THRESHOLD)
        return torch.tensor([lo, hi])

    def _real_values(self, data: torch.Tensor) -> torch.Tensor:
        """``data`` without its mask values (the ends they lie beyond recorded), NaN handled."""
        real = data.abs() < MASK_THRESHOLD  # False for ±inf, NaN and huge mask constants
        if not bool(real.all()):
            masked = data[~real]
            if bool(torch.isnan(masked).any()):  # NaN is no mask: the calibration's policy decides
                nonfinite.handle(self, masked[torch.isnan(masked)])
                masked = masked[~torch.isnan(masked)]
            if bool((masked < 0).any()):
                self.saw_negative_mask.fill_(True)
            if bool((masked > 0).any()):
                self.saw_positive_mask.fill_(True)
            data = data[real]
        return data

    def merge_(self, others: Sequence[Any]) -> None:
        """Merge the inner observers; a mask end any of them saw is seen."""
        from quantplug.backend import merge_state

        merge_state(self.inner, [o.inner for o in others])
        for other in others:
            self.saw_negative_mask |= other.saw_negative_mask
            self.saw_positive_mask |= other.saw_positive_mask
        self._add_batches(others)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        inner: Any = self.inner
        if int(getattr(inner, "num_batches", 1)) == 0:
            # only mask values, ever: a sentinel such as RWKV's initial ``max_state``, ``zeros - 1e38``,
            # which ``maximum`` and ``exp`` make vanish. The real data is taken to be 0, so the
            # sentinel lands ``margin`` below it, as a mask lands below a tensor's smallest value.
            lo = hi = 0.0
        else:
            scale, zero_point = inner.calculate_qparams()
            if not bool(self.saw_negative_mask) and not bool(self.saw_positive_mask):
                return scale, zero_point
            s = float(scale.reshape(-1)[0])
            z = int(zero_point.reshape(-1)[0])
            lo = (self.quant_min - z) * s
            hi = (self.quant_max - z) * s
        if bool(self.saw_negative_mask):
            lo = min(lo, 0.0) - self.margin
        if bool(self.saw_positive_mask):
            hi = max(hi, 0.0) + self.margin
        return self._qparams(torch.tensor(lo), torch.tensor(hi))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, margin={self.margin}"


def group_priority(spec: Any) -> int:
    """The sharing priority of a spec's observer class (0 for ordinary observers)."""
    ctr = getattr(spec, "observer_or_fake_quant_ctr", None)
    cls = getattr(ctr, "cls", ctr)
    return int(getattr(cls, "group_priority", 0)) if isinstance(cls, type) else 0
