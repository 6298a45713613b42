"""The merge rules of the algorithms' collectors, as pure functions and in a one-process group.

Sums (layer Hessians, Gram matrices, running means) merged from any split equal one collector
fed every batch; merged reservoir samples are uniform samples of every rank's rows; the merged
store of batches for sequential inputs is the one process's store under round-robin sharding.
"""

from __future__ import annotations

import random
from itertools import combinations
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import quantplug
from _quantplug.algorithms.bias_correction import RunningMean
from _quantplug.algorithms.collectors import Gram, InputSample, merge_samples, mixed_seed
from _quantplug.algorithms.merge import check_mergeable
from _quantplug.algorithms.sequential import InputStore, merged_store
from _quantplug.algorithms.spec import WeightSite
from _quantplug.algorithms.weight_layers import LayerHessian, share_hessians
from _quantplug.distributed.collectors import rounds
from quantplug.distributed import shard, sync_observers
from tests.distributed.worker import SampleRows, Unmergeable, _algo_prepare, algo_batches

# --- sums: any split, merged in rank order, is the collector fed every batch ------------------


def _site(conv: bool, groups: int = 1) -> WeightSite:
    if conv:
        weight = torch.zeros(6, 6 // groups, 3, 3)
        return WeightSite(
            "w",
            "conv",
            "aten.conv2d.default",
            weight,
            None,
            0,
            _call=lambda x, w: F.conv2d(x, w, groups=groups),
        )
    weight = torch.zeros(4, 5)
    return WeightSite(
        "w", "linear", "aten.linear.default", weight, None, 0, _call=lambda x, w: F.linear(x, w)
    )


def _collectors(kind: str) -> Any:
    return {
        "hessian": lambda: LayerHessian(_site(False)),
        "conv_hessian": lambda: LayerHessian(_site(True)),
        "conv_grouped_hessian": lambda: LayerHessian(_site(True, groups=3), "all", grouped=True),  # [3, I, I]
        "shrunk_hessian": lambda: LayerHessian(_site(False), "all"),  # the fourth moments merge too
        "gram": Gram,
        "mean": lambda: RunningMean(conv=False),
        "conv_mean": lambda: RunningMean(conv=True),
    }[kind]


def _batch(kind: str, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    shape = (2, 6, 6, 6) if kind.startswith("conv") else (2, 3, 5)
    return torch.randint(-8, 9, shape, generator=g).to(torch.float32)  # small integers: exact sums


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(
        ["hessian", "conv_hessian", "conv_grouped_hessian", "shrunk_hessian", "gram", "mean", "conv_mean"]
    ),
    st.integers(1, 9),
    st.integers(1, 4),
    st.randoms(use_true_random=False),
)
def test_merged_sums_equal_one_collector_fed_every_batch(
    kind: str, batches: int, ranks: int, rng: Any
) -> None:
    make = _collectors(kind)
    whole = make()
    data = [_batch(kind, i) for i in range(batches)]
    for x in data:
        whole.update(x)
    owner = [rng.randrange(ranks) for _ in data]  # any split, not only round robin
    parts = [make() for _ in range(ranks)]
    for x, r in zip(data, owner):
        parts[r].update(x)
    states = [p.state() for p in parts]
    for part in parts:  # every rank merges the same list: every rank gets the same bits
        part.merge_(states)
        # integer data: every float64 partial sum is exact, so the order of additions cannot show
        torch.testing.assert_close(part.result(), whole.result(), rtol=0, atol=0)


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3))
def test_shared_hessians_merge_through_their_leader(batches: int, ranks: int) -> None:
    """A follower sends nothing and merges nothing: after every rank merges its fed collectors
    in order, leader and follower both read the sums of every batch (each its own shrinkage)."""
    data = [_batch("hessian", i) for i in range(batches)]
    whole = LayerHessian(_site(False), "all")
    for x in data:
        whole.update(x)
    pairs = [(LayerHessian(_site(False)), LayerHessian(_site(False), "all")) for _ in range(ranks)]
    for leader, follower in pairs:
        share_hessians([("x", leader), ("x", follower)])
    for i, x in enumerate(data):
        leader, follower = pairs[i % ranks]
        leader.update(x)
        follower.update(x)
    assert all(f.state()["sum"] is None for _, f in pairs)
    states = [[p.state() for p in pair] for pair in pairs]
    for leader, follower in pairs:
        leader.merge_([s[0] for s in states])
        follower.merge_([s[1] for s in states])
        torch.testing.assert_close(follower.result(), whole.result(), rtol=0, atol=0)
        assert follower.rows == leader.rows == whole.rows


