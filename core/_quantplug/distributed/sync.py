"""``sync_observers``: every rank's observers replaced by the merge of all ranks' observers.

Protocol, in three exchanges over the group:

1. arrival, within ``timeout``: a rank that crashed or is stuck makes the others fail with a
   :class:`~_quantplug.errors.DistributedError` naming it (gloo's monitored barrier), instead of
   waiting forever in a collective;
2. a digest of the prepared program's fingerprint (:mod:`quantplug.distributed.fingerprint`);
   when they differ, the fingerprints themselves, and every rank raises the same error naming
   the first difference;
3. the observers' state (buffers and NaN/inf counters, on the CPU), gathered from every rank;
4. with accuracy algorithms, their collectors' states and stored batches
   (:mod:`_quantplug.distributed.collectors`), merged in rank order by each collector's rule.

Each rank then merges the N states of each observer in rank order with the observer's own rule
(:mod:`_quantplug.observers.merge`), so every rank computes the same bits from the same inputs,
and writes the result back into its observer (on its device). Gathering rather than reducing in
the collective keeps the result independent of the backend's reduction order (nccl and gloo
reduce floats in different orders) and lets each kind merge by its own rule; the state is small
(a few numbers per observer, 2048 floats per histogram).

Syncing again later (QAT: after every few steps) is supported: each rank remembers how many
batches the last sync accounted for, and the next one merges only what came since. Histogram
statistics are sums, so they merge once: syncing a histogram observer that saw data since its
last sync is refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from _quantplug.algorithms.merge import check_mergeable
from _quantplug.distributed.collectors import sync_collectors
from _quantplug.distributed.fingerprint import describe_mismatch, digest, fingerprint, mismatch_advice
from _quantplug.errors import DistributedError
from _quantplug.meta import SYNCED_ATTR, observer_children
from _quantplug.observers.copies import fresh_copy
from _quantplug.observers.merge import has_statistics, merge_observers
from _quantplug.observers.nonfinite import COUNT_ATTR, MASK_ENDS_ATTR, MASKED_ATTR

#: on each module holding ``num_batches``: how many batches the last sync accounted for
_COUNTERS = (COUNT_ATTR, MASKED_ATTR, MASK_ENDS_ATTR, SYNCED_ATTR)
DEFAULT_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class SyncResult:
    """What a sync did: observers merged, ranks, bytes of state this rank sent, seconds taken,
    accuracy algorithms' collectors merged and batches in the merged store for sequential inputs."""

    observers: int
    world_size: int
    state_bytes: int
    seconds: float
    collectors: int = 0
    stored_batches: int = 0


def prepared_of(module: nn.Module) -> nn.Module:
    """The prepared program inside a ``DistributedDataParallel`` (or any ``.module`` wrapper)."""
    inner = module
    while not observer_children(inner) and isinstance(wrapped := getattr(inner, "module", None), nn.Module):
        inner = wrapped
    if not observer_children(inner):
        raise DistributedError(
            f"sync_observers needs a module returned by quantplug.prepare (or a DistributedDataParallel "
            f"wrapping one); got a {type(module).__name__} holding no quantplug observers"
        )
    return inner


def named_observers(prepared: nn.Module) -> list[tuple[str, nn.Module]]:
    """The observers of a prepared program, in group order (``activation_post_process_0, 1, ...``)."""
    return observer_children(prepared)


