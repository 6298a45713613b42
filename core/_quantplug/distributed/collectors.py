"""The accuracy algorithms' collectors in ``sync_observers``: gathered from every rank, merged.

After the observers, three exchanges over the group (gathered, never reduced by the backend):

1. a header per rank: when its collectors were last merged, the batches fed to them since, the
   bytes of each collector's state, the sizes of the batches it stored for sequential layer inputs;
2. the collectors' states, in rounds of at most :data:`MERGE_ROUND_BYTES` per rank (one collector
   alone when it is larger): each round is gathered, every collector of it merged in rank order
   (:func:`_quantplug.algorithms.merge.merge_collector`) and the gathered states dropped;
3. the stored batches the merged store keeps (:func:`_quantplug.algorithms.sequential.merged_store`),
   each sent by the rank that has it; and likewise the algorithm guard's held-out batches
   (``Algorithms([...], held_out=...)``) when the ranks were given different ones, merged under the
   guard's own caps, so every rank's guard judges on the same batches (ranks given the same
   batches, as ``quantize --nproc`` gives them, keep them).

Memory beyond the collectors themselves: N states of one round, and the merged store (within its
caps); no rank ever holds the data set. Collectors merge once: they are sums and samples, and a
second sync after more data would count the merged part again, so it is refused (a second sync
with no new data leaves them as they are).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from _quantplug.algorithms.guard import GUARD_BATCHES, GUARD_BYTES
from _quantplug.algorithms.merge import fed_collectors, merge_collector, on_cpu, state_bytes
from _quantplug.algorithms.sequential import batch_bytes, merged_store
from _quantplug.algorithms.taps import taps
from _quantplug.distributed.fingerprint import tensor_digest
from _quantplug.errors import DistributedError
from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY

#: at most this many bytes of collector state per rank in one gathering round
MERGE_ROUND_BYTES = 64 * 2**20


@dataclass(frozen=True)
class CollectorSync:
    """What the collectors' part of a sync did."""

    collectors: int
    stored_batches: int
    sent_bytes: int


def rounds(sizes: list[int], budget: int) -> list[list[int]]:
    """Consecutive indices of ``sizes`` grouped so that each group's sizes sum to at most
    ``budget`` (a single larger one forms a group of its own)."""
    found: list[list[int]] = []
    current: list[int] = []
    total = 0
    for index, size in enumerate(sizes):
        if current and total + size > budget:
            found.append(current)
            current, total = [], 0
        current.append(index)
        total += size
    if current:
        found.append(current)
    return found


def _fed_batches(prepared: nn.Module) -> int:
    found, store = taps(prepared)
    return sum(t.batches for t in found) + (store.seen if store is not None else 0)


def _check_sync_points(headers: list[dict[str, Any]]) -> bool:
    """Whether the collectors are merged already on every rank with no data since (nothing to do);
    raises when some rank fed them since, or when ranks disagree on the last sync."""
    points = [h["synced_at"] for h in headers]
    if all(p is None for p in points):
        return False
    fresh = [r for r, h in enumerate(headers) if h["synced_at"] != h["fed"]]
    if fresh or any(p is None for p in points):
        raise DistributedError(
            "sync_observers: the accuracy algorithms' collectors were merged by an earlier sync and "
            f"rank(s) {fresh or [r for r, p in enumerate(points) if p is None]} fed them more batches "
            "since; collectors (sums, samples) merge once, after calibration: calibrate on every batch, "
            "then call sync_observers"
        )
    return True


