"""sync_observers' own rules, in a one-process gloo group (no process to start)."""

from __future__ import annotations

import pytest
import torch

import quantplug
from _quantplug.meta import observer_children
from quantplug.distributed import shard, sync_observers
from tests.distributed.worker import batches, program


def _prepared(observer: str) -> torch.nn.Module:
    return quantplug.prepare(program(), quantplug.get_quantizer("reference", activation_observer=observer))


def test_without_a_process_group_the_error_says_what_to_call() -> None:
    with pytest.raises(quantplug.DistributedError, match="init_process_group"):
        sync_observers(_prepared("minmax"))


def test_a_module_that_was_not_prepared_is_refused(group: None) -> None:
    with pytest.raises(quantplug.DistributedError, match=r"returned by quantplug\.prepare"):
        sync_observers(torch.nn.Linear(2, 2))


def test_repeated_syncs_count_every_batch_once(group: None) -> None:
    prepared = _prepared("moving_average")
    data = batches()
    for x in data[:5]:
        prepared(x)
    sync_observers(prepared)
    before = {k: v.clone() for k, v in prepared.state_dict().items()}
    sync_observers(prepared)  # nothing new: nothing changes
    after = prepared.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    for x in data[5:]:
        prepared(x)
    sync_observers(prepared)
    unsynced = _prepared("moving_average")
    for x in data:
        unsynced(x)
    assert _counts(prepared) == _counts(unsynced)
    assert {k: v for k, v in prepared.state_dict().items()}.keys() == unsynced.state_dict().keys()
    assert all(torch.equal(v, unsynced.state_dict()[k]) for k, v in prepared.state_dict().items())


def _counts(prepared: torch.nn.Module) -> dict[str, int]:
    return {n: int(o.num_batches) for n, o in observer_children(prepared)}


def test_a_histogram_synced_twice_with_new_data_is_refused(group: None) -> None:
    prepared = _prepared("histogram")
    prepared(batches()[0])
    sync_observers(prepared)
    sync_observers(prepared)  # no new data: fine
    prepared(batches()[1])
    with pytest.raises(quantplug.DistributedError, match="histograms are sums and merge once"):
        sync_observers(prepared)


def test_shard_splits_round_robin_and_checks_its_arguments() -> None:
    assert list(shard(range(7), rank=1, world_size=3)) == [1, 4]
    assert list(shard(range(3))) == [0, 1, 2]  # no group: everything
    with pytest.raises(quantplug.DistributedError, match="rank 3 is not in a group of 2"):
        shard(range(3), rank=3, world_size=2)
