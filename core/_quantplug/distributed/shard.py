"""Each rank's share of the calibration batches, read lazily."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, TypeVar

from _quantplug.errors import DistributedError

T = TypeVar("T")


def rank_and_size(group: Any = None) -> tuple[int, int]:
    """This process's rank and the group's size; ``(0, 1)`` when torch.distributed is not set up."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard(
    batches: Iterable[T], *, group: Any = None, rank: int | None = None, world_size: int | None = None
) -> Iterator[T]:
    """Every ``world_size``-th batch starting at ``rank`` (round robin): each batch goes to exactly
    one rank, the shares differ in size by at most one, and nothing is read ahead or held.

    ``rank`` and ``world_size`` default to the process group's (``group``, else the default
    group); without torch.distributed set up, every batch is this process's.
    """
    if rank is None or world_size is None:
        found_rank, found_size = rank_and_size(group)
        rank = found_rank if rank is None else rank
        world_size = found_size if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise DistributedError(f"shard: rank {rank} is not in a group of {world_size} process(es)")
    return islice(batches, rank, None, world_size)
