"""The optional native kernels of the histogram observers, behind tensor-level functions.

Calibration runs an observer right after each weight-heavy layer, with cold caches; there each
torch operation costs several microseconds of dispatch before any arithmetic, and a histogram
observer's batch (a min/max reduction, then torch.histc's binning as five vectorised operations
and a bincount) is most of the calibration overhead. ``_histogram_kernels`` (C, built with the
package where a compiler is available) does the same work in two passes over the batch, writing
the counts straight into the histogram; a histogram observer's batch within its range (most
batches, once the ranges stop growing) is a single call, :func:`observe_histogram`, and so is its
first batch, which sets the range, :func:`start_histogram`.

convert uses two more for constants: a per-channel weight observer's min/max of every row in one
pass (:func:`row_extremes`), and the weight's integers written straight from its floats
(:func:`quantize_rows`) instead of five weight-sized passes of torch operations; and torchao's
histogram clipping search (peers/torchao_observer_classes.py) its candidates' per-bin error terms
in one pass (:func:`search_norms`) instead of about twenty. The algorithms' quantized simulation
fake-quantizes every activation at each of the guard's trials, one pass each (:func:`fake_quantize`).

Every function here returns None (or False) where the native path does not apply, and the
callers then run their torch code, which computes the same values: the kernels are a speed-up,
never a requirement. ``QUANTPLUG_NATIVE_KERNELS=0`` in the environment, or :func:`disabled`,
turns them off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, Literal

import torch

from _quantplug.observers import seen

_built: ModuleType | None
try:
    from _quantplug.observers import _histogram_kernels as _built
except ImportError:  # built without a C compiler: the torch code paths run
    _built = None
if _built is not None and not hasattr(_built, "start"):
    _built = None  # built from an older source (an in-place build not redone): its calls differ

_native: ModuleType | None = None if os.environ.get("QUANTPLUG_NATIVE_KERNELS", "1") == "0" else _built

#: the native binning keeps exact integer counts below this many elements per call
MAX_ELEMENTS = 1 << 24
#: views the histogram observer's native step counts in place up to this many values; it leaves
#: larger ones to the general path, where a view of a batch the observer just counted (the heads
#: of an attention projection, their reshapes and transposes) is recalled (:mod:`seen`) for a
#: constant cost instead of counted again (0.4 ns a value): the same counts either way
VIEW_LIMIT = 1 << 16
#: the observer attribute keeping its native step (the histogram observer's: it writes that
#: observer's own buffers, so copies drop it, or have it ``rebound`` to their own)
STEP_ATTR = "_quantplug_steady"
_F32 = torch.float32


def available() -> bool:
    """Whether the native kernels were built (installation without a C compiler skips them)."""
    return _built is not None


def enabled() -> bool:
    """Whether the native kernels are built and in use."""
    return _native is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the torch code paths instead of the native kernels (to compare the two)."""
    global _native
    saved, _native = _native, None
    try:
        yield
    finally:
        _native = saved


def _plain(x: torch.Tensor) -> bool:
    """Whether ``x`` is a dense, contiguous float32 CPU tensor whose memory the kernels may read."""
    return (
        type(x) is torch.Tensor  # not a subclass (fake, functional, ...): those may have no storage
        and x.dtype is _F32
        and x.layout is torch.strided
        and x.device.type == "cpu"
        and x.is_contiguous()
    )


def dense_values(x: torch.Tensor) -> bool:
    """Whether ``x`` is a float32 CPU tensor whose values fill the memory from ``x.data_ptr()`` on,
    one each (contiguous, or a transpose or permutation of a contiguous block): reductions and
    counts that do not depend on the order of the values may read that memory as it lies."""
    return (
        type(x) is torch.Tensor
        and x.dtype is _F32
        and x.layout is torch.strided
        and x.device.type == "cpu"
        and seen.dense(x)
    )


