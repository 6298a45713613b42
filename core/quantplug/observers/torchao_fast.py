"""torchao observer classes with faster hot methods; see :mod:`quantplug.observers.accelerated`.

Imported only once torchao's observer module is loaded (importing torchao is slow). The classes
live at module level so that prepared modules holding them can be pickled.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from quantplug.observers.accelerated import MAX_EXACT_COUNT, float32, histc

# Never imported here: accelerated.accelerate() loads this module only when the caller's own
# torchao observers are already in sys.modules. torchao is not a quantplug dependency.
_ao: Any = sys.modules["torchao.quantization.pt2e.observer"]


class HistogramObserver(_ao.HistogramObserver):  # type: ignore[misc,name-defined]
    """torchao's HistogramObserver with a faster forward and clipping search (same results)."""

    def _state(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(histogram, min_val, max_val) if ``x`` and the state suit the fast path, else None."""
        if x.dtype is not torch.float32 or x.device.type != "cpu" or not 0 < x.numel() < MAX_EXACT_COUNT:
            return None
        buffers = self._buffers  # direct access: Module.__getattr__ costs a microsecond a name
        hist, min_val, max_val = buffers.get("histogram"), buffers.get("min_val"), buffers.get("max_val")
        if hist is None or min_val is None or max_val is None:
            return None
        for t in (hist, min_val, max_val):
            if t.dtype is not torch.float32 or t.device.type != "cpu":
                return None
        if hist.dim() != 1 or hist.shape[0] != self.bins or min_val.dim() != 0 or max_val.dim() != 0:
            return None
        return hist, min_val, max_val

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        x = x_orig.detach()
        state = self._state(x)
        if state is None:
            return super().forward(x_orig)
        hist, min_val, max_val = state
        x_min, x_max = torch.aminmax(x)
        # one host sync for what torchao reads with several
        lo, hi, cur_min, cur_max = torch.stack((x_min, x_max, min_val, max_val)).tolist()
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return super().forward(x_orig)  # inf/NaN: torchao warns and filters
        if cur_min == math.inf or cur_max == -math.inf:  # uninitialized: reset_histogram
            min_val.copy_(x_min)
            max_val.copy_(x_max)
            hist.copy_(histc(x, self.bins, lo, hi))
            return x_orig
        if not (math.isfinite(cur_min) and math.isfinite(cur_max)):
            return super().forward(x_orig)
        # torch.min/max of the ranges, as values (their tensors are made below only if needed)
        new_min, new_max = min(cur_min, lo), max(cur_max, hi)
        update = histc(x, self.bins, new_min, new_max)
        if new_min == cur_min and new_max == cur_max:
            hist.add_(update)
        else:
            new_min_t = torch.min(min_val, x_min)
            new_max_t = torch.max(max_val, x_max)
            combined = self._combine_histograms(hist, min_val, max_val, update, new_min_t, new_max_t)
            hist.detach_().resize_(combined.shape)
            hist.copy_(combined)
            min_val.copy_(new_min_t)
            max_val.copy_(new_max_t)
        return x_orig

    def _upscale_histogram(
        self,
        histogram: torch.Tensor,
        orig_min: torch.Tensor,
        orig_max: torch.Tensor,
        update_min: torch.Tensor,
        update_max: torch.Tensor,
    ) -> torch.Tensor:
        """torchao's re-binning of the old histogram onto a grown range, op for op, except for
        how the upsampled bins find their new bins (:func:`bucketize_sorted`, the same indices)
        and a clamp in place of two masked assignments that do the same."""
        histogram = histogram.repeat_interleave(self.upsample_rate) / self.upsample_rate
        bin_size = (orig_max - orig_min) / (self.bins * self.upsample_rate)
        mid_points_histogram = (
            torch.linspace(orig_min, orig_max, self.bins * self.upsample_rate + 1, device=orig_min.device)[
                :-1
            ].to(histogram.device)
            + 0.5 * bin_size
        )
        boundaries_new_histogram = torch.linspace(
            update_min, update_max, self.bins + 1, device=update_min.device
        ).to(histogram.device)
        bucket_assignments = bucketize_sorted(mid_points_histogram, boundaries_new_histogram) - 1
        bucket_assignments.clamp_(0, self.bins - 1)
        return torch.bincount(bucket_assignments, weights=histogram, minlength=self.bins)

    def calculate_qparams(self) -> Any:
        if (
            self.histogram.dtype != torch.float32
            or self.histogram.device.type != "cpu"
            or self.histogram.dim() != 1
            or self.histogram.numel() != self.bins
            or self.min_val.dim() != 0
            or self.max_val.dim() != 0
        ):
            return super().calculate_qparams()
        cur_min, cur_max = torch.stack((self.min_val, self.max_val)).tolist()
        if (cur_min == math.inf and cur_max == -math.inf) or torch.get_default_dtype() != torch.float32:
            return super().calculate_qparams()  # warns and returns defaults
        new_min, new_max = self._non_linear_param_search()
        return self._calculate_qparams(new_min, new_max)

    def _non_linear_param_search(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torchao's search, step for step, over a Python copy of the cumulative histogram.

        torchao compares 0-dim float32 tensors ``cSum[l]`` with Python floats, i.e. with those
        floats rounded to float32; the thresholds are rounded the same way here. Which ranges
        the search visits does not depend on their errors as long as each is accepted, so the
        next few candidates are generated ahead and their errors computed in one batch; the
        first candidate whose error exceeds the best so far ends the search, as in torchao.
        """
        bin_width = (self.max_val - self.min_val) / self.bins
        total = torch.sum(self.histogram).item()
        walk = _Walk(torch.cumsum(self.histogram, dim=0).tolist(), total, self.bins)
        error = _QuantizationError(self)
        norm_min = float("inf")
        ahead = _LOOKAHEAD
        while True:
            candidates = walk.peek(ahead)
            if not candidates:
                break
            rejected = False
            for norm in error.batch(candidates):
                if norm > norm_min:
                    rejected = True
                    break
                norm_min = norm
                walk.accept()
            if rejected:
                break
            ahead = _LOOKAHEAD_MORE
        new_min = self.min_val + bin_width * walk.start_bin
        new_max = self.min_val + bin_width * (walk.end_bin + 1)
        return new_min, new_max


#: candidates evaluated per batch: torchao's search usually stops at its 3rd or 4th candidate
_LOOKAHEAD = 4
_LOOKAHEAD_MORE = 8


class _Walk:
    """The bin walk of torchao's ``_non_linear_param_search``, one candidate range at a time.

    ``peek(n)`` returns the next ``n`` candidate ``(start_bin, end_bin)`` ranges the search would
    try if it accepted each of them; ``accept()`` commits to the first pending one.
    """

    def __init__(self, c_sum: list[float], total: float, bins: int) -> None:
        self.c_sum = c_sum
        self.total = total
        self.alpha, self.beta = 0.0, 1.0
        self.start_bin, self.end_bin = 0, bins - 1
        self._pending: list[tuple[float, float, int, int]] = []  # (alpha, beta, start, end) after each

    def peek(self, n: int) -> list[tuple[int, int]]:
        alpha, beta, start_bin, end_bin = self.alpha, self.beta, self.start_bin, self.end_bin
        c_sum, total, stepsize = self.c_sum, self.total, 1e-5
        pending: list[tuple[float, float, int, int]] = []
        while len(pending) < n and alpha < beta:
            next_alpha = alpha + stepsize
            next_beta = beta - stepsize
            low_threshold = float32(next_alpha * total)
            high_threshold = float32(next_beta * total)
            left, right = start_bin, end_bin
            while left < end_bin and c_sum[left] < low_threshold:
                left += 1
            while right > start_bin and c_sum[right] > high_threshold:
                right -= 1
            next_start_bin, next_end_bin = start_bin, end_bin
            if (left - start_bin) > (end_bin - right):
                next_start_bin = left
                alpha = next_alpha
            else:
                next_end_bin = right
                beta = next_beta
            if next_start_bin == start_bin and next_end_bin == end_bin:
                continue
            start_bin, end_bin = next_start_bin, next_end_bin
            pending.append((alpha, beta, start_bin, end_bin))
        self._pending = pending
        return [(p[2], p[3]) for p in pending]

    def accept(self) -> None:
        self.alpha, self.beta, self.start_bin, self.end_bin = self._pending.pop(0)


def bucketize_sorted(values: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """``torch.bucketize(values, boundaries, right=True)`` when both are sorted.

    With sorted boundaries the result is the number of boundaries ``<=`` each value. With sorted
    values too, boundary ``k`` counts for every value from ``searchsorted(values, b_k)`` on, so
    one search per boundary and a cumulative count replace one binary search per value (the
    upsampled histogram has 16x more values than boundaries). Unsorted or NaN inputs go to
    torch.bucketize.
    """
    if (
        values.dim() != 1
        or boundaries.dim() != 1
        or values.numel() == 0
        or values.dtype != boundaries.dtype
        or values.device != boundaries.device
        or not bool((values[1:] >= values[:-1]).all())
        or not bool((boundaries[1:] >= boundaries[:-1]).all())
    ):
        return torch.bucketize(values, boundaries, right=True)
    first = torch.searchsorted(values, boundaries, side="left")  # first value >= each boundary
    counts = torch.bincount(first, minlength=values.numel() + 1)
    return torch.cumsum(counts, 0)[: values.numel()]


class _QuantizationError:
    """torchao's ``HistogramObserver._compute_quantization_error``, invariants hoisted.

    The per-call tensors (bin positions, dst-bin indices, the three L2 terms) are computed with
    the same float32 operations in the same order. What is the same for every call of one search
    (source bin indices, density) is computed once, and the 0-dim float32 tensor arithmetic of
    the constant terms is done on Python floats rounded to float32 after every operation, which
    gives the same float32 values (binary64 holds every float32 product, quotient and sum of
    float32 operands closely enough to round correctly).
    """

    def __init__(self, obs: _ao.HistogramObserver) -> None:
        self.bins = obs.bins
        self.dst_nbins = obs.dst_nbins
        self.bin_width = (obs.max_val.item() - obs.min_val.item()) / obs.bins
        self.src_bin = torch.arange(obs.bins, device=obs.histogram.device)
        self.density = obs.histogram / self.bin_width

    def __call__(self, next_start_bin: int, next_end_bin: int) -> float:
        bin_width = self.bin_width
        dst_bin_width = bin_width * (next_end_bin - next_start_bin + 1) / self.dst_nbins
        if dst_bin_width == 0.0:
            return 0.0
        top = self.dst_nbins - 1
        src_bin_begin = (self.src_bin - next_start_bin) * bin_width
        src_bin_end = src_bin_begin + bin_width
        dst_bin_of_begin = torch.clamp(torch.div(src_bin_begin, dst_bin_width, rounding_mode="floor"), 0, top)
        dst_bin_of_begin_center = (dst_bin_of_begin + 0.5) * dst_bin_width
        dst_bin_of_end = torch.clamp(torch.div(src_bin_end, dst_bin_width, rounding_mode="floor"), 0, top)
        density = self.density
        half = float32(dst_bin_width / 2)
        neg_half = float32(-dst_bin_width / 2)
        half_cubed = float32(float32(half * half) * half)
        neg_half_cubed = float32(float32(neg_half * neg_half) * neg_half)

        norm = torch.zeros(self.bins, device=density.device)
        # _get_norm(delta_begin, ones * (dst_bin_width / 2), density)
        delta_begin = src_bin_begin - dst_bin_of_begin_center
        norm += density * ((half_cubed - delta_begin * delta_begin * delta_begin) / 3)
        # (end - begin - 1) * _get_norm(tensor(-dst_bin_width / 2), tensor(dst_bin_width / 2), density)
        whole_bin = float32(float32(half_cubed - neg_half_cubed) / 3)
        norm += (dst_bin_of_end - dst_bin_of_begin - 1) * (density * whole_bin)
        # _get_norm(tensor(-dst_bin_width / 2), src_bin_end - dst_bin_of_end_center, density)
        dst_bin_of_end_center = dst_bin_of_end * dst_bin_width + dst_bin_width / 2
        delta_end = src_bin_end - dst_bin_of_end_center
        norm += density * ((delta_end * delta_end * delta_end - neg_half_cubed) / 3)
        return norm.sum().item()

    def batch(self, pairs: list[tuple[int, int]]) -> list[float]:
        """``self(s, e)`` for several ranges at once: one row per range, same float32 steps.

        Per-range Python scalars become ``[n, 1]`` float32 columns holding the very values
        torch would have cast them to, and each row is summed on its own, like the 1-D tensor
        torchao sums.
        """
        if len(pairs) == 1:
            return [self(*pairs[0])]
        bin_width = self.bin_width
        widths = [bin_width * (e - s + 1) / self.dst_nbins for s, e in pairs]
        if any(w == 0.0 for w in widths):
            return [self(s, e) for s, e in pairs]
        device = self.density.device

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).reshape(-1, 1)

        halves = [float32(w / 2) for w in widths]
        neg_halves = [float32(-w / 2) for w in widths]
        half_cubed = [float32(float32(h * h) * h) for h in halves]
        neg_half_cubed = [float32(float32(h * h) * h) for h in neg_halves]
        whole_bin = [float32(float32(a - b) / 3) for a, b in zip(half_cubed, neg_half_cubed)]
        dst_bin_width = column(widths)
        starts = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device).reshape(-1, 1)

        top = self.dst_nbins - 1
        src_bin_begin = (self.src_bin - starts) * bin_width
        src_bin_end = src_bin_begin + bin_width
        dst_bin_of_begin = torch.clamp(torch.div(src_bin_begin, dst_bin_width, rounding_mode="floor"), 0, top)
        dst_bin_of_begin_center = (dst_bin_of_begin + 0.5) * dst_bin_width
        dst_bin_of_end = torch.clamp(torch.div(src_bin_end, dst_bin_width, rounding_mode="floor"), 0, top)
        density = self.density

        norm = torch.zeros(len(pairs), self.bins, device=device)
        delta_begin = src_bin_begin - dst_bin_of_begin_center
        norm += density * ((column(half_cubed) - delta_begin * delta_begin * delta_begin) / 3)
        norm += (dst_bin_of_end - dst_bin_of_begin - 1) * (density * column(whole_bin))
        dst_bin_of_end_center = dst_bin_of_end * dst_bin_width + column(halves)
        delta_end = src_bin_end - dst_bin_of_end_center
        norm += density * ((delta_end * delta_end * delta_end - column(neg_half_cubed)) / 3)
        return [row.sum().item() for row in norm]


