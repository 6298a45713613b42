"""Range observers from running extremes: global, moving-average, per channel.

Each batch's min and max come as two Python floats from one pass of the native kernel where it
applies (else from ``torch.aminmax``): that also tells, for free, whether the batch held NaN or
infinite values (then :mod:`_quantplug.observers.nonfinite` applies the calibration's policy).
"""

from __future__ import annotations

import ctypes
import math
import struct
from collections.abc import Sequence
from typing import Any

import torch

from _quantplug.observers import kernels, nonfinite, seen
from _quantplug.observers.base import ONE, SCALAR_VIEWS, ObserverBase
from _quantplug.observers.merge import merged_average, merged_extremes


def merge_extremes_(observer: Any, others: Sequence[Any]) -> None:
    """Min of the minima, max of the maxima (exact: the state of one observer fed every batch)."""
    peers = [observer, *others]
    found = merged_extremes([(o.min_val, o.max_val) for o in peers], type(observer).__name__)
    if found is not None:
        observer.min_val, observer.max_val = found
    observer._add_batches(others)


def merge_averages_(observer: Any, others: Sequence[Any]) -> None:
    """The batch-weighted mean of the moving averages (see :mod:`_quantplug.observers.merge`)."""
    peers = [observer, *others]
    weights = [int(o.num_batches) for o in peers]
    what = type(observer).__name__
    lo = merged_average([o.min_val for o in peers], weights, what)
    hi = merged_average([o.max_val for o in peers], weights, what)
    if lo is not None and hi is not None:
        observer.min_val, observer.max_val = lo, hi
    observer._add_batches(others)


_F32 = torch.float32
_STRIDED = torch.strided
_ORDINARY_LOW = nonfinite.SCORE_MASK_SENTINEL


def plain_extremes(x: torch.Tensor) -> tuple[float, float] | None:
    """The min and max of ``x`` by the common route, or None where :func:`batch_extremes` must
    decide: a float32 CPU batch (the observers' own policy for NaN/inf still to apply), recalled
    from :data:`seen.EXTREMES` or read by the native kernel (a batch whose values do not fill
    their memory, such as a head split from a q/k/v projection: :func:`_slice_extremes`).

    The same values as :func:`batch_extremes` (which this shortcuts: a range observer runs once
    per activation edge, hundreds of times per forward, and :func:`seen.probe`'s bookkeeping cost
    more than the pass over a decoder's activation): the same conditions for matching a batch
    seen before (:func:`seen.probe`), the same kernel, the same zeros left unrecorded. A batch
    :mod:`seen` may not match (one requiring grad under autograd, an inference tensor) is read
    by the kernel too, neither recalled nor recorded, as :func:`batch_extremes` reads it.
    """
    native = kernels._native
    if native is None or type(x) is not torch.Tensor or x.dtype is not _F32 or x.layout is not _STRIDED:
        return None
    numel = x.numel()
    if not 0 < numel < kernels.MAX_ELEMENTS:
        return None
    contiguous = x.is_contiguous()
    if not seen.matchable(x):
        return _unmatched_extremes(native, x, numel, contiguous) if x.is_cpu else None
    dense = ((1, numel),)
    layout = dense if contiguous else seen.layout(x)
    address = x.data_ptr()
    key = (address, numel, _F32, layout, x._version)
    storage = x.untyped_storage()
    found = seen.known_extremes(key, storage)
    if found is not None:
        return found
    if layout == dense:
        lo, hi = native.minmax(address, numel)
    else:  # a slice (a q/k/v head)
        lo, hi = _slice_extremes(native, x, numel, layout)
    if lo == 0.0 or hi == 0.0:
        # which zero (+0 or -0) is met first depends on the order the values are read in
        # (seen.remember_extremes): kept for a contiguous batch as kernels.extremes keeps it, never
        # recorded; torch's reduction decides for any other
        return (lo, hi) if contiguous else None
    seen.keep_extremes(key, storage, (lo, hi))
    return lo, hi


