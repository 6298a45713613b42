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

:func:`accelerate` swaps the class of an instance of exactly one of those classes for a subclass
(:mod:`_quantplug.peers.torchao_observer_classes`) that overrides only the hot methods and
produces bit-identical state and qparams: the same float32 operations in the same order, with
loop-invariant work hoisted; where a torch kernel is replaced, the replacement computes the same
function (``histc``'s binning: :mod:`_quantplug.observers.binning`; exact min/max reductions). Any
case off the common path (non-float32 or non-CPU tensors, inf/NaN, a state of unexpected shape,
more than 2**24 elements) calls torchao's own method. Subclasses of torchao's observers are left
alone: they may override what we would skip. On a torchao version the classes were not verified
on (:mod:`_quantplug.peers.versions`) nothing is swapped: torchao's own classes run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from _quantplug.observers.binning import MAX_EXACT_COUNT as MAX_EXACT_COUNT  # here since 0.1.0
from _quantplug.observers.binning import LinearBinning as LinearBinning
from _quantplug.observers.binning import add_histc as add_histc
from _quantplug.observers.binning import float32 as float32
from _quantplug.observers.binning import histc as histc
from _quantplug.observers.copies import fresh_copy as fresh_copy
from _quantplug.peers.versions import verified

_TORCHAO_OBSERVERS = "torchao.quantization.pt2e.observer"


def accelerate(obs: nn.Module) -> nn.Module:
    """Swap ``obs`` to its faster bit-identical class if it is exactly a known torchao observer."""
    return accelerator()(obs)


def accelerator() -> Callable[[nn.Module], nn.Module]:
    """:func:`accelerate`, with its checks of what is loaded and verified made once, for a
    caller swapping many observers (prepare: one per sharing group)."""
    if _TORCHAO_OBSERVERS not in sys.modules or not verified("torchao_observers"):
        return _unchanged  # not one of torchao's observers, or a torchao they were not checked against
    from _quantplug.peers.torchao_observer_classes import ACCELERATED

    def swap(obs: nn.Module) -> nn.Module:
        fast = ACCELERATED.get(type(obs))
        if fast is not None:
            obs.__class__ = fast
        return obs

    return swap


def _unchanged(obs: nn.Module) -> nn.Module:
    return obs


def calculate_qparams_many(observers: Sequence[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[obs.calculate_qparams() for obs in observers]``, with the same results, faster.

    Converting a model computes the qparams of hundreds of histogram observers; each one's
    clipping search costs a few dozen small tensor operations, mostly dispatch overhead. The
    accelerated torchao ``HistogramObserver`` instances are searched together, each round's
    candidate ranges of all of them evaluated in one batched computation (see
    ``torchao_observer_classes.search_ranges``; about 3x faster than one at a time for the 513 of a
    128-block decoder); accelerated ``PerChannelMinMaxObserver`` instances with the same
    settings share one computation (``torchao_observer_classes.per_channel_qparams``); any other observer
    gets its own ``calculate_qparams()``.
    """
    results: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(observers)
    if _TORCHAO_OBSERVERS in sys.modules and verified("torchao_observers"):  # else none is accelerated
        from _quantplug.peers import torchao_observer_classes as torchao_fast

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


def observe_constant(obs: nn.Module, value: torch.Tensor) -> bool:
    """``obs(value)`` done faster for an accelerated ``PerChannelMinMaxObserver`` on its common
    path (``torchao_observer_classes.observe_constant``), or False, having done nothing."""
    if _TORCHAO_OBSERVERS not in sys.modules or not verified("torchao_observers"):
        return False  # none is accelerated
    from _quantplug.peers import torchao_observer_classes as torchao_fast

    return bool(torchao_fast.observe_constant(obs, value))


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
