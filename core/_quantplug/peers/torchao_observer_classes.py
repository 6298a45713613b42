"""torchao observer classes with faster hot methods; see :mod:`_quantplug.peers.torchao_observers`.

Imported only once torchao's observer module is loaded (importing torchao is slow). The classes
live at module level so that prepared modules holding them can be pickled.
"""

from __future__ import annotations

import functools
import math
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import torch

from _quantplug.observers import kernels, nonfinite
from _quantplug.observers.binning import _FLOAT32_MAX, MAX_EXACT_COUNT, LinearBinning, float32
from _quantplug.peers.torch_module_call import forward_only

# Never imported here: torchao_observers.accelerate() loads this module only when the caller's own
# torchao observers are already in sys.modules. torchao is not a quantplug dependency.
_ao: Any = sys.modules["torchao.quantization.pt2e.observer"]
_F32 = torch.float32


class HistogramObserver(_ao.HistogramObserver):  # type: ignore[misc,name-defined]
    """torchao's HistogramObserver with a faster forward and clipping search (same results).

    NaN/inf values follow the calibration's policy (_quantplug.observers.nonfinite): an error by
    default; with "ignore", torchao's own filtering, counted.
    """

    nonfinite: str = "error"
    where: str = ""
    nonfinite_ignored: int = 0

    def _state(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(histogram, min_val, max_val) if ``x`` and the state suit the fast path, else None."""
        if x.dtype is not _F32 or not 0 < x.numel() < MAX_EXACT_COUNT or x.device.type != "cpu":
            return None
        return _fast_state(self)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        x = x_orig.detach() if x_orig.requires_grad else x_orig  # as torchao, without a dispatch
        state = self._state(x)
        if state is None:
            if x.is_floating_point() and not nonfinite.all_ordinary(self, x):  # off the fast path: a scan
                return self._forward_finite(x, x_orig)
            return super().forward(x_orig)
        hist, min_val, max_val = state
        if kernels.enabled() and not x.is_contiguous():
            x = x.contiguous()  # one copy, then the native kernels instead of the torch code path
        extremes = kernels.minmax(x)
        if extremes is None:
            x_min, x_max = torch.aminmax(x)
            lo, hi = x_min.item(), x_max.item()
        else:
            lo, hi = extremes
        cur_min, cur_max = min_val.item(), max_val.item()
        if not nonfinite.ordinary(self, lo, hi):
            return self._forward_finite(x, x_orig)
        if cur_min == math.inf or cur_max == -math.inf:  # uninitialized: reset_histogram
            self._count(x, lo, hi, hist, accumulate=False)
            min_val.fill_(lo)
            max_val.fill_(hi)
            return x_orig
        if not (math.isfinite(cur_min) and math.isfinite(cur_max)):
            return super().forward(x_orig)
        # torch.min/max of the ranges, as values (their tensors are made below only if needed)
        new_min, new_max = min(cur_min, lo), max(cur_max, hi)
        if new_min == cur_min and new_max == cur_max:
            self._count(x, new_min, new_max, hist, accumulate=True)
            return x_orig
        update = torch.empty(self.bins, dtype=_F32)
        self._count(x, new_min, new_max, update, accumulate=False)
        # what _combine_histograms does, without re-reading the ranges (a one-value histogram
        # is its special case): update + the old histogram re-binned, in place if native
        grid = None if cur_min == cur_max else self._rebin_grid(cur_min, cur_max, new_min, new_max)
        if grid is None or not kernels.rebin(hist, self.upsample_rate, *grid, out=hist, base=update):
            rebinned = None if grid is None else _rebin_runs(hist, self.upsample_rate, *grid)
            if rebinned is None:
                new_min_t, new_max_t = (torch.scalar_tensor(v, dtype=_F32) for v in (new_min, new_max))
                combined = self._combine_histograms(hist, min_val, max_val, update, new_min_t, new_max_t)
            else:
                combined = update + rebinned
            hist.copy_(combined)
        min_val.fill_(new_min)
        max_val.fill_(new_max)
        return x_orig

    def _forward_finite(self, x: torch.Tensor, x_orig: torch.Tensor) -> torch.Tensor:
        """A batch holding NaN/inf: raise, or (policy "ignore") record its finite values only
        (torchao drops a batch with an inf in it, and fails on NaN)."""
        kept = x[nonfinite.handle(self, x)]
        if kept.numel():
            self.forward(kept)
        return x_orig

    def _count(self, x: torch.Tensor, lo: float, hi: float, out: torch.Tensor, accumulate: bool) -> None:
        """Set (or add to) float32 ``out`` ``torch.histc(x, self.bins, min=lo, max=hi)``."""
        binning = self.__dict__.get("_quantplug_binning")
        if binning is None or binning.lo != lo or binning.hi != hi or binning.bins != self.bins:
            binning = LinearBinning.make(self.bins, lo, hi)
            self.__dict__["_quantplug_binning"] = binning  # kept while the range stays put
        if binning is not None:
            binning.count_into(x, out, accumulate)
        elif accumulate:
            out.add_(torch.histc(x, self.bins, min=lo, max=hi))
        else:
            out.copy_(torch.histc(x, self.bins, min=lo, max=hi))

    def _upscale_histogram(
        self,
        histogram: torch.Tensor,
        orig_min: torch.Tensor,
        orig_max: torch.Tensor,
        update_min: torch.Tensor,
        update_max: torch.Tensor,
    ) -> torch.Tensor:
        """torchao's re-binning of the old histogram onto a grown range: :meth:`_rebin`."""
        rebinned = None
        if all(t.device.type == "cpu" for t in (histogram, orig_min, orig_max, update_min, update_max)):
            ranges = (orig_min.item(), orig_max.item(), update_min.item(), update_max.item())
            rebinned = self._rebin(histogram, *ranges)
        if rebinned is None:
            return super()._upscale_histogram(histogram, orig_min, orig_max, update_min, update_max)
        return rebinned

    def _rebin(
        self, histogram: torch.Tensor, orig_min: float, orig_max: float, new_min: float, new_max: float
    ) -> torch.Tensor | None:
        """torchao's ``_upscale_histogram`` of a CPU histogram, the same float32 result (or None).

        torchao spreads each old bin over ``upsample_rate`` sub-bins, finds the new bin of each
        sub-bin's mid-point with ``bucketize`` (clamped into the end bins) and sums the sub-bins
        of each new bin with a weighted ``bincount``, in sub-bin order. The mid-points and new
        edges come from torch's own ``linspace`` (:meth:`_rebin_grid`); the native kernel
        (:func:`_quantplug.observers.kernels.rebin`) or :func:`_rebin_runs` does the rest. None
        where neither applies; then torch's code runs.
        """
        grid = self._rebin_grid(orig_min, orig_max, new_min, new_max)
        if grid is None:
            return None
        out = torch.empty(self.bins, dtype=_F32)
        if kernels.rebin(histogram, self.upsample_rate, *grid, out=out):
            return out
        return _rebin_runs(histogram, self.upsample_rate, *grid)

    def _rebin_grid(
        self, orig_min: float, orig_max: float, new_min: float, new_max: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """torchao's sub-bin mid-points over the old range and bin edges over the new one.

        The ranges come as the Python floats of the float32 range ends, and torchao's 0-dim
        float32 arithmetic on them is done on floats rounded to float32 after each step.
        """
        n = self.bins * self.upsample_rate
        if not abs(orig_max - orig_min) <= _FLOAT32_MAX:
            return None  # torch's float32 subtraction overflows: its code decides
        # torchao: bin_size = (orig_max - orig_min) / n, then + 0.5 * bin_size, as 0-dim float32
        half = float32(0.5 * float32(float32(orig_max - orig_min) / n))
        mids = torch.linspace(orig_min, orig_max, n + 1)[:-1].add_(half)
        return mids, torch.linspace(new_min, new_max, self.bins + 1)

    def calculate_qparams(self) -> Any:
        """torchao's qparams, bit for bit: :func:`histogram_qparams` for this one observer."""
        return histogram_qparams([self])[0]

    def _non_linear_param_search(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torchao's search, bit for bit: :func:`search_ranges` for this one observer."""
        found = search_ranges([self])[0]
        return super()._non_linear_param_search() if found is None else found


def histogram_qparams(observers: Sequence[HistogramObserver]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``obs.calculate_qparams()`` of each observer, the clipping searches run together.

    What :func:`search_ranges` cannot search (an uninitialized observer, which warns and gets
    the defaults, or a state off the fast path) goes through torchao's own method.
    """
    ranges = search_ranges(observers)
    searched = [i for i, found in enumerate(ranges) if found is not None]
    results = _qparams_together(
        [observers[i] for i in searched],
        [ranges[i][0] for i in searched],  # type: ignore[index]
        [ranges[i][1] for i in searched],  # type: ignore[index]
    )
    done = dict(zip(searched, results))
    return [
        _ao.HistogramObserver.calculate_qparams(obs) if i not in done else done[i]
        for i, obs in enumerate(observers)
    ]


def _qparams_together(
    observers: Sequence[Any], mins: Sequence[torch.Tensor], maxs: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``obs._calculate_qparams(lo, hi)`` for each observer and its 0-dim range ends, computed
    for many observers at once.

    torchao's ``_calculate_qparams`` is elementwise once its validity check passes, and a 0-dim
    range gives one-element qparams (its ``eps`` is a one-element tensor), so observers with the
    same settings get theirs from one call on their stacked ranges: the same float32 operations
    on each element, split off and copied (no two observers' qparams share storage). Observers
    whose ranges torchao would reject (``min > max``, NaN) keep their own call.
    """
    results: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(observers)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, obs in enumerate(observers):
        lo, hi, eps = mins[i], maxs[i], obs.eps
        if lo.dim() or hi.dim() or lo.dtype != hi.dtype or eps.shape != (1,):
            continue
        key: tuple[Any, ...] = (type(obs), obs.qscheme, obs.dtype, obs.quant_min, obs.quant_max)
        key += (obs.has_customized_qrange, eps.dtype, eps.device, float(eps), lo.dtype, lo.device)
        groups.setdefault(key, []).append(i)
    for members in groups.values():
        lo = torch.stack([mins[i] for i in members])
        hi = torch.stack([maxs[i] for i in members])
        if not bool((lo <= hi).all()):  # torchao asserts, per observer: let each one do so
            continue
        scale, zero_point = observers[members[0]]._calculate_qparams(lo, hi)
        if scale.shape != lo.shape or zero_point.shape != lo.shape:
            continue
        for i, s, z in zip(members, scale.split(1), zero_point.split(1)):
            results[i] = (s.clone(), z.clone())
    return [
        obs._calculate_qparams(lo, hi) if r is None else r
        for obs, lo, hi, r in zip(observers, mins, maxs, results)
    ]


def search_ranges(observers: Sequence[HistogramObserver]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """torchao's ``_non_linear_param_search()`` of each observer, or None where it does not apply.

    It applies to an initialized observer (finite range) whose state is float32 CPU tensors of
    the expected shapes, with float32 as the default dtype (torchao's ``torch.zeros`` take it).
    Observers with the same ``bins`` and ``dst_nbins`` are searched together by
    :class:`_Searches`; their stacked histograms give the totals, cumulative sums, densities
    and new ranges with the same float32 operations torchao applies to each one.
    """
    found: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(observers)
    if torch.get_default_dtype() is not _F32:
        return found
    groups: dict[tuple[int, int], list[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = {}
    for i, obs in enumerate(observers):
        state = _fast_state(obs)
        if state is not None:
            groups.setdefault((obs.bins, obs.dst_nbins), []).append((i, state))
    for (bins, dst_nbins), members in groups.items():
        ends = torch.stack([s[1] for _, s in members] + [s[2] for _, s in members])
        bounds = ends.tolist()
        n = len(members)
        keep = [j for j in range(n) if math.isfinite(bounds[j]) and math.isfinite(bounds[n + j])]
        if len(keep) < n:  # an uninitialized observer (or NaN): torchao's code
            members = [members[j] for j in keep]
            ends = ends[keep + [n + j for j in keep]]
            bounds = [bounds[j] for j in keep] + [bounds[n + j] for j in keep]
            n = len(members)
        if not n:
            continue
        mins, maxs = ends[:n], ends[n:]
        # torchao: (self.max_val.item() - self.min_val.item()) / self.bins, a Python float
        bin_widths = [(hi - lo) / bins for lo, hi in zip(bounds[:n], bounds[n:])]
        hist = torch.stack([s[0] for _, s in members])
        searches = _Searches(hist, bin_widths, dst_nbins)
        searches.run()
        # torchao: bin_width = (max_val - min_val) / bins; min_val + bin_width * bin
        bin_width = (maxs - mins) / bins
        edges = torch.tensor([searches.start_bins, [e + 1 for e in searches.end_bins]], dtype=_F32)
        new_min, new_max = (mins + bin_width * edges).unbind()
        for (i, _), lo, hi in zip(members, new_min.unbind(), new_max.unbind()):
            found[i] = (lo, hi)
    return found


def _fast_state(obs: HistogramObserver) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(histogram, min_val, max_val) if they are float32 CPU tensors of the expected shapes."""
    buffers = obs._buffers  # direct access: Module.__getattr__ costs a microsecond a name
    hist, min_val, max_val = buffers.get("histogram"), buffers.get("min_val"), buffers.get("max_val")
    if hist is None or min_val is None or max_val is None:
        return None
    if hist.dtype is not _F32 or min_val.dtype is not _F32 or max_val.dtype is not _F32:
        return None
    if hist.shape != (obs.bins,) or min_val.shape or max_val.shape:
        return None
    if hist.device.type != "cpu" or min_val.device.type != "cpu" or max_val.device.type != "cpu":
        return None
    return hist, min_val, max_val


#: candidates evaluated per search in the first round, then per round for the searches that go
#: on: torchao's search usually stops at its 2nd to 5th candidate, and every candidate evaluated
#: past the one that stops it is a row of errors computed for nothing, while a round costs only a
#: few dozen dispatches. The X86 bench's searches (one thread) took 4.1 / 14 / 56 ms at 4 then 8
#: (decoder-8 / 32 / 128), 3.1 / 11 / 45 ms at 3 then 3
_LOOKAHEAD = 3
_LOOKAHEAD_MORE = 3
#: steps of the walk a peek takes at most once it has a candidate (typically 2-3 per candidate;
#: with few nonzero bins, thousands of steps may separate two candidates)
_PEEK_STEPS = 64
#: elements of the [rows, bins] error computation done at once (64 rows of 2048 bins), so that
#: the buffers stay in cache. The 513 observers of a 128-block decoder (one thread) took 93 ms
#: in chunks of 8 rows, 72 ms of 32, 70 ms of 64, 68 ms of 128, 77 ms of 512, 90 ms in one
_CHUNK_ELEMENTS = 1 << 17
#: torch sums a 1-D tensor longer than this (its grain size) on several threads, in another
#: order than the rows of a 2-D one
_ROW_SUM_LIMIT = 32768


class _Searches:
    """The clipping searches of torchao's ``_non_linear_param_search`` for several observers.

    Each search follows torchao's bin walk (:class:`_Walk`). Which ranges a search visits does
    not depend on their errors as long as each is accepted, so every round each pending search
    peeks at its next few candidates, the errors of all of them are computed together
    (:meth:`errors`), and each search accepts its own in order until the first whose error
    exceeds the best so far, which ends it, as in torchao.

    ``hist`` holds the histograms ([observers, bins] float32), ``bin_widths`` torchao's
    Python-float bin widths; ``start_bins``/``end_bins`` are the results of :meth:`run`.
    """

    def __init__(self, hist: torch.Tensor, bin_widths: list[float], dst_nbins: int) -> None:
        self.bins = bins = hist.shape[1]
        self.dst_nbins = dst_nbins
        self.bin_widths = bin_widths
        width = torch.tensor(bin_widths, dtype=torch.float64).to(_F32).unsqueeze(1)
        self.bin_width = width  # the float32 value torch makes of each Python float
        # |src_bin_begin|, |src_bin_end| <= bins * bin_width (and a rounding): finite if far below
        self.finite = float(width.max()) * bins < _FLOAT32_MAX / 2
        self.density = hist / width  # torchao: self.histogram / bin_width
        if bins <= _ROW_SUM_LIMIT:
            totals = hist.sum(dim=1).tolist()
        else:
            totals = [h.sum().item() for h in hist]
        cumulative = hist.cumsum(dim=1)
        c_sum = cumulative.numpy().reshape(-1).data  # a memoryview: no Python float per bin
        # the native walk reads each row's counts where the tensor holds them (kept alive here)
        plain = cumulative.is_contiguous() and cumulative.dtype is _F32 and cumulative.device.type == "cpu"
        native = kernels.search_walk_native() if plain else None
        self.cumulative = cumulative
        self.walks = [
            _Walk(
                c_sum[i * bins : (i + 1) * bins],
                t,
                bins,
                None if native is None else (native, cumulative.data_ptr() + 4 * i * bins),
            )
            for i, t in enumerate(totals)
        ]
        self.start_bins = [0] * len(bin_widths)
        self.end_bins = [bins - 1] * len(bin_widths)

    def run(self) -> None:
        walks, bin_widths, dst_nbins = self.walks, self.bin_widths, self.dst_nbins
        norm_min = [math.inf] * len(walks)
        pending = list(range(len(walks)))
        ahead = _LOOKAHEAD
        while pending:
            # each candidate's row of the batch, or -1 where its error is 0.0 without computing
            rows: list[list[int]] = []
            owners: list[int] = []
            starts: list[int] = []
            widths: list[float] = []
            for i in pending:
                bin_width, mine = bin_widths[i], []
                for start, end in walks[i].peek(ahead):
                    dst_bin_width = bin_width * (end - start + 1) / dst_nbins
                    if dst_bin_width == 0.0:  # torchao returns 0.0 for it
                        mine.append(-1)
                        continue
                    mine.append(len(widths))
                    owners.append(i)
                    starts.append(start)
                    widths.append(dst_bin_width)
                rows.append(mine)
            norms = self.errors(owners, starts, widths) if widths else []
            going_on = []
            for i, mine in zip(pending, rows):
                walk, best = walks[i], norm_min[i]
                for row in mine:
                    norm = norms[row] if row >= 0 else 0.0
                    if norm > best:
                        break
                    best = norm
                    walk.accept()
                else:
                    if mine:  # all accepted: more candidates may follow
                        going_on.append(i)
                norm_min[i] = best
                self.start_bins[i], self.end_bins[i] = walk.start_bin, walk.end_bin
            pending = going_on
            ahead = _LOOKAHEAD_MORE

    def errors(self, owners: list[int], starts: list[int], widths: list[float]) -> list[float]:
        """torchao's ``_compute_quantization_error`` of each candidate, one row per candidate.

        torchao computes one error at a time on 1-D tensors of ``bins`` elements, with Python
        floats and 0-dim float32 tensors as the per-candidate constants. Here those constants
        are ``[rows, 1]`` float32 columns holding the very values torch would have made of them
        (a Python float is rounded to float32 once, as torch does; 0-dim float32 arithmetic is
        done on the columns), the histogram density is gathered per row, and the same float32
        operations run in the same order on ``[rows, bins]`` chunks, each row summed on its
        own like the 1-D tensor torchao sums. The chunks reuse a few buffers that stay in cache.
        Where the native kernels are built, they compute each chunk's per-bin terms in one pass
        with the same float32 operations (:func:`_quantplug.observers.kernels.search_norms`),
        and torch sums the rows as here.
        """
        bins, top, n = self.bins, self.dst_nbins - 1, len(widths)
        start = torch.tensor(starts, dtype=_F32).unsqueeze(1)  # exact: below 2**24
        dst_width64 = torch.tensor(widths, dtype=torch.float64).unsqueeze(1)
        dst_width = dst_width64.to(_F32)
        half = (dst_width64 / 2).to(_F32)  # torch.tensor(dst_bin_width / 2); -half is its negation
        half_cubed = half * half * half  # and (-half) ** 3 is -half_cubed: rounding is symmetric
        whole_bin = (half_cubed + half_cubed) / 3  # _get_norm(-half, half, 1): (h**3 - (-h)**3) / 3
        chunk = min(n, max(1, _CHUNK_ELEMENTS // bins))
        owner = None if len(self.walks) == 1 else torch.tensor(owners, dtype=torch.int64)
        if self.finite and bins <= _ROW_SUM_LIMIT and kernels.search_norms_available():
            # the same per-bin terms in one native pass per chunk; torch sums each row, as below
            columns = (start, dst_width, half, half_cubed, whole_bin)
            norm = torch.empty(chunk, bins, dtype=_F32)
            norms = torch.empty(n, dtype=_F32)
            for a in range(0, n, chunk):
                r = min(chunk, n - a)
                if not kernels.search_norms(self.density, self.bin_width, owner, columns, top, a, r, norm):
                    break  # operands the kernel does not take (the first chunk already): torch's
                torch.sum(norm[:r], dim=1, out=norms[a : a + r])
            else:
                return norms.tolist()
        floor_div = _FloorDiv(dst_width, top, self.finite)
        src_bin = _bin_indices(bins)
        begin, end, lower, upper, gathered, norm, tmp, tmp2 = torch.empty(8, chunk, bins, dtype=_F32).unbind()
        # one observer's density and bin width broadcast over the rows; several are gathered
        density, width = self.density, self.bin_width
        all_widths = width if owner is None else width.index_select(0, owner)
        norms = torch.empty(n, dtype=_F32)
        for a in range(0, n, chunk):
            rows = slice(a, a + chunk)
            if n - a < chunk:  # the last, shorter chunk
                r = n - a
                begin, end, lower, upper, gathered, norm, tmp, tmp2 = (
                    t[:r] for t in (begin, end, lower, upper, gathered, norm, tmp, tmp2)
                )
            if owner is not None:
                density = torch.index_select(self.density, 0, owner[rows], out=gathered)
                width = all_widths[rows]
            dst = dst_width[rows]
            # src_bin_begin = (src_bin - next_start_bin) * bin_width; src_bin_end = begin + bin_width
            torch.sub(src_bin, start[rows], out=begin).mul_(width)
            torch.add(begin, width, out=end)
            # dst_bin_of_begin/end = clamp(div(src_bin_begin/end, dst_bin_width, "floor"), 0, top)
            floor_div(begin, rows, out=lower)
            floor_div(end, rows, out=upper)
            # norm = zeros; norm += _get_norm(begin - (dst_of_begin + 0.5) * dst_bin_width, half)
            delta = torch.add(lower, 0.5, out=tmp).mul_(dst)
            torch.sub(begin, delta, out=delta)
            cube = torch.mul(delta, delta, out=norm).mul_(delta)
            torch.sub(half_cubed[rows], cube, out=norm).div_(3).mul_(density).add_(0.0)
            # norm += (dst_of_end - dst_of_begin - 1) * _get_norm(-half, half, density)
            count = torch.sub(upper, lower, out=tmp).sub_(1)
            norm.add_(count.mul_(torch.mul(density, whole_bin[rows], out=tmp2)))
            # norm += _get_norm(-half, end - (dst_of_end * dst_bin_width + half), density);
            # subtracting (-half) ** 3 adds half_cubed
            delta = upper.mul_(dst).add_(half[rows])
            torch.sub(end, delta, out=delta)
            cube = torch.mul(delta, delta, out=tmp).mul_(delta)
            norm.add_(cube.add_(half_cubed[rows]).div_(3).mul_(density))
            if bins <= _ROW_SUM_LIMIT:
                torch.sum(norm, dim=1, out=norms[rows])
            else:
                norms[rows] = torch.stack([row.sum() for row in norm])
        return norms.tolist()


@functools.lru_cache(maxsize=8)
def _bin_indices(bins: int) -> torch.Tensor:
    """``torch.arange(bins)`` as float32 (exact below 2**24), shared: only ever read."""
    return torch.arange(bins, dtype=_F32)


class _FloorDiv:
    """``torch.clamp(torch.div(x, dst_bin_width, rounding_mode="floor"), 0, top)``, per row.

    torch's floor division of float32 values (``fmod``, a division, then a rounded floor) costs
    about 2 ns an element. Its result is the exact floor of the real quotient wherever that lies
    within ``[-2**22, 2**22]``, and beyond that it lies beyond the clamp bounds too (``top`` is
    at most 65535). The floor of the same float32 values divided in float64 is exact up to
    2**28: a quotient of float32 values is an integer or lies at least 2**-24 (or 2**-25 of its
    magnitude) from every integer, more than float64 rounding moves it. A zero divisor gives
    the same infinities or NaN either way. The divided values must be finite (torch gives NaN
    for an infinite one): ``exact`` says they are; otherwise torch's own ``div`` runs.
    """

    def __init__(self, divisor: torch.Tensor, top: int, exact: bool) -> None:
        self.divisor = divisor.to(torch.float64) if exact else divisor
        self.top = top
        self.exact = exact
        self.scratch: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, rows: slice, out: torch.Tensor) -> torch.Tensor:
        if not self.exact:
            return torch.div(x, self.divisor[rows], rounding_mode="floor", out=out).clamp_(0, self.top)
        if self.scratch is None or self.scratch.shape[0] < x.shape[0]:
            self.scratch = torch.empty(x.shape, dtype=torch.float64)
        quotient = self.scratch[: x.shape[0]]
        quotient.copy_(x).div_(self.divisor[rows]).floor_().clamp_(0, self.top)
        return out.copy_(quotient)


class _Walk:
    """The bin walk of torchao's ``_non_linear_param_search``, one candidate range at a time.

    ``peek(n)`` returns the next ``n`` candidate ``(start_bin, end_bin)`` ranges the search would
    try if it accepted each of them (fewer when they are far apart; none when the walk is over);
    ``accept()`` commits to the first pending one.

    ``c_sum`` holds the float32 cumulative histogram as Python floats (a memoryview of it: the
    walk reads only a few bins near each end). torchao compares the 0-dim float32 tensors
    ``cSum[l]`` with Python floats, i.e. with those floats rounded to float32; the thresholds
    are rounded the same way here (storing into a float32 array rounds as torch does).
    """

    def __init__(
        self, c_sum: Sequence[float], total: float, bins: int, native: tuple[Any, int] | None = None
    ) -> None:
        self.c_sum = c_sum
        self.total = total
        self.bins = bins
        #: (kernels.search_walk_native(), the address of c_sum's float32 counts): the same walk in C
        self.native = native
        self.alpha, self.beta = 0.0, 1.0
        self.start_bin, self.end_bin = 0, bins - 1
        self._pending: list[tuple[float, float, int, int]] = []  # (alpha, beta, start, end) after each

    def peek(self, n: int) -> list[tuple[int, int]]:
        alpha, beta, start_bin, end_bin = self.alpha, self.beta, self.start_bin, self.end_bin
        if self.native is not None:  # the loop below, step for step, a tenth of its time
            walk, address = self.native
            self._pending = walk(
                address, self.bins, self.total, alpha, beta, start_bin, end_bin, n, _PEEK_STEPS
            )
            return [(p[2], p[3]) for p in self._pending]
        c_sum, total, stepsize = self.c_sum, self.total, 1e-5
        pending: list[tuple[float, float, int, int]] = []
        rounded = array("f", (0.0, 0.0))
        steps = 0
        # once start_bin == end_bin no step changes them: torchao steps on to alpha >= beta
        while len(pending) < n and alpha < beta and start_bin < end_bin:
            if pending and steps >= _PEEK_STEPS:
                break  # a sparse histogram: the next candidates may never be tried
            steps += 1
            next_alpha = alpha + stepsize
            next_beta = beta - stepsize
            rounded[0] = next_alpha * total
            rounded[1] = next_beta * total
            low_threshold, high_threshold = rounded
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


def _rebin_runs(
    histogram: torch.Tensor, rate: int, mids: torch.Tensor, edges: torch.Tensor
) -> torch.Tensor | None:
    """:meth:`HistogramObserver._rebin` with torch operations (None unless ``mids``/``edges`` sort).

    When the mid-points and the new edges are sorted, the sub-bins of one new bin are a run: a
    ``searchsorted`` of the edges finds where each run starts, and ``segment_reduce`` adds up
    each run in the same order with the same float32 additions as torchao's ``bincount``.
    """
    if not (_sorted(mids) and _sorted(edges)):
        return None
    bins, n = edges.numel() - 1, mids.numel()
    # torchao repeats, then divides: dividing first divides each value once, to the same result
    weights = (histogram / rate).repeat_interleave(rate)
    # new bin b > 0 starts at the first mid-point >= edges[b]; bin 0 also takes what lies
    # below edges[0] and the last bin what lies at or above edges[bins] (torchao's clamp)
    starts = torch.searchsorted(mids, edges[1:bins], side="left")
    lengths = torch.diff(starts, prepend=_ZERO_INDEX, append=_index(n))
    return torch.segment_reduce(weights, "sum", lengths=lengths, unsafe=True)


def _sorted(values: torch.Tensor) -> bool:
    """Whether a 1-D float tensor is non-decreasing (False with NaN: its differences are NaN)."""
    return values.numel() < 2 or bool(values.diff().min() >= 0)


_ZERO_INDEX = torch.zeros(1, dtype=torch.int64)


@functools.lru_cache(maxsize=8)
def _index(i: int) -> torch.Tensor:
    """``torch.tensor([i])``, shared: only ever read."""
    return torch.tensor([i], dtype=torch.int64)


class PerChannelMinMaxObserver(_ao.PerChannelMinMaxObserver):  # type: ignore[misc,name-defined]
    """torchao's PerChannelMinMaxObserver with ``amin``/``amax`` instead of ``aminmax(dim=1)``,
    or the native kernels' one pass over the rows (:func:`kernels.row_extremes`).

    NaN/inf values raise under the calibration's default policy; with "ignore" each channel's
    range is that of its finite values.
    """

    nonfinite: str = "error"
    where: str = ""
    nonfinite_ignored: int = 0

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
        # one native pass where every row's extremes are finite non-zero values (unique: torch's)
        extremes = kernels.row_extremes(y)
        if extremes is not None and nonfinite.mask_sentinel(self) == -math.inf:
            lo, hi = extremes  # finite, so ordinary: no value lies at or below a sentinel of -inf
        else:
            lo, hi = extremes or (torch.amin(y, dim=1), torch.amax(y, dim=1))
            if not nonfinite.all_ordinary(self, lo, hi):
                lo, hi = nonfinite.finite_extremes(self, y, dims=(1,))
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


def observe_constant(obs: Any, value: torch.Tensor) -> bool:
    """``obs(value)`` for a fresh accelerated :class:`PerChannelMinMaxObserver` fed a constant
    (convert observes each weight once, into a fresh copy of its observer), or False, having
    done nothing, where anything but the common path would run.

    The common path: no hook or compiled call that ``nn.Module.__call__`` would run, an empty
    state (so the state becomes the rows' extremes), a float32 CPU ``value`` whose channel axis is
    its first, and finite non-zero extremes found by the native kernels under a policy that takes
    no mask sentinel (:func:`nonfinite.mask_sentinel` is -inf): then ``forward`` would store
    exactly ``kernels.row_extremes(value.flatten(1))``, which is stored here without the call's
    frames, the permutation and the copies into the empty buffers (a third of observing a
    decoder's weights at convert).
    """
    if type(obs) is not PerChannelMinMaxObserver or not forward_only(obs):
        return False
    buffers = obs._buffers
    min_val, max_val = buffers.get("min_val"), buffers.get("max_val")
    if min_val is None or max_val is None or min_val.numel() or max_val.numel():
        return False
    if min_val.dtype is not _F32 or max_val.dtype is not _F32 or value.dtype is not _F32:
        return False
    if obs.ch_axis != 0 or value.dim() < 2 or not value.numel() or nonfinite.mask_sentinel(obs) != -math.inf:
        return False
    extremes = kernels.row_extremes(value.detach().flatten(1))
    if extremes is None:
        return False
    # forward's resize_ + copy_ of these into the empty buffers: the same float32 values
    buffers["min_val"], buffers["max_val"] = extremes
    return True


def per_channel_qparams(
    observers: Sequence[PerChannelMinMaxObserver],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``obs.calculate_qparams()`` of each observer, computed for many observers at once.

    torchao's ``_calculate_qparams`` is elementwise over the channels once its validity check
    passes, so observers with the same settings get theirs from one call on their concatenated
    running ranges (one observer's ~20 small tensor operations, instead of ~20 per observer).
    Each result is split off and copied, so no two observers' qparams share storage. Observers
    whose ranges torchao would reject or warn about (empty, ``min > max``) keep their own call.
    """
    results: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(observers)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, obs in enumerate(observers):
        lo, hi = obs.min_val, obs.max_val
        if lo.dim() != 1 or lo.numel() == 0 or lo.shape != hi.shape or lo.dtype != hi.dtype:
            continue
        eps = obs.eps
        key: tuple[Any, ...] = (obs.qscheme, obs.dtype, obs.quant_min, obs.quant_max)
        key += (obs.has_customized_qrange, eps.dtype, eps.device, tuple(eps.reshape(-1).tolist()))
        key += (lo.dtype, lo.device)
        groups.setdefault(key, []).append(i)
    for members in groups.values():
        lo = torch.cat([observers[i].min_val for i in members])
        hi = torch.cat([observers[i].max_val for i in members])
        if not bool((lo <= hi).all()):  # torchao asserts, per observer: let each one do so
            continue
        scale, zero_point = observers[members[0]]._calculate_qparams(lo, hi)
        sizes = [observers[i].min_val.numel() for i in members]
        for i, s, z in zip(members, scale.split(sizes), zero_point.split(sizes)):
            results[i] = (s.clone(), z.clone())
    return [obs.calculate_qparams() if r is None else r for obs, r in zip(observers, results)]


#: torchao class -> stand-in (exact type match only)
ACCELERATED: dict[type, type] = {
    _ao.HistogramObserver: HistogramObserver,
    _ao.PerChannelMinMaxObserver: PerChannelMinMaxObserver,
}
