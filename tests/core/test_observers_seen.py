"""Observers reuse the statistics of a batch whose very values they (or another observer) saw
recently (``_quantplug.observers.seen``), and end in the state that observing every batch in full
gives, bit for bit; what they must never match (written, freed, trained tensors) they do not."""

from __future__ import annotations

import copy
import gc
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantplug
from _quantplug.meta import observer_children
from _quantplug.observers import kernels, seen
from _quantplug.observers.copies import fresh_copy
from _quantplug.observers.histogram import HistogramObserver
from _quantplug.observers.minmax import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    _average_step,
    _average_steps,
)
from _quantplug.observers.rebin import _spread

OBSERVERS = {
    "histogram": lambda: HistogramObserver(bins=256),
    "minmax": lambda: MinMaxObserver(),
    "moving_average": lambda: MovingAverageMinMaxObserver(averaging_constant=0.3),
    "moving_average_per_pass": lambda: MovingAverageMinMaxObserver(averaging_constant=0.3, calls_per_pass=4),
}


def _state(obs: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in obs.state_dict(keep_vars=True).items()} | {
        "num_batches": obs.num_batches.clone()
    }


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(-1), sb[k].view(-1)), k
        if sa[k].is_floating_point():  # signed zeros too
            assert torch.equal(torch.signbit(sa[k]), torch.signbit(sb[k])), k


def _heads(x: torch.Tensor) -> list[torch.Tensor]:
    """An attention block's q/k/v calls on one group: the projection, its split heads, their
    reshapes and transposes (views of the heads, read again a few calls later)."""
    q, k, v = x.split(32, dim=-1)
    views = [t.reshape(1, 16, 4, 8) for t in (q, k, v)]
    return [x, q, k, v, *views, *(t.transpose(1, 2) for t in views), views[1].transpose(1, 2).transpose(2, 3)]


class _CountingKernels:
    """The native kernels, counting the passes ``minmax`` (``minmax_rows``: a slice) makes over a
    batch's values."""

    def __init__(self, native: object) -> None:
        self.native, self.passes = native, 0

    def minmax(self, address: int, n: int) -> tuple[float, float]:
        self.passes += 1
        return self.native.minmax(address, n)  # type: ignore[attr-defined,no-any-return]

    def minmax_rows(self, address: int, n: int, rows: int, stride: int) -> tuple[float, float]:
        self.passes += 1  # a slice read in place
        return self.native.minmax_rows(address, n, rows, stride)  # type: ignore[attr-defined,no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self.native, name)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> _CountingKernels:
    """Range observers' passes over the values (they find extremes with the native kernel)."""
    if not kernels.enabled():
        pytest.skip("native kernels not built")
    counting = _CountingKernels(kernels._native)
    monkeypatch.setattr(kernels, "_native", counting)
    return counting


@pytest.mark.parametrize("kind", sorted(OBSERVERS))
def test_views_of_recent_batches_end_in_the_state_of_full_passes(
    kind: str, monkeypatch: pytest.MonkeyPatch, counted: _CountingKernels
) -> None:
    hits = []
    recall = seen.recall

    def counting(observer, batch):  # type: ignore[no-untyped-def]
        found = recall(observer, batch)
        hits.append(found is not None)
        return found

    monkeypatch.setattr(seen, "recall", counting)
    monkeypatch.setattr(kernels, "VIEW_LIMIT", 0)  # the histogram's native step would count these views
    fast, full = OBSERVERS[kind](), OBSERVERS[kind]()
    passes = 0
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for scale in (1.0, 3.0, 0.5, 2.0):  # ranges that grow and stay
            x = torch.randn(1, 16, 96, generator=g) * scale
            before = counted.passes
            for t in _heads(x):
                fast(t)
            passes += counted.passes - before
            with seen.disabled():
                for t in _heads(x):
                    full(t)
    _assert_same_state(fast, full)
    if kind == "histogram":  # counts over its own range: recalled from its own records
        assert sum(hits) >= 4 * 7  # every reshape and transpose of each batch was recalled
    else:  # extremes: one pass over the projection and each head, none over their views
        assert passes == 4 * 4


