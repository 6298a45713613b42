"""Combining the statistics of several observers of the same tensor (processes, shards).

Calibration split over N processes leaves N observers per group, each having seen part of the
data. ``merge_observers(target, others)`` folds ``others``' statistics into ``target`` so that
``target`` stands for all the batches. Each kind defines what that means:

* **min/max** (global, per channel, per block): the minimum of the minima and the maximum of the
  maxima. Exact: bit for bit the state of one observer that saw the union of the batches, in
  any order and any split. The merge is associative and commutative, and an observer that saw
  nothing (``min=+inf, max=-inf`` or an empty per-channel state) is its identity.
* **moving averages**: the batch-weighted mean of the processes' averages (``num_batches``
  weights; torchao's observers, which keep no count, weigh every process that saw data
  equally), summed in float64 in a canonical order and rounded once to float32. One process's
  exponential average depends on batch order, so no split reproduces it; the weighted mean is
  the estimate of "a typical batch's extremes" that does not depend on which process saw which
  batch. Commutative; an observer that saw nothing is its identity.
* **histograms**: the processes first agree a common range (the union of their ranges), each
  histogram is re-binned exactly onto it (piecewise-uniform bins, see
  :func:`~_quantplug.observers.rebin.rebin_histogram`), and the re-binned histograms are
  summed in float64 in a canonical (sorted) order, so the result is the same whichever process
  saw which batch and in which order the states are listed. One process re-bins its histogram
  each time its range grows, so its histogram depends on batch order too; the merged one is
  re-binned once per process. The clipping range chosen from either differs by a fraction of a
  bin (``tests/distributed`` bounds the SQNR difference).
* **fixed, derived, dynamic** observers have no statistics: merging is a no-op.
* **fake quantize** merges the observer it wraps.

The protocol is one method, ``merge_(others)``, defined on :class:`ObserverBase` (where
observers without statistics inherit a no-op and the rest must define it). A plugin's own
observer implements it to take part in ``quantplug.distributed.sync_observers``; torchao's
observer classes, which have no such method, are merged here by class.

NaN/inf bookkeeping (``nonfinite_ignored``, ``infinities_masked``, the mask ends a grid is
widened for) is merged for every kind: counts add up, mask ends unite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from _quantplug.errors import ObserverMergeError
from _quantplug.observers.nonfinite import COUNT_ATTR, MASK_ENDS_ATTR, MASKED_ATTR
from _quantplug.observers.rebin import rebin_histogram

_TORCHAO_MODULES = ("torchao.quantization.pt2e.observer", "torchao.quantization.pt2e.fake_quantize")


def merge_observers(target: nn.Module, others: Sequence[nn.Module]) -> None:
    """Fold the statistics of ``others`` (observers of the same kind and grid) into ``target``."""
    merge_state(target, others)
    merge_nonfinite_counts(target, others)


def merge_state(target: nn.Module, others: Sequence[nn.Module]) -> None:
    """The statistics part of :func:`merge_observers`: what a wrapper calls for its inner observer."""
    others = list(others)
    for other in others:
        if type(other) is not type(target):
            raise ObserverMergeError(
                f"cannot merge a {type(other).__name__} into a {type(target).__name__}: observers merge "
                "only with observers of the same class (were the programs prepared alike?)"
            )
    method = getattr(target, "merge_", None)
    if callable(method):
        method(others)
    else:
        _foreign_merge(target)(target, others)


def merge_nonfinite_counts(target: nn.Module, others: Sequence[nn.Module]) -> None:
    """Add up the NaN/inf counters and unite the mask ends of every module of the observers."""
    for mine, *theirs in zip(target.modules(), *(o.modules() for o in others)):
        for attr in (COUNT_ATTR, MASKED_ATTR):
            values = [vars(m).get(attr, 0) for m in (mine, *theirs)]
            if any(values):
                setattr(mine, attr, sum(int(v) for v in values))
        ends = set(vars(mine).get(MASK_ENDS_ATTR, ()))
        for m in theirs:
            ends |= set(vars(m).get(MASK_ENDS_ATTR, ()))
        if ends:
            setattr(mine, MASK_ENDS_ATTR, frozenset(ends))


# ------------------------------------------------------------------------------------------------
# the merge rules, on tensors
# ------------------------------------------------------------------------------------------------


def merged_extremes(
    states: Sequence[tuple[torch.Tensor, torch.Tensor]], what: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Elementwise min of the minima and max of the maxima; None when every state is empty.

    Empty states (no element: a per-channel observer that saw nothing) are skipped; per-tensor
    ``(+inf, -inf)`` states need no skipping, they are the identity of min/max.
    """
    present = [(lo, hi) for lo, hi in states if lo.numel() > 0]
    if not present:
        return None
    shapes = {tuple(lo.shape) for lo, _ in present}
    if len(shapes) > 1:
        raise ObserverMergeError(
            f"cannot merge {what}: its states have different shapes {sorted(shapes)} (one observer "
            "serves one tensor; were the programs prepared alike?)"
        )
    lo, hi = present[0][0].clone(), present[0][1].clone()
    for other_lo, other_hi in present[1:]:
        torch.minimum(lo, other_lo.to(lo), out=lo)
        torch.maximum(hi, other_hi.to(hi), out=hi)
    return lo, hi