def readable(x: torch.Tensor, dense: bool | None = None) -> bool:
    """Whether the native kernels are in use and may read ``x`` (:func:`dense_values`, with
    fewer than :data:`MAX_ELEMENTS` elements): then ``checked=True`` skips the same checks.
    ``dense``: :func:`seen.dense` of ``x`` where the caller knows it."""
    if _native is None or not 0 < x.numel() < MAX_ELEMENTS:
        return False
    if dense is None:
        return dense_values(x)
    return dense and type(x) is torch.Tensor and x.dtype is _F32 and x.is_cpu


def minmax(x: torch.Tensor, checked: bool = False) -> tuple[float, float] | None:
    """``torch.aminmax(x)`` as Python floats (NaN, NaN with a NaN in ``x``), or None.

    None also where an extreme is zero: torch's reduction may return either sign of zero when
    both occur, and observers keep the sign they are given. ``checked``: :func:`readable` is known
    to hold for ``x``.
    """
    if not checked and not readable(x):
        return None
    assert _native is not None
    lo, hi = _native.minmax(x.data_ptr(), x.numel())
    return None if lo == 0.0 or hi == 0.0 else (lo, hi)


def extremes(x: torch.Tensor, dense: bool | None = None) -> tuple[float, float] | None:
    """``torch.aminmax(x)`` as Python floats (NaN, NaN with a NaN in ``x``), or None.

    Unlike :func:`minmax` this keeps an extreme of zero with whichever sign the kernel met first
    (in a contiguous ``x``: for observers whose qparams do not depend on the sign of a zero
    extreme, quantplug's own). ``dense``: as for :func:`readable`.
    """
    if not readable(x, dense):
        return None
    assert _native is not None
    lo, hi = _native.minmax(x.data_ptr(), x.numel())
    if (lo == 0.0 or hi == 0.0) and not x.is_contiguous():
        return None  # the sign of a zero extreme met in memory order may not be the one torch gives
    return lo, hi


def bin_counts(
    x: torch.Tensor,
    lo: float,
    scale: float,
    divisor: float,
    bins: int,
    out: torch.Tensor,
    accumulate: bool,
    checked: bool = False,
    extremes: tuple[float, float] | None = None,
) -> bool:
    """Count ``x`` into ``out`` (``bins`` float32 counters: set, or added to); False if not done.

    The bin of a value is ``int(min((x - lo) * scale / divisor, bins - 1))`` in float32 (no
    multiplication when ``scale`` is 0): :class:`_quantplug.observers.binning.LinearBinning`
    chooses the operands so that this is torch.histc's bin. ``x`` must lie within the binned
    range; ``out`` must not overlap ``x``. ``checked``: :func:`readable` is known to hold for
    ``x``, and ``out`` is a contiguous float32 CPU tensor of ``bins`` elements. ``extremes``:
    ``x``'s ``(min, max)`` where known (:func:`minmax`'s), to spare the kernel finding them.
    """
    if not checked and not (readable(x) and _plain(out) and out.numel() == bins):
        return False
    assert _native is not None
    if extremes is None:
        _native.bin_counts(x.data_ptr(), x.numel(), lo, scale, divisor, bins, out.data_ptr(), accumulate)
    else:
        _native.bin_counts(
            x.data_ptr(), x.numel(), lo, scale, divisor, bins, out.data_ptr(), accumulate, *extremes
        )
    return True