def test_a_convolution_mean_drops_to_channels_when_ranks_saw_other_sizes() -> None:
    whole, a, b = RunningMean(conv=True), RunningMean(conv=True), RunningMean(conv=True)
    first, second = torch.ones(2, 3, 4, 4), 3 * torch.ones(2, 3, 2, 2)
    whole.update(first)
    whole.update(second)
    a.update(first)
    b.update(second)
    a.merge_([a.state(), b.state()])
    assert a.result().shape == (3,)
    torch.testing.assert_close(a.result(), whole.result())


def test_a_hessian_one_rank_could_not_collect_is_not_collected() -> None:
    ok, odd = LayerHessian(_site(False)), LayerHessian(_site(False))
    ok.update(torch.randn(3, 5))
    odd.update(torch.randn(3, 7))  # another input width: this layer is not a plain y = W x here
    ok.merge_([ok.state(), odd.state()])
    assert ok.result() is None and ok.unsupported


# --- samples: independent uniform samples merge into a uniform sample of the union ------------


def _uniform_sample(rows: list[int], cap: int, rng: random.Random) -> list[int]:
    return sorted(rng.sample(rows, min(cap, len(rows))))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=3).filter(lambda s: sum(s) >= 2), st.integers(1, 4))
def test_merged_samples_are_uniform_samples_of_every_ranks_rows(seen: list[int], cap: int) -> None:
    """Over many seeds, each row and each pair of rows is in the merged sample as often as in a
    uniform sample of k rows of the union (k/n, and k(k-1)/(n(n-1)) for pairs: what a merge of
    correlated or unevenly weighted samples gets wrong), within 5 standard deviations."""
    ids, start = [], 0
    for n in seen:
        ids.append(list(range(start, start + n)))
        start += n
    total, trials = start, 2000
    k = min(cap, total)
    single = [0] * total
    pairs = dict.fromkeys(combinations(range(total), 2), 0)
    for seed in range(trials):
        samples = []
        for r, rows in enumerate(ids):
            picked = _uniform_sample(rows, cap, random.Random(mixed_seed(seed, f"rank {r}")))
            tensor = torch.tensor(picked, dtype=torch.float32).reshape(-1, 1) if rows else None
            samples.append((tensor, len(rows)))
        merged, count = merge_samples(samples, cap, torch.Generator().manual_seed(seed))
        assert merged is not None and count == total and merged.shape == (k, 1)
        chosen = sorted(int(v) for v in merged.reshape(-1).tolist())
        assert len(set(chosen)) == k  # no row twice
        for i in chosen:
            single[i] += 1
        for pair in combinations(chosen, 2):
            pairs[pair] += 1

    def close(count: int, p: float) -> bool:
        return abs(count / trials - p) <= 5 * (p * (1 - p) / trials) ** 0.5 + 1 / trials

    assert all(close(c, k / total) for c in single), (single, k / total)
    p2 = k * (k - 1) / (total * (total - 1))
    assert all(close(c, p2) for c in pairs.values()), (pairs, p2)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=4), st.integers(1, 12), st.integers(0, 9))