def _comm_device(group: Any) -> torch.device:
    """Where the group's collectives take tensors: the current GPU for nccl, else the CPU."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait_for_everyone(group: Any, timeout: timedelta, device: torch.device) -> None:
    """Every rank arrived, or a DistributedError naming the missing ones after ``timeout``."""
    import torch.distributed as dist

    try:
        if device.type == "cpu" and "gloo" in str(dist.get_backend(group)).lower():
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        else:
            flag = torch.ones(1, device=device)
            work = dist.all_reduce(flag, group=group, async_op=True)
            if work is not None and not work.wait(timeout=timeout):
                raise RuntimeError(f"not all ranks arrived within {timeout}")
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(
            f"sync_observers: not every rank of the group reached it within {timeout} ({first}); a "
            "rank crashed, is still calibrating on more data, or never calls sync_observers. Give "
            "every rank a share of the data (quantplug.distributed.shard) and call sync_observers on "
            "all of them, or raise timeout="
        ) from exc


def _check_same_program(lines: list[str], group: Any, device: torch.device, world: int) -> None:
    import torch.distributed as dist

    mine = torch.frombuffer(bytearray(digest(lines)), dtype=torch.uint8).to(torch.int64).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, lines, group=group)
    raise DistributedError(
        "sync_observers: the ranks prepared different programs, so their observers do not "
        f"correspond ({describe_mismatch(everyone)}); {mismatch_advice(everyone)}"
    )


def _state(obs: nn.Module) -> dict[str, Any]:
    """An observer's statistics as CPU tensors and plain numbers (what other ranks need)."""
    buffers = {path: t.detach().cpu() for path, t in obs.named_buffers() if t is not None}
    counters = {
        path: {attr: vars(m)[attr] for attr in _COUNTERS if attr in vars(m)}
        for path, m in obs.named_modules()
    }
    return {"buffers": buffers, "counters": counters}