def observe_histogram(
    x: torch.Tensor,
    binning: tuple[float, float, float, float, int],
    histogram: torch.Tensor,
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    num_batches: torch.Tensor,
) -> tuple[float, float] | Literal[False] | None:
    """A histogram observer's batch in one native call, where its range already holds the batch.

    ``x`` is read in place where it is contiguous, and where it is a view of at most
    :data:`VIEW_LIMIT` values that are rows of contiguous values (a head split from a projection,
    its reshape or transpose) or a permutation of a contiguous block.

    ``binning``: ``(lo, hi, scale, divisor, bins)``, the range and :func:`bin_counts`' operands
    of its bins; the buffers: float32 contiguous CPU ``histogram`` (``bins`` counters), float32
    ``min_val`` and ``max_val``, int64 ``num_batches`` (the caller checks them once). Where the
    buffers hold that range and every value of ``x`` lies in it, the counts are added to the
    histogram (rounded as ``histogram.add_(counts)`` rounds them), ``num_batches`` grows by one,
    and None is returned. Otherwise nothing is written: False where the kernels cannot read ``x``
    (or are off), else ``x``'s ``(min, max)`` as :func:`minmax` computes them (NaN, NaN with a
    NaN), for the caller's general path. (The observer's first batch, which sets the range:
    :func:`start_histogram`.)
    """
    native = _native
    if native is None or type(x) is not torch.Tensor or x.dtype is not _F32 or x.layout is not torch.strided:
        return False
    n = x.numel()
    if not 0 < n < MAX_ELEMENTS or not x.is_cpu:
        return False
    rows, stride = 1, 0
    if not x.is_contiguous():
        if n > VIEW_LIMIT:
            return False
        blocks = seen.layout(x)
        if len(blocks) == 2 and blocks[0][0] == 1 and blocks[1][0] >= blocks[0][1]:
            (_, n), (stride, rows) = blocks
        elif blocks != ((1, n),):  # not dense (a permutation of a contiguous block) either
            return False
    lo, hi, scale, divisor, bins = binning
    return native.observe(  # type: ignore[no-any-return]
        x.data_ptr(),
        n,
        rows,
        stride,
        lo,
        hi,
        scale,
        divisor,
        bins,
        histogram.data_ptr(),
        min_val.data_ptr(),
        max_val.data_ptr(),
        num_batches.data_ptr(),
    )


def start_histogram(
    x: torch.Tensor,
    bins: int,
    floor: float,
    histogram: torch.Tensor,
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    num_batches: torch.Tensor,
) -> tuple[float, float, float, float, int] | tuple[float, float] | None:
    """A histogram observer's first batch in one native call: ``x``'s extremes, then its counts
    over its own range, written with the range (two passes over ``x``, no Python in between).

    The buffers: as for :func:`observe_histogram`. Where they hold no range yet (``min_val >
    max_val``), neither extreme of ``x`` is zero (torch decides the sign of a zero extreme),
    its minimum lies above ``floor`` and :meth:`LinearBinning.make
    <_quantplug.observers.binning.LinearBinning.make>` makes a binning of ``[min, max]``, the
    counts are written to ``histogram`` (set, not added), the range to ``min_val`` and
    ``max_val``, ``num_batches`` grows by one, and the binning's ``(lo, hi, scale, divisor,
    bins)`` is returned (:func:`observe_histogram`'s operands for later batches). Otherwise
    nothing is written and ``x``'s ``(min, max)`` is returned, as :func:`minmax` computes them
    (zeros included); None where the kernels cannot read ``x`` (contiguous only) or are off.
    """
    native = _native
    if (
        native is None
        or type(x) is not torch.Tensor
        or x.dtype is not _F32
        or x.layout is not torch.strided
        or not x.is_cpu
        or not x.is_contiguous()
    ):
        return None
    n = x.numel()
    if not 0 < n < MAX_ELEMENTS:
        return None
    return native.start(  # type: ignore[no-any-return]
        x.data_ptr(),
        n,
        bins,
        floor,
        histogram.data_ptr(),
        min_val.data_ptr(),
        max_val.data_ptr(),
        num_batches.data_ptr(),
    )


def rebin(
    hist: torch.Tensor,
    rate: int,
    mids: torch.Tensor,
    edges: torch.Tensor,
    out: torch.Tensor,
    base: torch.Tensor | None = None,
) -> bool:
    """torchao's re-binning of ``hist`` onto ``edges``, written to ``out`` (plus ``base``); False if not done.

    Each old bin's count is spread evenly over ``rate`` sub-bins whose mid-points ``mids``
    (``bins * rate`` of them) fall into the new bins ``edges`` bounds (``bins + 1`` values),
    and the sub-bins of each new bin are summed in order in float32, as torchao's
    ``_upscale_histogram`` does with ``bucketize`` and a weighted ``bincount``. ``out`` may be
    ``hist`` itself. False, with nothing written, also where ``mids`` or ``edges`` are not sorted.
    """
    if _native is None:
        return False
    bins = hist.numel()
    if not (_plain(hist) and _plain(mids) and _plain(edges) and _plain(out)):
        return False
    if mids.numel() != bins * rate or edges.numel() != bins + 1 or out.numel() != bins:
        return False
    if base is not None and not (_plain(base) and base.numel() == bins):
        return False
    base_address = 0 if base is None else base.data_ptr()
    return _native.rebin(
        hist.data_ptr(), bins, rate, mids.data_ptr(), edges.data_ptr(), base_address, out.data_ptr()
    )