class PerChannelMinMaxObserver(_ao.PerChannelMinMaxObserver):  # type: ignore[misc,name-defined]
    """torchao's PerChannelMinMaxObserver with ``amin``/``amax`` instead of ``aminmax(dim=1)``."""

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach()
        if x.dtype != self.min_val.dtype or x.device.type != "cpu":
            return super().forward(x_orig)
        axes = list(range(x.dim()))
        axes[self.ch_axis] = 0
        axes[0] = self.ch_axis
        y = torch.flatten(x.permute(axes), start_dim=1)
        lo, hi = torch.amin(y, dim=1), torch.amax(y, dim=1)
        if self.min_val.numel() == 0 or self.max_val.numel() == 0:
            min_val, max_val = lo, hi
        else:
            min_val = torch.min(lo, self.min_val)
            max_val = torch.max(hi, self.max_val)
        self.min_val.resize_(min_val.shape)
        self.max_val.resize_(max_val.shape)
        self.min_val.copy_(min_val)
        self.max_val.copy_(max_val)
        return x_orig


#: torchao class -> stand-in (exact type match only)
ACCELERATED: dict[type, type] = {
    _ao.HistogramObserver: HistogramObserver,
    _ao.PerChannelMinMaxObserver: PerChannelMinMaxObserver,
}
