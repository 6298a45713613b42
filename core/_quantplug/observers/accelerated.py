"""Faster, bit-identical stand-ins for the torchao observers that foreign quantizer configs bring.

A PT2E quantizer written for torchao (``X86InductorQuantizer``, ``XNNPACKQuantizer``, ExecuTorch's
``QnnQuantizer``) names torchao's observer classes in its specs; ``prepare`` builds them exactly as
torchao does, so that ``convert`` gives torchao's qparams. Two of them dominate calibration and
convert time for reasons unrelated to the statistics they keep:

* ``HistogramObserver``: ``torch.histc`` bins one element per 6-7 ns in scalar code, a few
  ``.item()``-style host syncs per batch, and a clipping search that walks histogram bins in a
  Python loop indexing a tensor one element at a time.
* ``PerChannelMinMaxObserver``: ``torch.aminmax(y, dim=1)`` is about 15x slower than
  ``amin`` plus ``amax`` on the same rows.

``accelerate(obs)`` swaps the class of an instance of exactly one of those classes for a subclass
defined here. The subclasses override only the hot methods and produce bit-identical state and
qparams: the same float32 operations in the same order, with loop-invariant work hoisted; where a
torch kernel is replaced, the replacement computes the same function (``histc``'s linear
interpolation binning, emulated with the same float32 arithmetic; exact min/max reductions). Any
case off the common path (non-float32 or non-CPU tensors, inf/NaN, a state of unexpected shape,
more than 2**24 elements) calls torchao's own method. Subclasses of torchao's observers are left
alone: they may override what we would skip.
"""

from __future__ import annotations

import copy
import struct
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from _quantplug.observers import kernels

_TORCHAO_OBSERVERS = "torchao.quantization.pt2e.observer"

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
        """The binning of ``[lo, hi]``, or None where it would not match torch.histc bit for bit."""
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

    def count_into(self, x: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
        """Set (or add to) float32 CPU ``out`` the counts of ``x``: the native kernel, else :meth:`counts`."""
        scale = 0.0 if self.scale is None else float(self.scale)
        if kernels.bin_counts(x, self.lo, scale, self.divisor, self.bins, out, accumulate):
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


def accelerate(obs: nn.Module) -> nn.Module:
    """Swap ``obs`` to its faster bit-identical class if it is exactly a known torchao observer."""
    if _TORCHAO_OBSERVERS not in sys.modules:  # then obs cannot be one of its observers
        return obs
    from _quantplug.peers.torchao_observers import ACCELERATED

    fast = ACCELERATED.get(type(obs))
    if fast is not None:
        obs.__class__ = fast
    return obs


def calculate_qparams_many(observers: Sequence[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[obs.calculate_qparams() for obs in observers]``, with the same results, faster.

    Converting a model computes the qparams of hundreds of histogram observers; each one's
    clipping search costs a few dozen small tensor operations, mostly dispatch overhead. The
    accelerated torchao ``HistogramObserver`` instances are searched together, each round's
    candidate ranges of all of them evaluated in one batched computation (see
    ``torchao_fast.search_ranges``; about 3x faster than one at a time for the 513 of a
    128-block decoder); accelerated ``PerChannelMinMaxObserver`` instances with the same
    settings share one computation (``torchao_fast.per_channel_qparams``); any other observer
    gets its own ``calculate_qparams()``.
    """
    results: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(observers)
    if _TORCHAO_OBSERVERS in sys.modules:  # else none of them can be a torchao observer
        from _quantplug.peers import torchao_observers as torchao_fast

        for cls, batched in (
            (torchao_fast.HistogramObserver, torchao_fast.histogram_qparams),
            (torchao_fast.PerChannelMinMaxObserver, torchao_fast.per_channel_qparams),
        ):
            batch = [i for i, obs in enumerate(observers) if type(obs) is cls]
            chosen: list[Any] = [observers[i] for i in batch]
            for i, qparams in zip(batch, batched(chosen) if chosen else []):
                results[i] = qparams
    modules: Sequence[Any] = observers  # calculate_qparams is not an nn.Module attribute
    return [obs.calculate_qparams() if r is None else r for obs, r in zip(modules, results)]


_MODULE_STATE = frozenset(nn.Module().__dict__)
_IMMUTABLE = (
    int,
    float,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.qscheme,
    torch.device,
    tuple,
    frozenset,
    LinearBinning,  # never changed once made
)


def fresh_copy(obs: nn.Module) -> nn.Module:
    """An independent copy of an observer, to feed without touching the prepared module.

    Observers keep their statistics in buffers, so a leaf observer whose other attributes are
    immutable values is copied by cloning its buffers (about 15x cheaper than ``deepcopy``);
    anything else is deep-copied.
    """
    simple = not obs._modules and not obs._parameters
    if simple:
        simple = all(isinstance(v, _IMMUTABLE) for k, v in obs.__dict__.items() if k not in _MODULE_STATE)
    if not simple:
        return copy.deepcopy(obs)
    new = object.__new__(type(obs))
    new.__dict__ = obs.__dict__.copy()
    new._buffers = {k: None if v is None else v.clone() for k, v in obs._buffers.items()}
    new._non_persistent_buffers_set = set(obs._non_persistent_buffers_set)
    new._parameters = {}
    new._modules = {}
    return new


_PURE_TORCHAO_CTORS = frozenset(
    {
        "MinMaxObserver",
        "PerChannelMinMaxObserver",
        "HistogramObserver",
        "MovingAverageMinMaxObserver",
        "MovingAveragePerChannelMinMaxObserver",
    }
)


def clonable(obs: nn.Module) -> bool:
    """Whether a freshly built ``obs`` may stand for more of its kind (``fresh_copy`` of it).

    True for torchao's plain observer classes (their constructors only store their arguments and
    register empty statistics), whose constructors cost about 70 us each against 15 us for a copy.
    """
    cls = type(obs)
    return cls.__module__ == _TORCHAO_OBSERVERS and cls.__name__ in _PURE_TORCHAO_CTORS