def row_extremes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(torch.amin(x, dim=1), torch.amax(x, dim=1))`` of a 2-d ``x`` in one pass, or None.

    None where the kernels are off or cannot read ``x`` (:func:`_plain`, or built from an older
    source without ``row_extremes``), and where a row's min or max is NaN, infinite or zero: torch
    may return either sign of a zero extreme, and the caller's torch path handles the others.
    """
    native = _native
    if native is None or not hasattr(native, "row_extremes") or x.dim() != 2 or not _plain(x):
        return None
    rows, cols = x.shape
    if not rows or not cols:
        return None
    lo, hi = torch.empty(rows, dtype=_F32), torch.empty(rows, dtype=_F32)
    if not native.row_extremes(x.data_ptr(), rows, cols, lo.data_ptr(), hi.data_ptr()):
        return None
    return lo, hi


#: the storage types :func:`quantize_rows` writes, and whether each is unsigned
_CODE_TYPES = {torch.int8: (False, -128, 127), torch.uint8: (True, 0, 255)}


def quantize_rows(
    x: torch.Tensor,
    inverse: torch.Tensor,
    zero_point: torch.Tensor,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """``clamp(round(x * inverse) + zero_point, quant_min, quant_max).to(dtype)`` in one pass, or None.

    ``x``: a contiguous float32 tensor whose first dimension is the rows; ``inverse`` and
    ``zero_point``: float32 tensors of one value, or one per row (the float32 values torch's
    multiplication and addition would use). The same float32 steps as the torch expression
    (rounding half to even), written straight into the integers. None where the kernels are off
    or built without ``quantize_rows``, ``dtype`` is not int8 or uint8, ``[quant_min, quant_max]``
    leaves its range, an operand does not suit, or a product is NaN: then the torch path runs.
    """
    native = _native
    kind = _CODE_TYPES.get(dtype)
    if (
        native is None
        or kind is None
        or not hasattr(native, "quantize_rows")
        or x.dim() == 0
        or not _plain(x)
    ):
        return None
    is_unsigned, floor, ceiling = kind
    if not floor <= quant_min <= quant_max <= ceiling or not x.numel():
        return None
    rows = x.shape[0]
    steps = []
    for operand in (inverse, zero_point):
        if not _plain(operand) or operand.numel() not in (1, rows):
            return None
        steps.append(0 if operand.numel() == 1 else 1)
    out = torch.empty(x.shape, dtype=dtype)
    done = native.quantize_rows(
        x.data_ptr(),
        rows,
        x.numel() // rows,
        inverse.data_ptr(),
        steps[0],
        zero_point.data_ptr(),
        steps[1],
        quant_min,
        quant_max,
        out.data_ptr(),
        is_unsigned,
    )
    return out if done else None


def quantization_errors(
    x: torch.Tensor, scale: torch.Tensor, quant_min: int, quant_max: int, out: torch.Tensor
) -> bool:
    """``x - clamp(round(x / scale), quant_min, quant_max) * scale`` written into ``out`` in one
    pass; False, with nothing written, where it does not run (then the torch operations do).

    ``x`` and ``out``: contiguous CPU tensors of one shape, float32 or float64, whose first
    dimension is the rows (``out`` may not overlap ``x``); ``scale``: one value per row, or one,
    contiguous, of their dtype. The same operations as torch's, in that dtype (division,
    rounding half to even, clamp, product, difference), each value once instead of through five
    tensor passes. Only for ``quant_min < 0 < quant_max`` (a symmetric grid's codes without zero
    point: no clamp bound is a zero whose sign torch might pick otherwise).
    """
    native = _native
    if native is None or not hasattr(native, "quantization_errors") or x.dim() == 0 or not x.numel():
        return False
    dtype = x.dtype
    if dtype not in (torch.float32, torch.float64) or not quant_min < 0 < quant_max or quant_max > 1 << 24:
        return False
    if quant_min < -(1 << 24):
        return False
    for t in (x, scale, out):
        if (
            type(t) is not torch.Tensor
            or t.dtype is not dtype
            or t.device.type != "cpu"
            or not t.is_contiguous()
        ):
            return False
    rows = x.shape[0]
    if out.shape != x.shape or scale.numel() not in (1, rows) or out.data_ptr() == x.data_ptr():
        return False
    native.quantization_errors(
        x.data_ptr(),
        rows,
        x.numel() // rows,
        scale.data_ptr(),
        0 if scale.numel() == 1 else 1,
        quant_min,
        quant_max,
        out.data_ptr(),
        dtype is torch.float64,
    )
    return True


def fake_quantize_available() -> bool:
    """Whether :func:`fake_quantize` runs (the kernels are on and built with it)."""
    return _native is not None and hasattr(_native, "fake_quantize")


def fake_quantize(
    value: torch.Tensor, inverse: float, scale: float, zero_point: int, quant_min: int, quant_max: int
) -> torch.Tensor | None:
    """``torch.fake_quantize_per_tensor_affine``'s values for ``value`` in one pass, or None.

    The float32 steps of the quantized simulation's torch path
    (:func:`~_quantplug.algorithms.sequential.fake_quantize_per_tensor`): ``value * inverse``
    rounded half to even, the zero point added, clamped, taken back and multiplied by ``scale``
    (``inverse`` and ``scale``: float32 values). That path is six passes over the activation
    (five operations and a min/max check), the kernel one. None where the kernels are off or
    built without ``fake_quantize``, ``value`` does not suit, an integer is 2^24 or beyond in
    magnitude, or a product is NaN or beyond 2^62 (ATen's kernel decides those): then the torch
    path runs.

    A parameter (an embedding table read as an activation: 25M values on a 110M Llama, a third of
    a second through the torch path) is read as the tensor it holds. A view whose values do not
    fill its memory (a slice, a transpose of one, a broadcast: the rotary halves and the
    GQA-expanded keys and values of an LLM's attention) is first copied into the layout torch's
    elementwise result takes (``empty_like``'s: TensorIterator's stride order) and quantized there
    in place: two passes instead of six, the same values in the same layout.
    """
    native = _native
    if native is None or not hasattr(native, "fake_quantize") or not value.numel():
        return None
    if max(abs(quant_min), abs(quant_max), abs(zero_point)) >= 1 << 24 or quant_min > quant_max:
        return None
    if type(value) is torch.nn.Parameter:
        value = value.detach()  # the same memory, a plain tensor
    if type(value) is not torch.Tensor or value.dtype is not _F32 or value.layout is not torch.strided:
        return None
    if value.device.type != "cpu":
        return None
    out = torch.empty_like(value)  # torch's elementwise result's strides (a permutation keeps its own)
    if _plain(value) or dense_values(value):
        if out.stride() != value.stride():
            return None
        source = value
    elif dense_values(out):
        source = out.copy_(value)  # the values in the result's layout, quantized there in place
    else:
        return None
    done = native.fake_quantize(
        source.data_ptr(), value.numel(), inverse, scale, zero_point, quant_min, quant_max, out.data_ptr()
    )
    return out if done else None


def fake_quantizer(
    inverse: float, scale: float, zero_point: int, quant_min: int, quant_max: int
) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """:func:`fake_quantize` for one encoding (the same result, None alike), its checks of the
    encoding made once and a contiguous float32 CPU tensor taken straight to the kernel: the
    quantized simulation calls it for every activation of every trial (38k calls on a 110M
    Llama's guard), where the checks cost as much as the kernel on an LLM's small activations.
    A contiguous tensor is dense, so ``empty_like`` gives it its own strides: the layout
    :func:`fake_quantize` checks for."""
    native = _native
    if (
        native is None
        or not hasattr(native, "fake_quantize")
        or max(abs(quant_min), abs(quant_max), abs(zero_point)) >= 1 << 24
        or quant_min > quant_max
    ):
        return lambda value: fake_quantize(value, inverse, scale, zero_point, quant_min, quant_max)
    run = native.fake_quantize

    def quantize(value: torch.Tensor) -> torch.Tensor | None:
        if (
            _native is native  # not switched off since (disabled(), a test's stand-in)
            and type(value) is torch.Tensor
            and value.dtype is _F32
            and value.layout is torch.strided
            and value.is_cpu
            and value.is_contiguous()
        ):
            count = value.numel()
            if not count:
                return None
            out = torch.empty_like(value)
            done = run(
                value.data_ptr(), count, inverse, scale, zero_point, quant_min, quant_max, out.data_ptr()
            )
            return out if done else None
        return fake_quantize(value, inverse, scale, zero_point, quant_min, quant_max)

    return quantize


def search_norms_available() -> bool:
    """Whether :func:`search_norms` runs (the kernels are on and built with it)."""
    return _native is not None and hasattr(_native, "search_norms")


def search_norms(
    density: torch.Tensor,
    bin_width: torch.Tensor,
    owner: torch.Tensor | None,
    columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    top: int,
    first: int,
    rows: int,
    out: torch.Tensor,
) -> bool:
    """The per-bin error terms of candidates ``first .. first + rows`` of torchao's histogram
    clipping search (``torchao_observer_classes._Searches.errors``' float32 operations, in its
    order) into ``out``'s first ``rows`` rows; the caller sums each row with torch. False, with
    nothing written, where the operands do not suit (then the torch operations run).

    ``density``: float32 ``[observers, bins]``; ``bin_width``: float32 ``[observers, 1]``;
    ``owner``: int64 ``[candidates]``, each candidate's observer (None: all the first);
    ``columns``: the candidates' float32 ``start``, ``dst``, ``half``, ``half_cubed`` and
    ``whole_bin`` (``[candidates, 1]``); ``out``: float32 ``[>= rows, bins]``. All contiguous.
    Only where :func:`search_norms_available` and the bin positions are finite (the floor
    division in float64 is then torch's); the caller checks both.
    """
    assert _native is not None
    if density.dim() != 2 or not all(_plain(t) for t in (density, bin_width, out, *columns)):
        return False
    bins, observers = density.shape[1], density.shape[0]
    if out.dim() != 2 or out.shape[0] < rows or out.shape[1] != bins or bin_width.numel() != observers:
        return False
    if any(c.numel() < first + rows for c in columns):
        return False
    if owner is None:
        owner_address = 0
    elif owner.dtype is torch.int64 and owner.is_contiguous() and owner.numel() >= first + rows:
        owner_address = owner.data_ptr() + 8 * first
    else:
        return False
    start, dst, half, half_cubed, whole_bin = (c.data_ptr() + 4 * first for c in columns)
    _native.search_norms(
        bins,
        rows,
        density.data_ptr(),
        owner_address,
        start,
        bin_width.data_ptr(),
        dst,
        half,
        half_cubed,
        whole_bin,
        top,
        out.data_ptr(),
    )
    return True


def search_walk_native() -> Any:
    """The native :func:`search_walk` step of the kernels, or None where they are off or were built
    from a source without it (then ``_Walk.peek`` walks in Python, with the same candidates).

    ``search_walk(c_sum_address, bins, total, alpha, beta, start_bin, end_bin, n, max_steps)``
    returns the next ``n`` candidate ``(alpha, beta, start_bin, end_bin)`` states of torchao's
    histogram bin walk over ``bins`` contiguous float32 cumulative counts (the caller keeps the
    tensor alive and passes a valid state): the float64 steps of ``alpha`` and ``beta``, each
    threshold rounded to float32 as torch rounds a Python float, compared with the counts as
    ``_Walk.peek`` compares them.
    """
    native = _native
    return getattr(native, "search_walk", None) if native is not None else None
