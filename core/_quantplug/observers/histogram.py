"""Histogram observer: clip activation ranges to minimise quantization error, not to cover outliers.

A min-max range spends the whole grid on a few extreme values; keeping a histogram of everything
seen lets ``calculate_qparams`` trade a little clipping error on the tails for a finer step on the
bulk. The histogram is piecewise uniform: each bin's mass is spread evenly over the bin, which is
what every error estimate and re-binning below assumes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from _quantplug.errors import AnnotationError
from _quantplug.observers import kernels, nonfinite, seen
from _quantplug.observers.base import ONE, ObserverBase
from _quantplug.observers.binning import MAX_EXACT_COUNT, LinearBinning, histc
from _quantplug.observers.merge import merged_histogram
from _quantplug.observers.rebin import rebin_histogram

_METHODS = ("mse", "percentile")
#: the instance attribute keeping the binning of the current range (not state: made again at will)
_BINNING = "_quantplug_binning"
#: the instance attribute keeping the native step of the current range (:class:`_Steady`)
_STEADY = kernels.STEP_ATTR
#: the instance attribute saying the observer's first batch was tried natively (:meth:`_start`)
_STARTED = "_quantplug_started"
#: ``extremes`` handed to the general path where the native kernels met an extreme of zero: its sign
#: (the observer keeps the one it is given) is torch.aminmax's to decide, not another native pass's
_ZERO_EXTREME = (0.0, 0.0)
#: the buffers the native step writes: histogram, min_val, max_val, num_batches
_Buffers = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_PER_TENSOR_QSCHEMES = (torch.per_tensor_affine, torch.per_tensor_symmetric)

# clipping search: coarse points per axis (1-D symmetric search, 2-D affine search), then each
# refinement stage re-samples +-1 coarse step with _REFINE_POINTS points, shrinking the step 8x.
_COARSE_1D = 513
_COARSE_2D = 33
_REFINE_POINTS = 17


def _clip(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """``np.clip`` without its Python-level dispatch (a few microseconds a call, many calls)."""
    return np.minimum(np.maximum(x, lo), hi)


def _differs(a: float, b: float) -> bool:
    """Whether ``a`` and ``b`` differ, zeros of opposite signs included (``fill_`` keeps the sign)."""
    return a != b or (a == 0.0 and math.copysign(1.0, a) != math.copysign(1.0, b))


class _HistStats:
    """Prefix sums of a histogram in bin units, so each candidate grid's error costs O(1).

    Kept as float64 NumPy arrays: the search evaluates a few hundred candidates per refinement
    stage, where the per-call overhead of torch ops would dominate. The sums are laid out as
    rows (``[p0, p1, p2]`` per bin edge, ``[mass left of bin, bin mass]`` per bin) so that
    each candidate reads what it needs with one gather per table.
    """

    def __init__(self, hist: torch.Tensor) -> None:
        h = hist.detach().to(device="cpu", dtype=torch.float64).numpy()
        self.bins = h.size
        centres = np.arange(self.bins, dtype=np.float64) + 0.5
        self.hist = h
        self.p0 = np.concatenate(([0.0], np.cumsum(h)))
        p1 = np.concatenate(([0.0], np.cumsum(h * centres)))
        p2 = np.concatenate(([0.0], np.cumsum(h * centres * centres)))
        self.moments = np.stack([self.p0, p1, p2], axis=1)  # [bins + 1, 3]
        self.totals = self.moments[-1]
        self.bin_table = np.stack([self.p0[:-1], h], axis=1)  # [bins, 2]

    def _cdf(self, positions: np.ndarray) -> np.ndarray:
        """Mass left of ``positions`` (bin units) under the piecewise-uniform histogram."""
        t = _clip(positions, 0.0, float(self.bins))
        j = np.minimum(np.floor(t), self.bins - 1)
        rows = self.bin_table[j.astype(np.int64)]
        return rows[:, 0] + rows[:, 1] * (t - j)

    def expected_error(self, lower: np.ndarray, upper: np.ndarray, step: np.ndarray) -> np.ndarray:
        """Summed squared error of quantizing the histogram onto grids ``[lower, upper]`` of ``step``.

        Everything is in bin units. Mass outside the grid is clipped to its edge (exact integral
        of the squared distance); mass inside is rounded, with the usual ``step**2 / 12`` noise,
        which is independent of the number of levels, so 16-bit grids cost the same as 8-bit ones.
        """
        bins, h = self.bins, self.hist

        # below the grid: whole bins left of lower's bin, then the part of lower's own bin
        jl = np.floor(lower)
        below = self.moments[_clip(jl, 0, bins).astype(np.int64)]
        p0, p1, p2 = below[:, 0], below[:, 1], below[:, 2]
        low = lower * lower * p0 - 2.0 * lower * p1 + p2 + p0 / 12.0
        inside_l = (jl >= 0) & (jl <= bins - 1)
        frac_l = lower - jl
        part_l = h[_clip(jl, 0, bins - 1).astype(np.int64)] * (frac_l * frac_l * frac_l) / 3.0
        low = low + np.where(inside_l, part_l, 0.0)

        # above the grid: whole bins right of upper's bin, then the part of upper's own bin
        ju = np.floor(upper)
        above = self.totals - self.moments[_clip(ju + 1, 0, bins).astype(np.int64)]
        m0, m1, m2 = above[:, 0], above[:, 1], above[:, 2]
        high = m2 - 2.0 * upper * m1 + upper * upper * m0 + m0 / 12.0
        inside_u = (ju >= 0) & (ju <= bins - 1)
        frac_u = ju + 1.0 - upper
        part_u = h[_clip(ju, 0, bins - 1).astype(np.int64)] * (frac_u * frac_u * frac_u) / 3.0
        high = high + np.where(inside_u, part_u, 0.0)

        mass_in = np.maximum(self._cdf(upper) - self._cdf(lower), 0.0)
        return low + high + mass_in * step * step / 12.0

    def quantile(self, q: float) -> float:
        """Position (bin units) below which a fraction ``q`` of the mass lies."""
        total = float(self.p0[-1])
        target = q * total
        j = min(int(np.searchsorted(self.p0[1:], target)), self.bins - 1)
        mass = float(self.hist[j])
        frac = (target - float(self.p0[j])) / mass if mass > 0 else 0.0
        return j + min(max(frac, 0.0), 1.0)


class _Steady:
    """What :func:`kernels.observe_histogram` needs to count a batch within the current range
    (most batches, once the range stops growing) in one native call: the range's binning
    ``(lo, hi, scale, divisor, bins)`` and the buffers it was made for. The native call checks
    that the buffers still hold the range (``merge_``, ``load_state_dict`` or a ``fill_`` may
    have moved it); a buffer replaced (``.to()``, assignment) retires the step. Kept in the
    instance ``__dict__``; a copy's (:func:`~_quantplug.observers.copies.fresh_copy`) is
    :meth:`rebound` to the copy's buffers where it has no range yet, else dropped.
    ``binning_of``: the :class:`LinearBinning` it was made from, None for a first batch's
    (:func:`kernels.start_histogram` makes none).

    Before the first batch, ``binning`` is None: the step of an observer whose buffers, as made,
    the kernels can write (:meth:`fresh`), so that its first batch, a few hundred per
    calibration, checks only that they are still the same tensors (:meth:`serves`)."""

    __slots__ = ("binning", "binning_of", "buffers")

    def __init__(
        self,
        binning: tuple[float, float, float, float, int] | None,
        buffers: _Buffers,
        binning_of: LinearBinning | None = None,
    ) -> None:
        self.binning = binning
        self.buffers = buffers
        self.binning_of = binning_of

    @classmethod
    def make(cls, binning: LinearBinning | None, buffers: Any, lo: float, hi: float) -> _Steady | None:
        """The step of ``binning`` (the range ``[lo, hi]``), or None where the native kernels are
        off or the general path must see every batch: a range reaching down to where values may
        be mask entries (``nonfinite.ordinary`` must hold for every batch within the range), or
        buffers the kernel cannot write (another dtype or device)."""
        if binning is None or not kernels.enabled() or binning.lo != lo or binning.hi != hi:
            return None
        if not lo > nonfinite.SCORE_MASK_SENTINEL:
            return None
        found = cls.writable(buffers, binning.bins)
        if found is None:
            return None
        scale = 0.0 if binning.scale is None else float(binning.scale)
        return cls((binning.lo, binning.hi, scale, binning.divisor, binning.bins), found, binning)

    @classmethod
    def fresh(cls, buffers: Any, bins: int) -> _Steady | None:
        """The step before the first batch (``binning`` None), where the kernels can write ``buffers``."""
        found = cls.writable(buffers, bins)
        return None if found is None else cls(None, found)

    def rebound(self, buffers: Any) -> _Steady | None:
        """This step before the first batch for a copy's ``buffers`` (clones of this one's: the
        same dtypes, devices, sizes and layouts); None once a batch was counted (the copy makes
        its own, as :meth:`HistogramObserver._observe` does after a ``load_state_dict``)."""
        if self.binning is not None:
            return None
        return _Steady(
            None, (buffers["histogram"], buffers["min_val"], buffers["max_val"], buffers["num_batches"])
        )

    @staticmethod
    def writable(buffers: Any, bins: int) -> _Buffers | None:
        """The buffers the native kernels write, where they can (float32 contiguous CPU histogram
        of ``bins`` counters, float32 ``min_val`` and ``max_val``, int64 ``num_batches``)."""
        found: _Buffers = (
            buffers["histogram"],
            buffers["min_val"],
            buffers["max_val"],
            buffers["num_batches"],
        )
        histogram, min_val, max_val, num_batches = found
        # one expression, no loop: every first batch asks (a few hundred per calibration)
        if (
            type(histogram) is torch.Tensor
            and type(min_val) is torch.Tensor
            and type(max_val) is torch.Tensor
            and type(num_batches) is torch.Tensor
            and histogram.dtype is torch.float32
            and min_val.dtype is torch.float32
            and max_val.dtype is torch.float32
            and num_batches.dtype is torch.int64
            and histogram.is_cpu
            and min_val.is_cpu
            and max_val.is_cpu
            and num_batches.is_cpu
            and histogram.numel() == bins
            and histogram.is_contiguous()
            and min_val.numel() == max_val.numel() == num_batches.numel() == 1  # one value: at data_ptr()
        ):
            return found
        return None

    def serves(self, buffers: Any) -> bool:
        """Whether the observer's buffers are still the ones this step writes."""
        mine = self.buffers
        return (
            buffers["histogram"] is mine[0]
            and buffers["min_val"] is mine[1]
            and buffers["max_val"] is mine[2]
            and buffers["num_batches"] is mine[3]
        )


