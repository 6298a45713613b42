"""Batches observed recently, so that observing the very same values again costs no pass over them.

A sharing group observes every tensor of the group with one observer, and many of those tensors
are views of each other: a linear layer's output, the heads ``split`` cuts from it, their
``reshape`` and ``transpose`` (a decoder block's q/k/v: 11 calls, 7 of them over values the
group saw a few calls before); and a tensor read by an op with its own input grid is observed by
that edge's observer too, right after its producer's. Each call must still count as a call (a
histogram adds its counts again, a moving average takes another step), so the result is
unchanged; but a view that covers exactly the memory of an earlier call holds exactly its
values, so that call's statistics (extremes, histogram counts) stand for it, and the pass over
the values is skipped.

"The very same values" is decided without reading them: the same live storage (a weak reference
to it: while it lives, its memory holds no other tensor), the same first address, the same
element type, the same addresses (:func:`layout`: sizes and strides up to the order and merging
of dimensions), and the same version counter value (views share it with their base, and every
in-place write through any of them bumps it). Only CPU tensors (parameters included) outside
inference mode (whose tensors have no version counter) are matched, and parameters only outside
autograd (:func:`probe`).

Two kinds of memory: each observer's own (:func:`recall` / :func:`remember`, in the instance
``__dict__``: never copied or pickled), for statistics that depend on the observer (a histogram's
counts over its range), and one shared by every observer of the process for a batch's extremes,
which depend on the values alone (:data:`EXTREMES`). The first keeps the :data:`KEPT` most recent
batches whose storage still lives, the second the :data:`KEPT_EXTREMES` most recent batches (a
table keyed by where the values are: one look-up per call, which range observers make hundreds
of times per forward), both with weak references only (a histogram observer also keeps the counts
of those batches: one histogram each).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

_enabled = True
#: tensor classes whose memory is their values (subclasses may have none: fake, functional...)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Observe every batch in full, as if none had been seen (to compare the two: same results)."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved


#: the observer attribute holding its recent batches
ATTR = "_quantplug_seen_batches"
#: batches remembered: a q/k/v group re-reads a head three calls after seeing it
KEPT = 4

Layout = tuple[tuple[int, int], ...]


def layout(x: torch.Tensor) -> Layout:
    """The addresses ``x`` covers, relative to ``x.data_ptr()``, as ``(stride, size)`` pairs:
    dimensions of size 1 dropped, sorted by stride, neighbours merged where one continues the
    other. Equal layouts cover the same addresses (each as many times): ``x`` and a reshape,
    transpose or permutation of it that needs no copy have the same one."""
    if x.is_contiguous():
        return ((1, x.numel()),)
    key = (x.shape, x.stride())
    found = _LAYOUTS.get(key)
    if found is None:
        if len(_LAYOUTS) >= _LAYOUTS_KEPT:
            _LAYOUTS.clear()
        found = _LAYOUTS[key] = _merged(*key)
    return found


def _merged(shape: tuple[int, ...], strides: tuple[int, ...]) -> Layout:
    merged: list[tuple[int, int]] = []
    for stride, size in sorted((st, sz) for st, sz in zip(strides, shape) if sz != 1):
        if merged and merged[-1][0] * merged[-1][1] == stride:
            merged[-1] = (merged[-1][0], merged[-1][1] * size)
        else:
            merged.append((stride, size))
    return tuple(merged)


#: layouts of the non-contiguous shapes and strides met (a model has a few dozen)
_LAYOUTS: dict[tuple[Any, ...], Layout] = {}
_LAYOUTS_KEPT = 4096


def dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill the addresses from ``x.data_ptr()`` on, one each (a
    permutation of a contiguous tensor: that memory holds exactly its values)."""
    return x.is_contiguous() or layout(x) == ((1, x.numel()),)


#: where a batch's values are: ``(address, numel, dtype, layout, version)``
Key = tuple[int, int, torch.dtype, Layout, int]


class Batch:
    """Where a batch's values are (module docstring); ``dense``: as :func:`dense` says of it."""

    __slots__ = ("address", "dense", "dtype", "layout", "numel", "storage", "version")

    def __init__(self, x: torch.Tensor) -> None:
        self.address = x.data_ptr()
        self.numel = x.numel()
        self.dtype = x.dtype
        self.layout = layout(x)
        self.dense = self.layout == ((1, self.numel),)
        self.storage = weakref.ref(x.untyped_storage())
        self.version = x._version

    @property
    def key(self) -> Key:
        return (self.address, self.numel, self.dtype, self.layout, self.version)

    def holds(self, other: Batch) -> bool:
        """Whether ``other`` (a batch being observed) holds exactly this batch's values, unchanged."""
        if (
            other.address != self.address
            or other.numel != self.numel
            or other.dtype != self.dtype
            or other.version != self.version
            or other.layout != self.layout
        ):
            return False
        storage = self.storage()
        return storage is not None and storage is other.storage()