def test_merged_samples_are_capped_made_of_given_rows_and_repeatable(
    seen: list[int], cap: int, seed: int
) -> None:
    samples = []
    for r, n in enumerate(seen):
        sampler = InputSample(cap, seed=mixed_seed(seed, str(r)))
        if n:
            sampler.update(torch.arange(n, dtype=torch.float32).reshape(n, 1) + 1000 * r)
        samples.append((sampler.rows, sampler.seen))
    merged, count = merge_samples(samples, cap, torch.Generator().manual_seed(seed))
    again, _ = merge_samples(samples, cap, torch.Generator().manual_seed(seed))
    assert count == sum(seen)
    if not count:
        assert merged is None
        return
    assert merged is not None and torch.equal(merged, again)
    assert merged.shape[0] == min(cap, count)
    given_rows = torch.cat([rows for rows, _ in samples if rows is not None])
    assert all(bool((given_rows == row).all(1).any()) for row in merged)
    assert len(set(merged.reshape(-1).tolist())) == merged.shape[0]


def test_samples_of_another_shape_are_left_out_with_their_counts() -> None:
    a, b = InputSample(4, conv=True), InputSample(4, conv=True, seed=1)
    a.update(torch.ones(3, 2, 4, 4))
    b.update(torch.ones(5, 2, 3, 3))
    a.merge_([a.state(), b.state()])
    assert a.rows is not None and a.rows.shape == (3, 2, 4, 4) and a.seen == 3


# --- the store of batches for sequential inputs ----------------------------------------------


def _store(sizes: list[int], max_batches: int, max_bytes: int) -> InputStore:
    store = InputStore(max_batches, max_bytes)
    for i, n in enumerate(sizes):
        store(torch.full((n,), float(i)))  # 4 bytes per element; the value names the batch
    return store


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=0, max_size=20),
    st.integers(1, 4),
    st.integers(1, 10),
    st.integers(4, 200),
)
def test_the_merged_store_is_one_process_store_under_round_robin(
    sizes: list[int], ranks: int, max_batches: int, max_bytes: int
) -> None:
    one = _store(sizes, max_batches, max_bytes)
    mine = [_store(sizes[r::ranks], max_batches, max_bytes) for r in range(ranks)]
    order = merged_store([[b[0].numel() * 4 for b in s.batches] for s in mine], max_batches, max_bytes)
    merged = [int(mine[r].batches[i][0][0]) * ranks + r for r, i in order]  # global batch numbers
    assert len(merged) <= max_batches
    assert len(merged) <= 1 or sum(sizes[g] * 4 for g in merged) <= max_bytes
    binds = [len(s.batches) < min(max_batches, len(sizes[r::ranks])) for r, s in enumerate(mine)]
    if not any(binds) and len(one.batches) == min(max_batches, len(sizes)):  # no byte cap bound
        assert merged == [int(b[0][0]) for b in one.batches]


def test_gathering_rounds_stay_within_the_budget() -> None:
    assert rounds([3, 3, 3, 10, 1], 6) == [[0, 1], [2], [3], [4]]
    assert rounds([], 6) == []


# --- in a one-process gloo group -------------------------------------------------------------


def test_collectors_merge_once_a_second_sync_without_data_keeps_them(group: None) -> None:
    sampler = SampleRows()
    data = algo_batches(4)
    prepared = _algo_prepare([sampler, "gptq"], data)
    for x in shard(data):
        prepared(x)
    first = sync_observers(prepared, timeout=30)
    assert first.collectors == 4  # two layers, two algorithms
    again = sync_observers(prepared, timeout=30)
    assert again.collectors == 0  # merged already, nothing new
    prepared(data[0])
    with pytest.raises(quantplug.DistributedError, match="merge once"):
        sync_observers(prepared, timeout=30)


def test_a_collector_without_the_hook_is_refused_before_any_state_moves() -> None:
    prepared = _algo_prepare([Unmergeable()], algo_batches(2))
    with pytest.raises(
        quantplug.CollectorMergeError,
        match=r"'unmergeable' collects with .*Count \(weight fc1\.weight and 1 more\)",
    ):
        check_mergeable(prepared)
    assert isinstance(quantplug.CollectorMergeError("x"), quantplug.DistributedError)