class HistogramObserver(ObserverBase):
    """Per-tensor activation observer that picks its range from a running histogram.

    ``method="mse"`` picks the clipping range whose grid minimises the expected squared
    quantization plus clipping error over the histogram; ``method="percentile"`` clips to the
    ``100 - percentile`` / ``percentile`` quantiles. Both hand the chosen range to the base's
    ``_qparams`` so symmetric, affine and 16-bit conventions match every other observer.

    ``upsample_rate`` sets the resolution of the MSE search: the clipping range is refined down to
    ``1 / upsample_rate`` of a bin (histogram re-binning is exact and needs no upsampling).
    """

    num_batches: torch.Tensor
    histogram: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(
        self,
        bins: int = 2048,
        *,
        method: str = "mse",
        percentile: float = 99.99,
        upsample_rate: int = 16,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if self.qscheme not in _PER_TENSOR_QSCHEMES:
            raise AnnotationError(
                f"HistogramObserver is per-tensor only; got qscheme {self.qscheme}. "
                "Use a per-channel observer for per-channel encodings."
            )
        if self.is_dynamic:
            raise AnnotationError("HistogramObserver needs calibration data and cannot be dynamic")
        if int(bins) < 1:
            raise AnnotationError(f"HistogramObserver bins must be >= 1, got {bins}")
        if method not in _METHODS:
            raise AnnotationError(f"HistogramObserver method must be one of {_METHODS}, got {method!r}")
        if not 50.0 < float(percentile) <= 100.0:
            raise AnnotationError(f"HistogramObserver percentile must be in (50, 100], got {percentile}")
        if int(upsample_rate) < 1:
            raise AnnotationError(f"HistogramObserver upsample_rate must be >= 1, got {upsample_rate}")
        self.bins = int(bins)
        self.method = method
        self.percentile = float(percentile)
        self.upsample_rate = int(upsample_rate)
        self.register_buffer("histogram", torch.zeros(self.bins))
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))
        fresh = _Steady.fresh(self._buffers, self.bins)
        if fresh is not None:
            self.__dict__[_STEADY] = fresh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffers: Any = self._buffers  # not Module.__getattr__: microseconds per call, hundreds of calls
        steady = self.__dict__.get(_STEADY)
        extremes: tuple[float, float] | None = None
        if steady is not None and steady.serves(buffers):
            binning = steady.binning
            if binning is None:  # the first batch
                done, extremes = self._start(x, steady.buffers)
                if done:
                    return x
            else:
                # most batches: the range holds them, one native call counts them (or says it does not)
                found = kernels.observe_histogram(x, binning, *steady.buffers)
                if found is None:
                    return x
                if found is not False:
                    # as kernels.minmax would give them below, which declines zeros (torch decides their sign)
                    extremes = found if found[0] != 0.0 and found[1] != 0.0 else _ZERO_EXTREME
        elif _STARTED not in self.__dict__:  # a first batch without its step (a deep copy, buffers replaced)
            self.__dict__[_STARTED] = True
            found_buffers = _Steady.writable(buffers, self.bins)
            if found_buffers is not None:
                done, extremes = self._start(x, found_buffers)
                if done:
                    return x
        return self._observe(x, buffers, extremes)

    def _observe(self, x: torch.Tensor, buffers: Any, extremes: tuple[float, float] | None) -> torch.Tensor:
        """A batch the native step did not count: the first, one that widens the range, one the
        kernels cannot read (or with the kernels off). ``extremes``: ``x``'s, if already known."""
        if x.numel() == 0:
            return x
        histogram, min_val, max_val = buffers["histogram"], buffers["min_val"], buffers["max_val"]
        cur_min, cur_max = min_val.item(), max_val.item()
        batch = seen.probe(x)
        recalled = seen.recall(self, batch)
        if recalled is not None and recalled[1] == cur_min and recalled[2] == cur_max:
            # the values of a recent batch (a view of it), binned over the range they were
            # binned over then: the same counts, added again
            histogram.add_(recalled[0])
            buffers["num_batches"].add_(ONE)
            return x
        data = (x.detach() if x.requires_grad else x).float()
        readable = kernels.readable(data, None if batch is None or data is not x else batch.dense)
        if not readable and kernels.enabled():
            data = data.reshape(-1)  # a copy the native kernels can read
            readable = kernels.readable(data)
        if extremes is None or extremes is _ZERO_EXTREME:
            found = seen.recall_extremes(batch)
            if found is None:
                found = kernels.minmax(data, checked=True) if readable and extremes is None else None
                if found is None:
                    lo, hi = torch.stack(list(torch.aminmax(data))).tolist()
                    found = (lo, hi)
                seen.remember_extremes(batch, found)
            extremes = found
        lo_f, hi_f = extremes
        ordinary = nonfinite.ordinary(self, lo_f, hi_f)
        if not ordinary:
            # one inf (or nan) would make every bin infinitely wide: the calibration's policy
            # decides (raise, or leave them out and count them)
            data = data[nonfinite.handle(self, data)]
            readable = False
            if data.numel() == 0:
                return x
            lo_f, hi_f = torch.stack(list(torch.aminmax(data))).tolist()

        if cur_min > cur_max:  # (inf, -inf): nothing recorded yet
            new_min, new_max = lo_f, hi_f
            histogram.zero_()
        else:
            new_min, new_max = min(cur_min, lo_f), max(cur_max, hi_f)
            if new_min != cur_min or new_max != cur_max:
                histogram.copy_(rebin_histogram(histogram, cur_min, cur_max, new_min, new_max))
        if new_max > new_min:
            counts = self._counts(data, new_min, new_max, readable, (lo_f, hi_f))
            histogram.add_(counts)
            if ordinary:  # a batch with NaN/inf counted what it left out: never replayed
                seen.remember(self, batch, (counts, new_min, new_max))
        else:
            histogram[0] += data.numel()
        if _differs(new_min, cur_min):  # most batches leave the range as it is
            min_val.fill_(new_min)
        if _differs(new_max, cur_max):
            max_val.fill_(new_max)
        buffers["num_batches"].add_(ONE)
        steady = self.__dict__.get(_STEADY)
        binning = self.__dict__.get(_BINNING)
        if steady is None or steady.binning_of is not binning or not steady.serves(buffers):
            self.__dict__[_STEADY] = _Steady.make(binning, buffers, new_min, new_max)
        return x

    def _start(self, x: torch.Tensor, buffers: _Buffers) -> tuple[bool, tuple[float, float] | None]:
        """The observer's first batch in one native call (:func:`kernels.start_histogram`): its
        extremes, then its counts written over its own range, with the range, into ``buffers``
        (:meth:`_Steady.writable`). ``(True, None)`` where done; else ``(False, extremes)``,
        nothing written, and ``x``'s extremes if found, for the general path (which makes the
        step of the range it sets)."""
        self.__dict__[_STARTED] = True  # tried once: a copy of this observer starts in the general path
        done = kernels.start_histogram(x, self.bins, nonfinite.SCORE_MASK_SENTINEL, *buffers)
        if done is not None and len(done) == 5:
            self.__dict__[_STEADY] = _Steady(done, buffers)  # type: ignore[arg-type]
            return True, None
        self.__dict__.pop(_STEADY, None)  # the step before the first batch, if any
        if done is None:
            return False, None
        lo, hi = done
        return False, _ZERO_EXTREME if lo == 0.0 or hi == 0.0 else (lo, hi)

    def _counts(
        self, data: torch.Tensor, lo: float, hi: float, readable: bool, extremes: tuple[float, float]
    ) -> torch.Tensor:
        """``torch.histc(data, self.bins, lo, hi)`` (float32 ``data`` within the range, whose own
        are ``extremes``), counted by the binning of the range, which is kept while the range
        stays put (most batches)."""
        binning = self.__dict__.get(_BINNING)
        if binning is None or binning.lo != lo or binning.hi != hi:
            binning = LinearBinning.make(self.bins, lo, hi)
            self.__dict__[_BINNING] = binning
        if binning is None or data.device.type != "cpu" or data.numel() >= MAX_EXACT_COUNT:
            return histc(data, self.bins, lo, hi)
        counts = torch.empty(self.bins, dtype=torch.float32)
        binning.count_into(data, counts, checked=readable, extremes=extremes)
        return counts

    def __getstate__(self) -> dict[str, Any]:
        """The module's state without its native step (a copy makes its own from its buffers)."""
        state = super().__getstate__()
        state.pop(_STEADY, None)
        return state

    def merge_(self, others: Sequence[Any]) -> None:
        """Re-bin every histogram onto the union of the ranges and sum them (module docstring of
        :mod:`_quantplug.observers.merge`)."""
        states = [(o.histogram, float(o.min_val), float(o.max_val)) for o in (self, *others)]
        found = merged_histogram(states, f"the HistogramObserver of {self.where or '?'}")
        if found is not None:
            hist, lo, hi = found
            self.histogram.copy_(hist)
            self.min_val.fill_(lo)
            self.max_val.fill_(hi)
        self._add_batches(others)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.clip_range()
        device = self.min_val.device
        return self._qparams(
            torch.tensor(lo, dtype=torch.float32, device=device),
            torch.tensor(hi, dtype=torch.float32, device=device),
        )

    def clip_range(self) -> tuple[float, float]:
        """The ``(min, max)`` handed to ``_qparams``: the observed range, narrowed by ``method``."""
        data_min, data_max = float(self.min_val), float(self.max_val)
        if not (data_max > data_min) or float(self.histogram.sum()) <= 0.0:
            # nothing seen (inf, -inf) or a constant tensor: min-max is exact, nothing to clip
            return data_min, data_max
        stats = _HistStats(self.histogram)
        width = (data_max - data_min) / self.bins
        if self.method == "percentile":
            tail = 1.0 - self.percentile / 100.0
            lo = data_min + width * stats.quantile(tail)
            hi = data_min + width * stats.quantile(1.0 - tail)
            return lo, hi
        return self._mse_search(stats, data_min, data_max)

    def _candidate_ranges(
        self, fracs: list[np.ndarray], data_min: float, data_max: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Map search coordinates in [0, 1] to candidate ``(min, max)`` pairs."""
        if self.symmetric:
            bound = max(abs(data_min), abs(data_max))
            return -bound * fracs[0], bound * fracs[0]
        return min(data_min, 0.0) * fracs[0], max(data_max, 0.0) * fracs[1]

    def _grids(
        self, lo: np.ndarray, hi: np.ndarray, symmetric_zero_point: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``_qparams`` of each candidate range, in NumPy: the same float32 steps as
        :func:`~_quantplug.observers.base.qparams_from_range`, so the searched grids are the ones
        ``calculate_qparams`` returns."""
        f32 = np.float32
        min_neg = np.minimum(lo.astype(f32), f32(0.0))
        max_pos = np.maximum(hi.astype(f32), f32(0.0))
        eps = f32(self.eps)
        levels = float(self.quant_max - self.quant_min)
        if self.symmetric:
            max_pos = np.maximum(-min_neg, max_pos)
            scale = np.maximum(max_pos / f32(levels / 2), eps)
            zero_point: np.ndarray = np.full(scale.shape, symmetric_zero_point, dtype=np.int64)
        else:
            scale = np.maximum((max_pos - min_neg) / f32(levels), eps)
            zero_point = self.quant_min - np.round(min_neg / scale).astype(np.int32)
            zero_point = _clip(zero_point, self.quant_min, self.quant_max)
        return scale, zero_point

    def _grid_error(
        self,
        stats: _HistStats,
        lo: np.ndarray,
        hi: np.ndarray,
        data_min: float,
        width: float,
        symmetric_zero_point: int = 0,
    ) -> np.ndarray:
        """Expected error of the grids ``_qparams`` would build from each candidate range."""
        scale, zero_point = self._grids(lo, hi, symmetric_zero_point)
        s = scale.astype(np.float64)
        zp = zero_point.astype(np.float64)
        lower = ((self.quant_min - zp) * s - data_min) / width
        upper = ((self.quant_max - zp) * s - data_min) / width
        return stats.expected_error(lower, upper, s / width)

    def _mse_search(self, stats: _HistStats, data_min: float, data_max: float) -> tuple[float, float]:
        """Coarse grid over candidate ranges, then local refinement, all evaluated in batch.

        Symmetric grids only depend on one magnitude, so the search is 1-D; affine grids search
        the negative and positive extents jointly (2-D). Axes with no data (e.g. no negative
        values) collapse to a single point.
        """
        width = (data_max - data_min) / self.bins
        if self.symmetric:
            active = [True]
            points = _COARSE_1D
        else:
            active = [data_min < 0.0, data_max > 0.0]
            points = _COARSE_2D
        spans = [(0.0, 1.0) if a else (1.0, 1.0) for a in active]
        # a symmetric grid's zero point does not depend on the range (0, or mid-grid if unsigned)
        symmetric_zero_point = int(self._qparams(torch.tensor(-1.0), torch.tensor(1.0))[1].reshape(-1)[0])
        target_step = 1.0 / (self.bins * self.upsample_rate)
        best: list[float] = [1.0] * len(spans)
        while True:
            axes = [np.linspace(a, b, points if b > a else 1, dtype=np.float64) for a, b in spans]
            flat = [m.reshape(-1) for m in np.meshgrid(*axes, indexing="ij")]
            lo, hi = self._candidate_ranges(flat, data_min, data_max)
            err = self._grid_error(stats, lo, hi, data_min, width, symmetric_zero_point)
            k = int(np.argmin(err))
            best = [float(f[k]) for f in flat]
            step = max((b - a) / (points - 1) for a, b in spans)
            if step <= target_step:
                break
            spans = [
                (max(v - (b - a) / (points - 1), 0.0), min(v + (b - a) / (points - 1), 1.0))
                if b > a
                else (a, b)
                for v, (a, b) in zip(best, spans)
            ]
            points = _REFINE_POINTS
        lo_t, hi_t = self._candidate_ranges([np.array(v) for v in best], data_min, data_max)
        return float(lo_t), float(hi_t)

    def extra_repr(self) -> str:
        extra = f", percentile={self.percentile}" if self.method == "percentile" else ""
        return f"{super().extra_repr()}, bins={self.bins}, method={self.method!r}{extra}"