def _packed(states: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``states`` with every tensor as (dtype, shape, bytes): pickling a tensor goes through
    torch.save, about 0.2 ms each; bytes pickle at memory speed."""
    return {
        name: {
            "buffers": {
                path: (
                    str(t.dtype).removeprefix("torch."),
                    tuple(t.shape),
                    t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(),
                )
                for path, t in state["buffers"].items()
            },
            "counters": state["counters"],
        }
        for name, state in states.items()
    }


def _unpacked(packed: dict[str, Any]) -> dict[str, dict[str, Any]]:
    def tensor(dtype: str, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
        kind = getattr(torch, dtype)
        if not data:
            return torch.empty(shape, dtype=kind)
        return torch.frombuffer(bytearray(data), dtype=kind).reshape(shape)

    return {
        name: {"buffers": {p: tensor(*v) for p, v in state["buffers"].items()}, "counters": state["counters"]}
        for name, state in packed.items()
    }


def _load_state(obs: nn.Module, state: dict[str, Any], *, device_of: nn.Module | None = None) -> None:
    """Put ``state`` into ``obs`` (buffers may change shape: a per-channel state filled by a merge),
    each buffer on the device of the same buffer of ``device_of`` (default: ``obs`` itself)."""
    modules = dict(obs.named_modules())
    reference = modules if device_of is None else dict(device_of.named_modules())
    for path, tensor in state["buffers"].items():
        prefix, _, leaf = path.rpartition(".")
        old = reference[prefix]._buffers.get(leaf)
        modules[prefix]._buffers[leaf] = (
            tensor if old is None or old.device == tensor.device else tensor.to(old.device)
        )
    counters = state["counters"]
    for path, module in modules.items():
        own: dict[str, Any] = module.__dict__
        for attr in _COUNTERS:
            own.pop(attr, None)
        own.update(counters.get(path, ()))


def _since_last_sync(peer: nn.Module) -> None:
    """Count only the batches a peer saw since the last sync (the merge weighs by them)."""
    for module in peer.modules():
        base = int(vars(module).get(SYNCED_ATTR, 0))
        batches = module._buffers.get("num_batches")
        if base and batches is not None:
            batches.fill_(int(batches) - base)


def _merge_one(name: str, obs: nn.Module, states: list[dict[str, Any]]) -> dict[str, Any]:
    baselines = {
        path: {int(c.get(SYNCED_ATTR, 0)) for c in (s["counters"].get(path, {}) for s in states)}
        for path in states[0]["counters"]
    }
    for path, values in baselines.items():
        if len(values) > 1:
            raise DistributedError(
                f"sync_observers: observer {name} ({path or 'itself'}) was last synced at different "
                f"batch counts on different ranks {sorted(values)}; every rank must take part in every sync"
            )
    peers = []
    for state in states:
        peer = fresh_copy(obs)
        _load_state(peer, state, device_of=obs)
        _since_last_sync(peer)
        peers.append(peer)
    _refuse_histogram_resync(name, obs, peers)
    merge_observers(peers[0], peers[1:])
    merged = _state(peers[0])
    for path, module in peers[0].named_modules():
        batches = module._buffers.get("num_batches")
        if batches is not None:
            total = int(batches) + int(vars(module).get(SYNCED_ATTR, 0))
            merged["buffers"][f"{path}.num_batches" if path else "num_batches"] = torch.tensor(total)
            merged["counters"].setdefault(path, {})[SYNCED_ATTR] = total
        elif "histogram" in module._buffers:  # torchao's: no count to tell new data by
            merged["counters"].setdefault(path, {})[SYNCED_ATTR] = 1
    return merged


def _refuse_histogram_resync(name: str, obs: nn.Module, peers: list[nn.Module]) -> None:
    for path, module in obs.named_modules():
        if "histogram" not in module._buffers or SYNCED_ATTR not in vars(module):
            continue
        fresh = [p.get_submodule(path)._buffers.get("num_batches") for p in peers]
        if any(b is None or int(b) > 0 for b in fresh):
            raise DistributedError(
                f"sync_observers: the histogram observer {name} ({getattr(obs, 'where', '') or path}) saw "
                "data after it was already synced; histograms are sums and merge once, after "
                "calibration (for QAT, use min-max or moving-average observers)"
            )


def sync_observers(
    prepared: nn.Module, group: Any = None, *, timeout: timedelta | float = DEFAULT_TIMEOUT
) -> SyncResult:
    """Replace every observer's statistics by the merge of all ranks' (see the module docstring),
    and, with accuracy algorithms, every collector's and the stored batches for sequential inputs
    (:mod:`_quantplug.distributed.collectors`).

    Args:
        prepared: what ``quantplug.prepare`` returned (or a DistributedDataParallel around it),
            calibrated on this rank's share of the data.
        group: the ``torch.distributed`` process group (default: the default group). With nccl,
            call ``torch.cuda.set_device`` for the rank first, as nccl's object collectives need.
        timeout: how long to wait for the other ranks (a timedelta or seconds).

    Raises:
        DistributedError: torch.distributed is not initialized, a rank did not arrive within
            ``timeout``, the ranks prepared different programs (naming the first difference, such
            as a weight a transform wrote from other data), or collectors merged by an earlier
            sync saw more batches.
        CollectorMergeError: an algorithm's collector defines no merge hook (naming the
            algorithm and the collector class), or its states do not merge.
    """
    import torch.distributed as dist

    started = time.perf_counter()
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedError(
            "sync_observers needs torch.distributed: call torch.distributed.init_process_group() first "
            "(torchrun sets the environment it reads)"
        )
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    module = prepared_of(prepared)
    observers = named_observers(module)
    world = dist.get_world_size(group)
    device = _comm_device(group)
    _wait_for_everyone(group, timeout, device)
    _check_same_program(fingerprint(module, observers), group, device, world)  # type: ignore[arg-type]
    check_mergeable(module)  # before any state moves; the same verdict on every rank (same program)
    stateful = [(name, obs) for name, obs in observers if has_statistics(obs)]
    mine = {name: _state(obs) for name, obs in stateful}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, _packed(mine), group=group)
    everyone = [_unpacked(p) for p in everyone]
    for name, obs in stateful:
        _load_state(obs, _merge_one(name, obs, [states[name] for states in everyone]))
    collected = sync_collectors(module, group, world)
    sent = sum(t.numel() * t.element_size() for s in mine.values() for t in s["buffers"].values())
    return SyncResult(
        len(stateful),
        world,
        sent + collected.sent_bytes,
        time.perf_counter() - started,
        collected.collectors,
        collected.stored_batches,
    )
