"""The merge algebra of every observer kind (_quantplug.observers.merge), property-based."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from _quantplug.errors import ObserverMergeError
from _quantplug.observers.fake_quantize import FakeQuantize
from _quantplug.observers.fixed import FixedQParamsObserver
from _quantplug.observers.histogram import HistogramObserver
from _quantplug.observers.merge import merge_observers
from _quantplug.observers.minmax import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)
from _quantplug.observers.per_block import PerBlockMinMaxObserver

# one batch: (seed, scale, shift); tensors are made from them so shrinking stays readable
batch = st.tuples(st.integers(0, 2**16), st.floats(1e-3, 1e3), st.floats(-10.0, 10.0))
batches = st.lists(batch, min_size=1, max_size=8)


def tensor(spec: tuple[int, float, float], shape: tuple[int, ...] = (4, 8)) -> torch.Tensor:
    seed, scale, shift = spec
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale + shift


MIN_MAX_KINDS: dict[str, Callable[[], nn.Module]] = {
    "minmax": MinMaxObserver,
    "minmax_symmetric_int8": lambda: MinMaxObserver(dtype=torch.int8, qscheme=torch.per_tensor_symmetric),
    "per_channel": lambda: PerChannelMinMaxObserver(ch_axis=1),
    "per_block": lambda: PerBlockMinMaxObserver(block_size=(2, 4), dtype=torch.int8),
    "fake_quantize": lambda: FakeQuantize(MinMaxObserver()),
}


def fed(make: Callable[[], nn.Module], specs: Sequence[tuple[int, float, float]]) -> nn.Module:
    obs = make()
    for spec in specs:
        obs(tensor(spec))
    return obs


def merged(parts: Sequence[nn.Module]) -> nn.Module:
    first = copy.deepcopy(parts[0])
    merge_observers(first, [copy.deepcopy(p) for p in parts[1:]])
    return first


def state(obs: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in obs.named_buffers()}


def assert_same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]), k
    qa: Any = a
    qb: Any = b
    for x, y in zip(qa.calculate_qparams(), qb.calculate_qparams()):
        assert torch.equal(x, y)


def split(specs: list[Any], owners: list[int], parts: int) -> list[list[Any]]:
    return [[s for s, o in zip(specs, owners) if o % parts == p] for p in range(parts)]


@pytest.mark.parametrize("kind", sorted(MIN_MAX_KINDS))
@settings(max_examples=40, deadline=None)
@given(specs=batches, owners=st.lists(st.integers(0, 3), min_size=8, max_size=8), parts=st.integers(1, 4))
def test_min_max_merge_equals_one_observer_on_the_union(
    kind: str, specs: list[Any], owners: list[int], parts: int
) -> None:
    make = MIN_MAX_KINDS[kind]
    shares = split(specs, owners, parts)
    if not shares[0]:  # an observer that saw nothing must stand first too
        shares = shares[::-1]
    assert_same(merged([fed(make, s) for s in shares]), fed(make, specs))


@pytest.mark.parametrize("kind", sorted(MIN_MAX_KINDS))
@settings(max_examples=30, deadline=None)
@given(a=batches, b=batches, c=batches)
def test_min_max_merge_is_associative_commutative_with_identity(
    kind: str, a: list[Any], b: list[Any], c: list[Any]
) -> None:
    make = MIN_MAX_KINDS[kind]
    oa, ob, oc = fed(make, a), fed(make, b), fed(make, c)
    assert_same(merged([merged([oa, ob]), oc]), merged([oa, merged([ob, oc])]))
    assert_same(merged([oa, ob]), merged([ob, oa]))
    assert_same(merged([oa, make()]), oa)
    assert_same(merged([make(), oa]), oa)


@settings(max_examples=40, deadline=None)
@given(parts=st.lists(batches, min_size=2, max_size=4), order=st.randoms(use_true_random=False))
def test_histogram_merge_does_not_depend_on_the_order_of_the_ranks(parts: list[Any], order: Any) -> None:
    observers = [fed(lambda: HistogramObserver(bins=64), p) for p in parts]
    shuffled = list(observers)
    order.shuffle(shuffled)
    a, b = merged(observers), merged(shuffled)
    assert_same(a, b)
    # the union of the ranges; every value counted once
    assert float(a.min_val) == min(float(o.min_val) for o in observers)
    assert float(a.max_val) == max(float(o.max_val) for o in observers)
    total = sum(float(o.histogram.sum()) for o in observers)
    assert math.isclose(float(a.histogram.sum()), total, rel_tol=1e-6)
    assert int(a.num_batches) == sum(len(p) for p in parts)
    assert_same(merged([observers[0], HistogramObserver(bins=64)]), observers[0])  # identity


@pytest.mark.parametrize(
    "make", [MovingAverageMinMaxObserver, lambda: MovingAveragePerChannelMinMaxObserver(ch_axis=1)]
)
@settings(max_examples=30, deadline=None)
@given(a=batches, b=batches, c=batches)
def test_moving_average_merge_is_the_batch_weighted_mean(make: Any, a: Any, b: Any, c: Any) -> None:
    oa, ob, oc = fed(make, a), fed(make, b), fed(make, c)
    result = merged([oa, ob, oc])
    assert_same(result, merged([oc, oa, ob]))  # commutative, bit for bit
    assert_same(merged([oa, make()]), oa)  # an observer that saw nothing changes nothing
    weights = torch.tensor([len(a), len(b), len(c)], dtype=torch.float64)
    for attr in ("min_val", "max_val"):
        values = torch.stack([getattr(o, attr).double() for o in (oa, ob, oc)])
        expected = (values * weights.reshape(-1, *[1] * (values.dim() - 1))).sum(0) / weights.sum()
        torch.testing.assert_close(getattr(result, attr).double(), expected, rtol=1e-6, atol=1e-6)
    assert int(result.num_batches) == len(a) + len(b) + len(c)


def _sqnr(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int) -> float:
    q = torch.clamp(torch.round(x / scale) + zero_point, qmin, qmax)
    err = (q - zero_point) * scale - x
    return float(10 * torch.log10(x.square().sum() / err.square().sum()))


@pytest.mark.parametrize("method", ["mse", "percentile"])
def test_histogram_merged_over_ranks_is_within_a_hundredth_db_of_one_process(method: str) -> None:
    """One process re-bins its histogram each time its range grows (order-dependent); ranks re-bin
    once onto the agreed range. Heavy-tailed data whose range grows batch after batch: the
    clipping ranges differ by a fraction of a bin, the SQNR by less than 0.05 dB."""
    torch.manual_seed(0)
    data = [torch.distributions.StudentT(3.0).sample((2048,)) * (1 + i / 4) for i in range(16)]
    everything = torch.cat(data)
    single = HistogramObserver(method=method)
    for x in data:
        single(x)
    reference = _sqnr(everything, *single.calculate_qparams(), single.quant_min, single.quant_max)
    for ranks in (2, 4):
        parts = [HistogramObserver(method=method) for _ in range(ranks)]
        for i, x in enumerate(data):
            parts[i % ranks](x)
        result = merged(parts)
        got = _sqnr(everything, *result.calculate_qparams(), result.quant_min, result.quant_max)
        assert abs(got - reference) < 0.05, (ranks, got, reference)


def test_nonfinite_counts_add_up() -> None:
    a, b = MinMaxObserver(), MinMaxObserver()
    for obs, n in ((a, 2), (b, 3)):
        obs.nonfinite = "ignore"
        x = torch.randn(16)
        x[:n] = float("nan")
        obs(x)
    result = merged([a, b])
    assert result.nonfinite_ignored == 5
    assert torch.isfinite(result.min_val) and torch.isfinite(result.max_val)


def test_observers_without_statistics_merge_as_a_no_op() -> None:
    fixed = FixedQParamsObserver(1 / 256, 0)
    merge_observers(fixed, [FixedQParamsObserver(1 / 256, 0)])
    assert fixed.calculate_qparams()[0].item() == 1 / 256


def test_what_cannot_merge_is_refused_by_name() -> None:
    with pytest.raises(ObserverMergeError, match="HistogramObserver into a MinMaxObserver"):
        merge_observers(MinMaxObserver(), [HistogramObserver()])
    a, b = (
        fed(lambda: PerChannelMinMaxObserver(ch_axis=1), [(0, 1.0, 0.0)]),
        PerChannelMinMaxObserver(ch_axis=1),
    )
    b(torch.randn(4, 3))
    with pytest.raises(ObserverMergeError, match="different shapes"):
        merge_observers(a, [b])

    class Counting(MinMaxObserver.__mro__[1]):  # type: ignore[misc]  # an ObserverBase without merge_
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(ObserverMergeError, match="defines no merge_"):
        merge_observers(Counting(), [Counting()])


@pytest.mark.parametrize("name", ["MinMaxObserver", "PerChannelMinMaxObserver", "HistogramObserver"])
def test_torchao_observers_merge_like_ours(name: str) -> None:
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    from _quantplug.peers.torchao_observers import accelerate

    kwargs: dict[str, Any] = {"ch_axis": 1} if name.startswith("PerChannel") else {}
    make = lambda: accelerate(getattr(ao, name)(**kwargs))  # noqa: E731
    data = [tensor((i, 1.0 + i, 0.0)) for i in range(6)]
    single, a, b = make(), make(), make()
    for i, x in enumerate(data):
        single(x)
        (a if i % 2 else b)(x)
    merge_observers(a, [b])
    qa, qs = a.calculate_qparams(), single.calculate_qparams()
    if name == "HistogramObserver":
        torch.testing.assert_close(qa[0], qs[0], rtol=2e-2, atol=0.0)
    else:
        assert all(torch.equal(x, y) for x, y in zip(qa, qs))