def _unmatched_extremes(
    native: Any, x: torch.Tensor, numel: int, contiguous: bool
) -> tuple[float, float] | None:
    """:func:`plain_extremes` of a float32 CPU batch :mod:`seen` may not match: the kernel's pass
    (a strided batch's values read as for a matchable one: :func:`_slice_extremes`), nothing
    recalled or recorded. :func:`batch_extremes` gives the same: a contiguous batch read by the same kernel
    (zeros kept), any other by the kernel in memory order or by ``torch.aminmax``, whose extremes
    are these but for the sign of a zero (left to :func:`batch_extremes`, as here) and NaN (both
    NaN: then :mod:`nonfinite` scans the batch itself)."""
    if contiguous:
        return native.minmax(x.data_ptr(), numel)  # type: ignore[no-any-return]
    layout = seen.layout(x)
    if layout == ((1, numel),):  # a permutation of a contiguous block: its memory holds its values
        lo, hi = native.minmax(x.data_ptr(), numel)
    else:
        lo, hi = _slice_extremes(native, x, numel, layout)
    return None if lo == 0.0 or hi == 0.0 else (lo, hi)


def _slice_extremes(native: Any, x: torch.Tensor, numel: int, layout: seen.Layout) -> tuple[float, float]:
    """The min and max of a float32 CPU batch whose values do not fill their memory (a head split
    from a q/k/v projection), as the kernel finds them (NaN, NaN with a NaN): read in place where
    they are rows of contiguous values, ``stride`` apart (:func:`seen.layout` ``((1, n), (stride,
    rows))``) and the extension has ``minmax_rows``, else through a contiguous copy (torch.aminmax
    of a strided tensor takes 4x as long as the copy and the kernel; the copy, 2 us, twice as
    long as reading the rows in place). The same values either way but for the sign of a zero
    extreme, which the callers leave to torch."""
    rows_kernel = getattr(native, "minmax_rows", None)
    if rows_kernel is not None and len(layout) == 2 and layout[0][0] == 1 and layout[1][0] >= layout[0][1]:
        (_, n), (stride, rows) = layout
        return rows_kernel(x.data_ptr(), n, rows, stride)  # type: ignore[no-any-return]
    values = x.detach().contiguous()  # detached: no autograd record of the copy; held while read
    return native.minmax(values.data_ptr(), numel)  # type: ignore[no-any-return]


def batch_extremes(
    observer: Any, x: torch.Tensor, plain: tuple[float, float] | None = None
) -> tuple[float, float] | None:
    """The min and max of ``x`` as floats (None: no finite element to record), NaN/inf handled.

    A batch holding the very values of one observed recently (a view of it, the same tensor at
    another observer, or a constant this observer meets at every batch, such as an embedding
    table sharing its output's grid: :mod:`seen`) gets that batch's extremes without a pass over it.
    ``plain``: :func:`plain_extremes` of ``x``, where the caller has it.
    """
    found = plain if plain is not None else plain_extremes(x)
    if found is None:
        batch = seen.probe(x)
        found = seen.recall(observer, batch)
        if found is None:
            found = seen.recall_extremes(batch)
            if found is None:
                data = x.detach()
                found = kernels.extremes(data, None if batch is None else batch.dense)
                if found is None:
                    lo, hi = torch.stack(list(torch.aminmax(data.float()))).tolist()
                    found = (lo, hi)
                seen.remember_extremes(batch, found)
            if found[0] != 0.0 and found[1] != 0.0:  # see seen.remember_extremes
                seen.remember(observer, batch, found)
    lo, hi = found
    if nonfinite.ordinary(observer, lo, hi):
        return lo, hi
    lo_t, hi_t = nonfinite.finite_extremes(observer, x.detach().float())
    lo, hi = lo_t.item(), hi_t.item()
    return (lo, hi) if lo <= hi else None


