"""torch.histc's binning, bit for bit and faster: for quantplug's own histogram observer and
the accelerated torchao ones (:mod:`_quantplug.peers.torchao_observers`).

torch.histc bins one element per 6-7 ns in scalar code; :class:`LinearBinning` gives the same
float32 counts from the native kernel (:mod:`_quantplug.observers.kernels`) or vectorised torch
operations, where it applies (float32 CPU values, fewer than 2**24 of them, a range whose edges
torch.histc would make exactly); elsewhere torch.histc runs.
"""

from __future__ import annotations

import struct

import torch

from _quantplug.observers import kernels

#: histc accumulates counts in float32: exact below 2**24 elements per call
MAX_EXACT_COUNT = 1 << 24


def histc(x: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    """``torch.histc(x, bins, min=lo, max=hi)`` for ``x`` within ``[lo, hi]``, bit for bit, faster."""
    out = torch.zeros(bins, dtype=torch.float32)
    add_histc(out, x, lo, hi)
    return out


def add_histc(out: torch.Tensor, x: torch.Tensor, lo: float, hi: float) -> None:
    """``out += torch.histc(x, out.numel(), min=lo, max=hi)`` for ``x`` within ``[lo, hi]``, faster.

    Adding the counts to a float32 ``out`` rounds exactly as adding torch.histc's float32
    counts does. :class:`LinearBinning` counts where it applies, else torch.histc does.
    """
    bins = out.numel()
    binning = None
    if x.numel() < MAX_EXACT_COUNT and x.dtype == torch.float32 and x.device.type == "cpu":
        binning = LinearBinning.make(bins, lo, hi)
    if binning is not None and out.dtype == torch.float32 and out.device.type == "cpu":
        binning.count_into(x, out, accumulate=True)
    else:
        out += torch.histc(x, bins, min=lo, max=hi).to(out)


class LinearBinning:
    """torch.histc's binning of float32 values into ``bins`` equal bins over ``[lo, hi]``.

    torch.histc builds ``linspace(lo, hi, bins + 1)`` edges, whose first and last are ``lo`` and
    ``hi`` themselves for float32 values, and bins each element by
    ``int64((x - lo) * bins / (hi - lo))`` in float32 scalar code (6-7 ns an element), moving
    what lands on the last edge into the last bin. The same float32 steps run here in the
    native kernel (:mod:`_quantplug.observers.kernels`) or else as vectorised tensor operations,
    a clamp for the last edge (no quotient exceeds ``bins`` when ``x <= hi``) and a
    ``bincount``. Counts are exact integers either way, so adding them to a float32 histogram
    rounds exactly as adding torch.histc's float32 counts does (both are exact below 2**24).

    One instance serves every batch binned over the same range (an observer's range stops
    growing early in calibration); the torch path makes its operands into 0-dim tensors once,
    which torch uses directly where it would wrap a Python number into a new tensor per call.
    """

    __slots__ = ("_tensors", "bins", "divisor", "hi", "lo", "scale")

    def __init__(self, bins: int, lo: float, hi: float, divisor: float, scale: int | None) -> None:
        self.bins, self.lo, self.hi = bins, lo, hi
        self.divisor = divisor
        self.scale = scale
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None  # (lo, divisor), made on first use

    @classmethod
    def make(cls, bins: int, lo: float, hi: float) -> LinearBinning | None:
        """The binning of ``[lo, hi]``, or None where it would not match torch.histc bit for bit.

        A histogram observer's first batch makes the same choice in C (``linear_binning`` in
        ``_histogram_kernels.c``, :func:`~_quantplug.observers.kernels.start_histogram`): change
        both together (tests/core/test_histogram_kernels.py compares them)."""
        if not lo < hi or max(-lo, hi, (hi - lo) * bins) > _FLOAT32_MAX:
            return None  # empty, or (x - lo) * bins could overflow
        if float32(lo) != lo or float32(hi) != hi:
            return None  # then the edges are not lo and hi
        span = float32(hi - lo)  # float32 subtraction, as in the kernel (double rounding is exact here)
        if bins & (bins - 1) == 0 and span / bins >= _FLOAT32_TINY:
            # a * 2**k / span == a / (span / 2**k) exactly: both scalings by 2**k are exact here
            return cls(bins, lo, hi, span / bins, None)
        return cls(bins, lo, hi, span, bins)

    def counts(self, x: torch.Tensor) -> torch.Tensor:
        """int64 counts of float32 CPU ``x`` (within ``[lo, hi]``, fewer than 2**24 elements)."""
        if self._tensors is None:
            self._tensors = (
                torch.scalar_tensor(self.lo, dtype=torch.float32),
                torch.scalar_tensor(self.divisor, dtype=torch.float32),
            )
        lo, divisor = self._tensors
        t = torch.sub(x.reshape(-1), lo)
        if self.scale is not None:
            t.mul_(self.scale)
        t.div_(divisor).clamp_max_(float(self.bins - 1))
        return torch.bincount(t.to(torch.int32), minlength=self.bins)

    def count_into(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        accumulate: bool = False,
        checked: bool = False,
        extremes: tuple[float, float] | None = None,
    ) -> None:
        """Set (or add to) float32 CPU ``out`` the counts of ``x``: the native kernel, else
        :meth:`counts`. ``checked``, ``extremes``: as :func:`_quantplug.observers.kernels.bin_counts`'s."""
        scale = 0.0 if self.scale is None else float(self.scale)
        if kernels.bin_counts(x, self.lo, scale, self.divisor, self.bins, out, accumulate, checked, extremes):
            return
        if accumulate:
            out.add_(self.counts(x))
        else:
            out.copy_(self.counts(x))


_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 2.0**-126  # the smallest normal float32


def float32(value: float) -> float:
    """``value`` rounded to float32, as torch does when comparing a float32 tensor to a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]