def sync_collectors(prepared: nn.Module, group: Any, world: int) -> CollectorSync:
    """Merge every rank's fed collectors and stored batches into every rank's (module docstring).

    The caller (``sync_observers``) has checked that the ranks prepared the same program and that
    every fed collector can merge (:func:`_quantplug.algorithms.merge.check_mergeable`)."""
    import torch.distributed as dist

    run = getattr(prepared, "meta", {}).get(RUN_KEY)
    fed = fed_collectors(prepared)
    _, store = taps(prepared)
    if run is None or (not fed and store is None):
        return CollectorSync(0, 0, 0)
    states = [f.collector.state() for f in fed]  # references; each travels (via the CPU) in its round
    split_held = run.split is not None and run.held_out is run.split.batches  # the default split's
    header = {
        "synced_at": run.synced_at,
        "fed": _fed_batches(prepared),
        "sizes": [state_bytes(s) for s in states],
        "stored": [batch_bytes(b) for b in store.batches] if store is not None else [],
        "stored_at": list(store.positions) if store is not None else [],
        "held_at": list(run.split.positions) if split_held else None,
        "seen": store.seen if store is not None else 0,
        "held_out": None if run.held_out is None else [batch_bytes(b) for b in run.held_out],
        "held_out_digest": None if run.held_out is None else batches_digest(run.held_out),
    }
    headers: list[Any] = [None] * world
    dist.all_gather_object(headers, header, group=group)
    if _check_sync_points(headers):
        return CollectorSync(0, 0, 0)
    sent = 0
    largest = [max(h["sizes"][i] for h in headers) for i in range(len(fed))]
    for chunk in rounds(largest, MERGE_ROUND_BYTES):
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, [on_cpu(states[i]) for i in chunk], group=group)
        for j, i in enumerate(chunk):
            merge_collector(fed[i], [g[j] for g in gathered])
        sent += sum(header["sizes"][i] for i in chunk)
        del gathered
    del states
    stored = 0
    if store is not None:
        at = [h["stored_at"] for h in headers]
        order = merged_store([h["stored"] for h in headers], store.max_batches, store.max_bytes, at)
        batches, bytes_sent = _merged_batches(store.batches, order, group, world)
        store.replace_(batches, sum(int(h["seen"]) for h in headers), [at[r][i] for r, i in order])
        stored, sent = len(batches), sent + bytes_sent
    if run.held_out is not None and len({h["held_out_digest"] for h in headers}) > 1:
        # each rank its own batches (the same ones everywhere, as the CLI sends, stay as they are)
        held_at = [h["held_at"] for h in headers]
        known = all(a is not None for a in held_at)  # the split's batches: in the data's order
        order = merged_store(
            [h["held_out"] for h in headers], GUARD_BATCHES, GUARD_BYTES, held_at if known else None
        )
        run.held_out, bytes_sent = _merged_batches(run.held_out, order, group, world)
        sent += bytes_sent
    run.synced_at = _fed_batches(prepared)
    return CollectorSync(len(fed), stored, sent)


def batches_digest(batches: list[tuple[Any, ...]]) -> str:
    """A digest of batches' values (tensors by dtype, shape and bytes; others by repr)."""
    parts = [
        [
            f"{v.dtype}{list(v.shape)}:{tensor_digest(v)}" if isinstance(v, torch.Tensor) else repr(v)
            for v in batch
        ]
        for batch in batches
    ]
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def _merged_batches(
    batches: list[tuple[Any, ...]], order: list[tuple[int, int]], group: Any, world: int
) -> tuple[list[tuple[Any, ...]], int]:
    """The batches ``order`` names (``(rank, index)``, :func:`merged_store`), each sent by the rank
    that has it, on this rank's devices; and the bytes this rank sent."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    mine = [on_cpu(batches[i]) for r, i in order if r == rank]
    devices = [t.device if isinstance(t, torch.Tensor) else None for t in batches[0]] if batches else None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    taken = [0] * world
    merged = []
    for r, _ in order:
        merged.append(_on_devices(gathered[r][taken[r]], devices))
        taken[r] += 1
    return merged, sum(batch_bytes(b) for b in mine)


def _on_devices(batch: tuple[Any, ...], devices: list[Any] | None) -> tuple[Any, ...]:
    """A gathered (CPU) batch with its tensors on this rank's devices, position by position."""
    out = []
    for position, value in enumerate(batch):
        device = devices[position] if devices is not None and position < len(devices) else None
        out.append(value.to(device) if isinstance(value, torch.Tensor) and device is not None else value)
    return tuple(out)