class MinMaxObserver(ObserverBase):
    """Running global min and max: the range of everything seen. Cheap and outlier-sensitive."""

    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        found = plain_extremes(x)
        # finite and no mask sentinel possible (nonfinite.ordinary's first test): the common case,
        # without another call; anything else as batch_extremes decides
        if found is None or not (_ORDINARY_LOW < found[0] and found[1] < math.inf):
            found = batch_extremes(self, x, found) if x.numel() else None
            if found is None:
                return x
        self._record(*found)
        return x

    def _record(self, lo: float, hi: float) -> None:
        """Take a batch with extremes ``lo``, ``hi`` into the statistics, and count it."""
        kept = _scalar_record(self)
        if not kept[4]:
            self._update(lo, hi)
            # in place (``+=`` goes through Module.__setattr__), and buffers read from their dict
            # (attribute reads go through Module.__getattr__)
            self._buffers["num_batches"].add_(ONE)  # type: ignore[union-attr]
            return
        # the update and the count in one native call where it writes what _update_views writes
        # (this class's or the moving average's, not a subclass's own), else through the views
        update = type(self)._update_views
        record = getattr(kernels._native, "record_range", None)  # None: kernels off, or an older build
        if record is not None and (update is _MINMAX_UPDATE or update is _AVERAGE_UPDATE):
            low, high, count = kept[3]
            average = update is _AVERAGE_UPDATE
            record(lo, hi, average, self.__dict__.get("averaging_constant", 0.0), low, high, count)
            return
        views = scalar_views(self)
        assert views is not None  # the buffers are plain (kept[4])
        self._update_views(views, lo, hi)
        views[2].value += 1

    def _update(self, lo: float, hi: float) -> None:
        buffers: Any = self._buffers
        low, high = buffers["min_val"], buffers["max_val"]
        if lo < low.item():
            low.fill_(lo)
        if hi > high.item():
            high.fill_(hi)

    def _update_views(self, views: ScalarViews, lo: float, hi: float) -> None:
        """:meth:`_update` through :func:`scalar_views` (the same values written)."""
        low, high, _ = views
        if lo < low.value:
            low.value = lo
        if hi > high.value:
            high.value = hi

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._qparams(self.min_val, self.max_val)

    def merge_(self, others: Sequence[Any]) -> None:
        merge_extremes_(self, others)