def test_a_second_observer_of_the_same_tensor_reuses_its_extremes(counted: _CountingKernels) -> None:
    a, b = MinMaxObserver(), MovingAverageMinMaxObserver()
    ref_a, ref_b = MinMaxObserver(), MovingAverageMinMaxObserver()
    x = torch.randn(64, 64) + 0.5
    a(x)
    b(x.t())
    assert counted.passes == 1  # read once, recalled by the second
    with seen.disabled():
        ref_a(x)
        ref_b(x.t())
    assert counted.passes == 3  # the check can fail: without records each observer reads the values
    _assert_same_state(a, ref_a)
    _assert_same_state(b, ref_b)


@pytest.mark.parametrize("kind", ["histogram", "moving_average"])
def test_a_tensor_written_in_place_is_observed_again(kind: str) -> None:
    fast, full = OBSERVERS[kind](), OBSERVERS[kind]()
    x = torch.randn(32, 32)
    fast(x)
    full(x.clone())
    x[3, 4] = 100.0  # same storage and address, new values: the version counter moved
    fast(x.t())
    full(x.t().contiguous())
    _assert_same_state(fast, full)
    assert float(fast.max_val) >= (100.0 if kind == "histogram" else 0.0)


def test_freed_storage_and_other_layouts_are_never_matched() -> None:
    x = torch.randn(64, 64)
    batch = seen.probe(x)
    assert batch is not None and batch.holds(seen.probe(x.view(4096)))  # type: ignore[arg-type]
    assert not batch.holds(seen.probe(x[:, :32]))  # type: ignore[arg-type]  # same address, fewer values
    assert not batch.holds(seen.probe(x.view(torch.int32)))  # type: ignore[arg-type]
    del x
    gc.collect()
    y = torch.randn(64, 64)  # may well reuse the freed memory
    assert not batch.holds(seen.probe(y))  # type: ignore[arg-type]


def test_parameters_are_matched_only_outside_autograd() -> None:
    weight = nn.Parameter(torch.randn(8, 8))
    assert seen.probe(weight) is None
    with torch.no_grad():
        assert seen.probe(weight) is not None
    with torch.inference_mode():
        assert seen.probe(torch.randn(3)) is None  # no version counter


def test_copies_and_pickles_start_without_records() -> None:
    obs = HistogramObserver(bins=64)
    x = torch.randn(10, 20)[:, :10]  # strided: the general path, which keeps records
    obs(x)
    assert seen.ATTR in obs.__dict__ and kernels.STEP_ATTR in obs.__dict__
    batch = torch.randn(100) * 0.1  # within the range: the native step where the kernels are built
    for copied in (fresh_copy(obs), copy.deepcopy(obs), pickle.loads(pickle.dumps(obs))):
        assert seen.ATTR not in copied.__dict__ and kernels.STEP_ATTR not in copied.__dict__
        _assert_same_state(copied, obs)
        before = obs.histogram.clone()
        copied(batch)  # counted into the copy's buffers, never the original's
        assert torch.equal(obs.histogram, before)
        reference = copy.deepcopy(obs)
        with kernels.disabled():
            reference(batch)
        _assert_same_state(copied, reference)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_equal_layouts_cover_the_same_addresses(sizes: list[int], rnd: object) -> None:
    base = torch.arange(int(np.prod(sizes)), dtype=torch.float32).reshape(sizes)
    order = list(range(len(sizes)))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    views = [base, base.permute(order), base.permute(order).transpose(0, -1), base.reshape(-1)]
    if sizes[-1] > 1:
        views.append(base[..., 1:])
    if len(sizes) > 1 and sizes[0] > 1:
        views.append(base[::2])
    for a in views:
        for b in views:
            if a.data_ptr() == b.data_ptr() and seen.layout(a) == seen.layout(b):
                assert sorted(a.reshape(-1).tolist()) == sorted(b.reshape(-1).tolist())
        addresses = sorted(int(v) for v in a.reshape(-1).tolist())  # base holds its own offsets
        assert seen.dense(a) == (addresses == list(range(addresses[0], addresses[0] + a.numel())))


FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(FLOAT32, FLOAT32, st.floats(0.0, 1.0, width=32))
def test_average_step_rounds_as_float32_arithmetic(current: float, value: float, c: float) -> None:
    f32 = np.float32
    with np.errstate(over="ignore"):
        expected = float(f32(current) + f32(f32(value) - f32(current)) * f32(c))
    assert _average_step(current, value, c) == expected or (
        np.isnan(expected) and np.isnan(_average_step(current, value, c))
    )
    # both ends of a range in one pass: the same roundings (the other end: the mirrored step)
    pair = _average_steps(current, value, -value, -current, c)
    assert pair[0] == _average_step(current, value, c) or np.isnan(pair[0])
    assert pair[1] == _average_step(-value, -current, c) or np.isnan(pair[1])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 10_000), min_size=1, max_size=300),
    st.floats(-1e3, 1e3),
    st.floats(1e-3, 1e3),
    st.floats(0.0, 1e3),
    st.floats(0.0, 1e3),
)
def test_numpy_rebinning_is_the_torch_expression(
    counts: list[int], old_min: float, old_span: float, below: float, above: float
) -> None:
    """The NumPy re-binning against the torch expression it replaced, element by element."""
    h = torch.tensor(counts, dtype=torch.float64) * 1.37
    bins = h.numel()
    old_max = old_min + old_span
    new_min, new_max = old_min - below, old_max + above
    new_width = (new_max - new_min) / bins
    old_width = (old_max - old_min) / bins
    cum = torch.cat([h.new_zeros(1), h.cumsum(0)])
    edges = new_min + new_width * torch.arange(bins + 1, dtype=torch.float64)
    t = ((edges - old_min) / old_width).clamp(0.0, float(bins))
    j = t.floor().clamp(max=bins - 1).long()
    expected = torch.diff(cum[j] + h[j] * (t - j.to(t.dtype))).clamp_(min=0.0)
    got = torch.from_numpy(_spread(h.numpy(), old_min, old_max, new_min, new_width))
    assert torch.equal(got, expected)


class _Attention(nn.Module):
    """A decoder block's attention: packed q/k/v split into heads, a causal mask, an output projection."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (h.reshape(b, t, self.heads, -1).transpose(1, 2) for h in self.qkv(x).split(d, dim=-1))
        mask = torch.full((t, t), torch.finfo(x.dtype).min).triu(1)
        scores = F.softmax(q @ k.transpose(-1, -2) / 8.0 + mask, dim=-1)
        return self.out((scores @ v).transpose(1, 2).reshape(b, t, d)) + x


@pytest.fixture(scope="module")
def program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(_Attention().eval(), (torch.randn(1, 8, 32),))


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("reference", {"preset": "int8"}),
        ("qnn_htp", {"precision": "16a8w"}),
        ("qnn_htp", {"precision": "8a8w", "act_observer": "moving_average"}),
    ],
)
def test_calibration_gives_the_same_program_as_full_passes(
    program: torch.export.ExportedProgram, backend: str, options: dict[str, str]
) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(1, 8, 32, generator=g) * s for s in (1.0, 2.5, 0.7)]

    def calibrated(replays: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        prepared = quantplug.prepare(program, quantplug.get_quantizer(backend, **options))
        with torch.no_grad():
            for x in batches:
                if replays:
                    prepared(x)
                else:
                    with seen.disabled():
                        prepared(x)
        observers = {
            f"{n}.{k}": v.clone() for n, o in observer_children(prepared) for k, v in _state(o).items()
        }
        return observers, quantplug.convert(prepared).state_dict()

    (obs_fast, sd_fast), (obs_full, sd_full) = calibrated(True), calibrated(False)
    assert obs_fast.keys() == obs_full.keys() and sd_fast.keys() == sd_full.keys()
    for k in obs_fast:
        assert torch.equal(obs_fast[k], obs_full[k]), k
    for k in sd_fast:
        assert torch.equal(sd_fast[k], sd_full[k]), k