def canonical_sum(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    """Elementwise float64 sum of ``terms`` in sorted order: the same bits for any order of terms."""
    stacked = torch.stack([t.to(torch.float64) for t in terms])
    return torch.sort(stacked, dim=0).values.sum(dim=0)


def merged_average(
    values: Sequence[torch.Tensor], weights: Sequence[float], what: str
) -> torch.Tensor | None:
    """The ``weights``-weighted mean of ``values`` (states with zero weight or no element are
    left out), in the dtype of the first; None when no state has weight."""
    kept = [(v, float(w)) for v, w in zip(values, weights) if w > 0 and v.numel() > 0]
    if not kept:
        return None
    shapes = {tuple(v.shape) for v, _ in kept}
    if len(shapes) > 1:
        raise ObserverMergeError(f"cannot merge {what}: its states have different shapes {sorted(shapes)}")
    total = sum(w for _, w in kept)
    mean = canonical_sum([v.to(torch.float64) * w for v, w in kept]) / total
    return mean.to(kept[0][0].dtype)


def merged_histogram(
    states: Sequence[tuple[torch.Tensor, float, float]], what: str
) -> tuple[torch.Tensor, float, float] | None:
    """Histograms over ``[lo, hi]`` re-binned onto the union of their ranges and summed.

    States with an empty range (``lo > hi``: nothing seen) are left out; None if all are. A state
    already on the common range is used as it is, so merging one state is the identity.
    """
    present = [(h, lo, hi) for h, lo, hi in states if lo <= hi]
    if not present:
        return None
    bins = {h.numel() for h, _, _ in present}
    if len(bins) > 1:
        raise ObserverMergeError(
            f"cannot merge {what}: its histograms have different bin counts {sorted(bins)}"
        )
    lo = min(s[1] for s in present)
    hi = max(s[2] for s in present)
    rebinned = [
        h.to(torch.float64)
        if (h_lo, h_hi) == (lo, hi)
        else rebin_histogram(h.to(torch.float64), h_lo, h_hi, lo, hi)
        for h, h_lo, h_hi in present
    ]
    return canonical_sum(rebinned).to(present[0][0].dtype), lo, hi


# ------------------------------------------------------------------------------------------------
# torchao's observers (no merge_ method of their own)
# ------------------------------------------------------------------------------------------------


def _fill_extremes(target: Any, lo: torch.Tensor, hi: torch.Tensor) -> None:
    if target.min_val.shape == lo.shape:
        target.min_val.copy_(lo)
        target.max_val.copy_(hi)
    else:  # a per-channel state still empty on this side: take the shape of the merged one
        target.min_val.resize_(lo.shape).copy_(lo)
        target.max_val.resize_(hi.shape).copy_(hi)


def _ao_minmax(target: Any, others: Sequence[Any]) -> None:
    found = merged_extremes([(o.min_val, o.max_val) for o in (target, *others)], type(target).__name__)
    if found is not None:
        _fill_extremes(target, *found)


def _saw_data(obs: Any) -> bool:
    return obs.min_val.numel() > 0 and bool((obs.min_val <= obs.max_val).all())


def _ao_moving_average(target: Any, others: Sequence[Any]) -> None:
    states = [o for o in (target, *others) if _saw_data(o)]
    what = type(target).__name__
    lo = merged_average([o.min_val for o in states], [1.0] * len(states), what)
    hi = merged_average([o.max_val for o in states], [1.0] * len(states), what)
    if lo is not None and hi is not None:
        _fill_extremes(target, lo, hi)


def _ao_histogram(target: Any, others: Sequence[Any]) -> None:
    states = [(o.histogram, float(o.min_val), float(o.max_val)) for o in (target, *others)]
    found = merged_histogram(states, type(target).__name__)
    if found is not None:
        hist, lo, hi = found
        target.histogram.copy_(hist)
        target.min_val.fill_(lo)
        target.max_val.fill_(hi)


def _ao_fake_quantize(target: Any, others: Sequence[Any]) -> None:
    merge_state(target.activation_post_process, [o.activation_post_process for o in others])
    if bool(target.observer_enabled[0]) and _saw_data(target.activation_post_process):
        scale, zero_point = target.activation_post_process.calculate_qparams()
        target.scale.resize_(scale.shape).copy_(scale)
        target.zero_point.resize_(zero_point.shape).copy_(zero_point)


def _no_state(target: Any, others: Sequence[Any]) -> None:
    pass


#: torchao class name -> its merge rule (the most derived class in a class's MRO wins)
_FOREIGN: dict[str, Callable[[Any, Sequence[Any]], None]] = {
    "MinMaxObserver": _ao_minmax,
    "PerChannelMinMaxObserver": _ao_minmax,
    "MovingAverageMinMaxObserver": _ao_moving_average,
    "MovingAveragePerChannelMinMaxObserver": _ao_moving_average,
    "HistogramObserver": _ao_histogram,
    "FakeQuantize": _ao_fake_quantize,
    "FixedQParamsObserver": _no_state,
    "FixedQParamsFakeQuantize": _no_state,
    "PlaceholderObserver": _no_state,
    "NoopObserver": _no_state,
}


def _foreign_merge(target: nn.Module) -> Callable[[Any, Sequence[Any]], None]:
    for cls in type(target).__mro__:
        if cls.__module__ in _TORCHAO_MODULES and cls.__name__ in _FOREIGN:
            return _FOREIGN[cls.__name__]
    raise ObserverMergeError(
        f"observer class {type(target).__qualname__} (module {type(target).__module__}) defines no "
        "merge_(others) method, so its statistics cannot be combined across processes; implement "
        "merge_ (see 'Observers that merge' in docs/writing-a-backend.md)"
    )


def has_statistics(obs: nn.Module) -> bool:
    """False for observers whose merge is a no-op (fixed, derived, dynamic, placeholder)."""
    if getattr(obs, "needs_data", True) is False:
        return False
    for cls in type(obs).__mro__:
        if cls.__module__ in _TORCHAO_MODULES and cls.__name__ in _FOREIGN:
            return _FOREIGN[cls.__name__] is not _no_state
    return True