class MovingAverageMinMaxObserver(MinMaxObserver):
    """Exponential moving average of each batch's extremes: robust to a few extreme batches.

    ``calls_per_pass`` > 1 (set by prepare for a group observed per pass, see
    ``SharingGroups.observed_per_pass``): that many consecutive calls are one batch, their joint
    extremes one update. With 1, each call is one (torchao's behaviour, kept for parity).
    """

    def __init__(self, averaging_constant: float = 0.01, calls_per_pass: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.averaging_constant = float(averaging_constant)
        self.calls_per_pass = int(calls_per_pass)
        self._calls = 0  # calls of the current pass so far
        self._pending: tuple[float, float] | None = None  # their extremes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls_per_pass <= 1:
            return MinMaxObserver.forward(self, x)  # (super() builds an object per call)
        found = batch_extremes(self, x) if x.numel() else None
        if found is not None:
            pending = self._pending
            if pending is not None:
                found = (min(pending[0], found[0]), max(pending[1], found[1]))
            self._pending = found
        self._calls += 1
        if self._calls >= self.calls_per_pass:
            if self._pending is not None:
                self._record(*self._pending)
            self._calls, self._pending = 0, None
        return x

    def _update(self, lo: float, hi: float) -> None:
        buffers: Any = self._buffers
        low, high = buffers["min_val"], buffers["max_val"]
        if int(buffers["num_batches"]) == 0:
            low.fill_(lo)
            high.fill_(hi)
        else:
            # min + c * (lo - min) in float32 scalars: the very roundings of torch's 0-dim float32
            # arithmetic (torch's observers), without a tensor operation per step
            new_low, new_high = _average_steps(
                low.item(), lo, high.item(), hi, float32(self.averaging_constant)
            )
            low.fill_(new_low)
            high.fill_(new_high)

    def _update_views(self, views: ScalarViews, lo: float, hi: float) -> None:
        low, high, count = views
        if count.value == 0:
            low.value = lo
            high.value = hi
        else:
            low.value, high.value = _average_steps(
                low.value, lo, high.value, hi, float32(self.averaging_constant)
            )

    def merge_(self, others: Sequence[Any]) -> None:
        merge_averages_(self, others)


#: the updates the native ``record_range`` writes (then the count), in one call
_MINMAX_UPDATE = MinMaxObserver._update_views
_AVERAGE_UPDATE = MovingAverageMinMaxObserver._update_views


#: views of a range observer's ``min_val``, ``max_val`` and ``num_batches`` (:func:`scalar_views`)
ScalarViews = tuple[ctypes.c_float, ctypes.c_float, ctypes.c_int64]
_I64 = torch.int64


def scalar_views(observer: Any) -> ScalarViews | None:
    """Views of ``observer``'s three 0-dim buffers' memory (``ctypes`` scalars at their
    addresses: ``.value`` reads or writes the element), or None where they are not plain CPU
    tensors of their usual types (then torch reads and writes them).

    A range observer reads and writes them at every call, hundreds of times per forward; through
    torch each read, write or increment is an operator dispatch (3.5 us of the 10 us of an
    observer call, measured in a decoder's calibration), through a view of the same memory a
    twentieth of it. The values written are the same (a float32 store rounds as ``fill_`` does;
    the values are float32 already); version counters do not move (nothing reads them). The
    views stand while each buffer is the same tensor at the same address (a buffer replaced,
    moved by ``share_memory_`` or ``set_``, or copied: new views); the record holds the tensors,
    so their memory lives as long as the views.
    """
    kept = _scalar_record(observer)
    if not kept[4]:
        return None
    views = kept[5]
    if views is None:  # made at the first use (the native update needs none)
        low, high, count = kept[3]
        views = (
            ctypes.c_float.from_address(low),
            ctypes.c_float.from_address(high),
            ctypes.c_int64.from_address(count),
        )
        observer.__dict__[SCALAR_VIEWS] = (*kept[:5], views)
    return views


#: what :func:`_scalar_record` keeps: the three buffers, their addresses, whether they are plain
#: (:func:`scalar_views` holds), and their views once made
ScalarRecord = tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int, int], bool, ScalarViews | None]


def _scalar_record(observer: Any) -> ScalarRecord:
    """:func:`scalar_views`' record of ``observer``'s buffers (made anew where one moved): the
    native ``record_range`` writes at the addresses it holds, where the views are."""
    buffers = observer._buffers
    low, high, count = buffers["min_val"], buffers["max_val"], buffers["num_batches"]
    kept = observer.__dict__.get(SCALAR_VIEWS)
    if (
        kept is not None
        and kept[0] is low
        and kept[1] is high
        and kept[2] is count
        and kept[3] == (low.data_ptr(), high.data_ptr(), count.data_ptr())
    ):
        return kept  # type: ignore[no-any-return]
    plain = (
        type(low) is torch.Tensor
        and type(high) is torch.Tensor
        and type(count) is torch.Tensor
        and low.dtype is _F32
        and high.dtype is _F32
        and count.dtype is _I64
        and low.is_cpu
        and high.is_cpu
        and count.is_cpu
        and low.dim() == high.dim() == count.dim() == 0
        and not (low.requires_grad or high.requires_grad)
        # written only inside inference mode: torch's own writes say so
        and not (low.is_inference() or high.is_inference() or count.is_inference())
    )
    kept = (low, high, count, (low.data_ptr(), high.data_ptr(), count.data_ptr()), plain, None)
    observer.__dict__[SCALAR_VIEWS] = kept
    return kept