def probe(x: torch.Tensor) -> Batch | None:
    """``x`` as a :class:`Batch` to look up and record, or None where it cannot be matched.

    A tensor that requires grad (a parameter) is matched only outside autograd (calibration under
    ``torch.no_grad()``): training writes parameters between batches, and a write through
    ``param.data`` bumps no version counter the parameter shares.
    """
    return Batch(x) if matchable(x) else None


def matchable(x: torch.Tensor) -> bool:
    """Whether ``x``'s values may be matched by where they are (:func:`probe`'s conditions)."""
    return (
        _enabled
        and type(x) in _PLAIN
        and x.is_cpu
        and not x.is_inference()
        and not (x.requires_grad and torch.is_grad_enabled())
    )


#: recent batches, newest first, each with what was made of its values
Kept = list[tuple[Batch, Any]]


def _find(kept: Kept | None, batch: Batch) -> Any:
    for old, stats in kept or ():
        if old.holds(batch):
            return stats
    return None


def _keep(kept: Kept | None, batch: Batch, stats: Any) -> Kept:
    alive = [entry for entry in kept or () if entry[0].storage() is not None]
    return [(batch, stats), *alive[: KEPT - 1]]


def recall(observer: Any, batch: Batch | None) -> Any:
    """The stats ``observer`` recorded for a recent batch holding ``batch``'s values, or None."""
    return None if batch is None else _find(observer.__dict__.get(ATTR), batch)


def remember(observer: Any, batch: Batch | None, stats: Any) -> None:
    """Record ``stats`` as ``observer``'s summary of ``batch`` (from :func:`probe`)."""
    if batch is not None:
        observer.__dict__[ATTR] = _keep(observer.__dict__.get(ATTR), batch, stats)


def forget(observer: Any) -> None:
    """Drop ``observer``'s records (a copy starts afresh)."""
    observer.__dict__.pop(ATTR, None)


#: batches whose extremes some observer computed, oldest first: where their values are ->
#: ``(storage, (min, max))``, a weak reference to the batch's storage (a key whose storage died,
#: or now is another one at the same address, holds nothing) and the extremes as Python floats,
#: the same for every observer (each applies its own NaN/inf policy to them)
EXTREMES: dict[Key, tuple[weakref.ref[torch.UntypedStorage], tuple[float, float]]] = {}
#: batches whose extremes are kept: dead ones take a place until pushed out, and a q/k/v group's
#: views meet other observers' batches (the scores, the softmax) between its calls
KEPT_EXTREMES = 8


def recall_extremes(batch: Batch | None) -> tuple[float, float] | None:
    storage = None if batch is None else batch.storage()
    return None if batch is None or storage is None else known_extremes(batch.key, storage)


def known_extremes(key: Key, storage: torch.UntypedStorage) -> tuple[float, float] | None:
    """:func:`recall_extremes` of a batch known by its key and storage (no :class:`Batch` built:
    the range observers' common case, :func:`_quantplug.observers.minmax.plain_extremes`)."""
    found = EXTREMES.get(key)
    return found[1] if found is not None and found[0]() is storage else None


def remember_extremes(batch: Batch | None, extremes: tuple[float, float]) -> None:
    """Record ``batch``'s extremes for every observer; not where one is zero: which zero (+0 or
    -0) a reduction returns depends on the order it meets them, hence on the view it reads."""
    if batch is not None and extremes[0] != 0.0 and extremes[1] != 0.0:
        storage = batch.storage()
        if storage is not None:
            keep_extremes(batch.key, storage, extremes)


def keep_extremes(key: Key, storage: torch.UntypedStorage, extremes: tuple[float, float]) -> None:
    """Record the extremes (neither of them zero: :func:`remember_extremes`) of the batch ``key``
    names, whose storage is ``storage``."""
    EXTREMES.pop(key, None)  # a key whose storage died, taken by a new one: the newest again
    EXTREMES[key] = (weakref.ref(storage), extremes)
    if len(EXTREMES) > KEPT_EXTREMES:
        del EXTREMES[next(iter(EXTREMES))]