_FLOAT32 = struct.Struct("f")


def float32(value: float) -> float:
    """``value`` rounded to float32 (to nearest, ties to even, as numpy's and torch's casts)."""
    try:
        return _FLOAT32.unpack(_FLOAT32.pack(value))[0]  # type: ignore[no-any-return]
    except OverflowError:  # beyond float32's range: struct refuses what a cast makes infinite
        return math.copysign(math.inf, value)


def _average_step(current: float, value: float, c: float) -> float:
    """``current + (value - current) * c`` in float32 arithmetic (all three float32 values).

    Each float64 operation on float32 operands, rounded to float32, is the float32 operation:
    float64 has more than twice float32's precision plus two bits, so the double rounding is
    exact for a sum, a difference and a product.
    """
    return float32(current + float32(float32(float32(value) - current) * c))


_FLOAT32_PAIR = struct.Struct("ff")


def _average_steps(low: float, lo: float, high: float, hi: float, c: float) -> tuple[float, float]:
    """``(_average_step(low, lo, c), _average_step(high, hi, c))``, each rounding of the two steps
    in one ``struct`` call (a moving average's update is two steps per observer call)."""
    pack, unpack = _FLOAT32_PAIR.pack, _FLOAT32_PAIR.unpack
    try:
        a, b = unpack(pack(lo, hi))
        a, b = unpack(pack(a - low, b - high))
        a, b = unpack(pack(a * c, b * c))
        return unpack(pack(low + a, high + b))  # type: ignore[no-any-return]
    except OverflowError:  # beyond float32's range: float32() makes it infinite
        return _average_step(low, lo, c), _average_step(high, hi, c)


def _per_channel_extremes(observer: Any, x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.detach().float().movedim(axis, 0).reshape(x.shape[axis], -1)
    # amin + amax: two passes, yet about 10x faster than aminmax(dim=1) on CPU
    lo, hi = torch.amin(flat, dim=1), torch.amax(flat, dim=1)
    if not nonfinite.all_ordinary(observer, lo, hi):  # amin/amax propagate NaN; an inf shows as an extreme
        lo, hi = nonfinite.finite_extremes(observer, flat, dims=(1,))
    return lo, hi


class PerChannelMinMaxObserver(ObserverBase):
    """Min and max per slice along ``ch_axis`` (weights: one scale per output channel)."""

    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(self, ch_axis: int | None = 0, **kwargs: Any) -> None:
        kwargs.setdefault("qscheme", torch.per_channel_symmetric)
        super().__init__(ch_axis=0 if ch_axis is None else ch_axis, **kwargs)
        self.register_buffer("min_val", torch.empty(0))
        self.register_buffer("max_val", torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x
        axis = self.ch_axis if self.ch_axis is not None else 0
        lo, hi = _per_channel_extremes(self, x, axis if axis >= 0 else x.dim() + axis)
        if self.min_val.numel() == 0:
            self.min_val = lo.clone()
            self.max_val = hi.clone()
        else:
            self._update(lo, hi)
        self.num_batches.add_(ONE)
        return x

    def _update(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        torch.minimum(self.min_val, lo, out=self.min_val)
        torch.maximum(self.max_val, hi, out=self.max_val)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._qparams(self.min_val, self.max_val)

    def merge_(self, others: Sequence[Any]) -> None:
        merge_extremes_(self, others)


class MovingAveragePerChannelMinMaxObserver(PerChannelMinMaxObserver):
    """Per-channel exponential moving average of extremes."""

    def __init__(self, averaging_constant: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.averaging_constant = float(averaging_constant)

    def _update(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        c = self.averaging_constant
        self.min_val.copy_(self.min_val + c * (lo - self.min_val))
        self.max_val.copy_(self.max_val + c * (hi - self.max_val))

    def merge_(self, others: Sequence[Any]) -> None:
        merge_averages_(self, others)
