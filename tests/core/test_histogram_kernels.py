"""The native histogram kernels compute what torch computes, and decline what they cannot take.

The observers' bit-identity with torchao under both code paths is tested in
test_perf_structure.py; here the kernels are compared with torch.aminmax and torch.histc
directly, including the edge cases (bin edges, NaN, infinities, signed zeros, many bins).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from _quantplug.observers import kernels
from _quantplug.observers.binning import LinearBinning, add_histc, histc
from tests.core.kernel_code import simd as simd_code

native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built (no C compiler)")

FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


def test_kernels_are_built_where_a_c_compiler_is() -> None:
    """setup.py makes the extension optional; a broken build must not pass unnoticed."""
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler on this machine: the torch code paths are in use")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers (python3-dev) on this machine: the torch code paths are in use")
    assert kernels.available(), "a C compiler is present but quantplug's native kernels were not built"
    assert kernels.enabled() == (os.environ.get("QUANTPLUG_NATIVE_KERNELS", "1") != "0")


def test_environment_variable_turns_the_kernels_off() -> None:
    code = "from quantplug.observers import kernels; print(kernels.enabled())"
    env = {**os.environ, "QUANTPLUG_NATIVE_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@native
def test_disabled_runs_the_torch_path_and_restores() -> None:
    x = torch.randn(100)
    assert kernels.minmax(x) is not None
    with kernels.disabled():
        assert not kernels.enabled()
        assert kernels.minmax(x) is None
        assert not kernels.bin_counts(x, -5.0, 0.0, 0.1, 100, torch.zeros(100), False)
    assert kernels.enabled()


@native
@settings(max_examples=300, deadline=None)
@given(st.lists(FLOAT32, min_size=1, max_size=70), st.integers(0, 3))
def test_minmax_is_torch_aminmax(values: list[float], offset: int) -> None:
    x = torch.tensor([0.0] * offset + values, dtype=torch.float32)[offset:]  # any alignment
    found = kernels.minmax(x)
    lo, hi = (float(v) for v in torch.aminmax(x))
    if lo == 0.0 or hi == 0.0:
        assert found is None  # torch may return either sign of zero
    else:
        assert found == (lo, hi)


@native
def test_minmax_of_nan_and_infinities() -> None:
    for n in (1, 7, 8, 9, 1000):
        for position in {0, n // 2, n - 1}:
            x = torch.randn(n) + 3.0
            x[position] = float("nan")
            lo, hi = kernels.minmax(x) or (0.0, 0.0)
            assert math.isnan(lo) and math.isnan(hi), (n, position)
            x[position] = float("-inf")
            assert kernels.minmax(x) == (-math.inf, float(x.max())), (n, position)


@native
def test_minmax_and_bin_counts_decline_what_they_cannot_read() -> None:
    x = torch.rand(64, 4) + 3.0
    out = torch.zeros(16)
    assert kernels.minmax(x[:, :2]) is None  # gaps between its rows
    assert kernels.minmax(x.double()) is None
    assert kernels.minmax(torch.empty(0)) is None
    assert kernels.minmax(torch.nn.Parameter(x)) is None  # a subclass
    lo, hi = kernels.minmax(x) or (0.0, 0.0)
    assert lo > 0.0
    args = (lo, 0.0, (hi - lo) / 16, 16)
    assert not kernels.bin_counts(x[:, :2], *args, out, False)
    assert not kernels.bin_counts(x, *args, torch.zeros(15), False)  # wrong size
    assert not kernels.bin_counts(x, *args, torch.zeros(16, dtype=torch.float64), False)
    assert not kernels.bin_counts(x, *args, torch.zeros(32)[::2], False)  # not contiguous
    assert kernels.bin_counts(x, *args, out, False)


@native
def test_transposed_tensors_are_read_where_they_lie() -> None:
    """A permutation of a contiguous block holds exactly the block's values: its extremes and
    counts are the block's, read in memory order without a copy."""
    x = torch.rand(64, 4, 3) - 0.5
    view = x.permute(2, 0, 1)
    assert not view.is_contiguous()
    assert kernels.minmax(view) == tuple(torch.stack(list(torch.aminmax(view))).tolist())
    assert kernels.extremes(view) == kernels.minmax(view)
    lo, hi = kernels.minmax(view) or (0.0, 0.0)
    binning = LinearBinning.make(32, lo, hi)
    assert binning is not None
    counted = torch.zeros(32)
    binning.count_into(view, counted)
    assert torch.equal(counted, torch.histc(view, 32, min=lo, max=hi))
    relu = x.clamp(min=0).permute(2, 0, 1)  # a zero extreme: torch's sign of zero decides
    assert kernels.extremes(relu) is None and kernels.extremes(relu.contiguous()) is not None


@native
def test_raw_kernels_reject_bad_arguments() -> None:
    from _quantplug.observers import _histogram_kernels as raw

    x, out = torch.ones(8), torch.zeros(4)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        raw.minmax(x.data_ptr())
    with pytest.raises(ValueError, match="n > 0"):
        raw.minmax(x.data_ptr(), 0)
    with pytest.raises(ValueError, match="non-null"):
        raw.minmax(0, 8)
    with pytest.raises(TypeError, match="takes 8 arguments"):
        raw.bin_counts(x.data_ptr(), 8, 0.0, 0.0, 1.0, 4, out.data_ptr())
    with pytest.raises(ValueError, match="2\\*\\*24"):
        raw.bin_counts(x.data_ptr(), 1 << 24, 0.0, 0.0, 1.0, 4, out.data_ptr(), False)
    with pytest.raises(ValueError, match="non-null"):
        raw.bin_counts(x.data_ptr(), 8, 0.0, 0.0, 1.0, 4, 0, False)
    with pytest.raises(TypeError):
        raw.bin_counts(x.data_ptr(), 8, "0", 0.0, 1.0, 4, out.data_ptr(), False)
    mids, edges = torch.linspace(0, 1, 8), torch.linspace(0, 1, 5)
    with pytest.raises(TypeError, match="takes 7 arguments"):
        raw.rebin(out.data_ptr(), 4, 2, mids.data_ptr(), edges.data_ptr(), 0)
    with pytest.raises(ValueError, match="bins \\* rate <= 2\\*\\*24"):
        raw.rebin(out.data_ptr(), 1 << 13, 1 << 12, mids.data_ptr(), edges.data_ptr(), 0, out.data_ptr())
    with pytest.raises(ValueError, match="non-null"):
        raw.rebin(out.data_ptr(), 4, 2, 0, edges.data_ptr(), 0, out.data_ptr())


@native
def test_rebin_declines_unsorted_grids_and_writes_nothing() -> None:
    hist = torch.arange(4.0)
    mids, edges = torch.linspace(0, 1, 8), torch.linspace(-1, 2, 5)
    out = torch.full((4,), 7.0)
    assert kernels.rebin(hist, 2, mids, edges, out)
    assert float(out.sum()) == float(hist.sum())
    for bad_mids, bad_edges in (
        (mids.flip(0), edges),
        (mids, edges.flip(0)),
        (mids, edges.clone().fill_(math.nan)),
    ):
        out = torch.full((4,), 7.0)
        assert not kernels.rebin(hist, 2, bad_mids.contiguous(), bad_edges.contiguous(), out)
        assert torch.equal(out, torch.full((4,), 7.0))
    assert not kernels.rebin(hist, 3, mids, edges, out)  # sizes that do not fit
    assert not kernels.rebin(hist, 2, mids, edges, torch.zeros(5))


def _histc_cases(seed: int, trials: int) -> list[tuple[torch.Tensor, int, float, float]]:
    """Batches and ranges: edges hit exactly, wider ranges, tiny and huge spans, many bins."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for trial in range(trials):
        bins = [2048, 256, 300, 1, 7, 4096, 5000, 65536][trial % 8]  # > 4096: the heap path
        n = int(torch.randint(1, 20_000, (1,), generator=g))
        scale = float(10 ** torch.empty(1).uniform_(-30, 30, generator=g))
        x = torch.randn(n, generator=g) * scale + float(torch.randn(1, generator=g)) * scale * (trial % 3)
        lo, hi = (float(v) for v in torch.aminmax(x))
        if trial % 4 == 0:  # values exactly on bin edges
            edges = torch.linspace(lo, hi, bins + 1)
            x[: n // 2] = edges[torch.randint(0, bins + 1, (n // 2,), generator=g)]
        if trial % 5 == 1:  # a wider range than the data (a growing observer)
            lo, hi = float(torch.tensor(lo - abs(lo) - 1e-3)), float(torch.tensor(hi + abs(hi) * 0.5 + 1e-3))
        if lo < hi:
            cases.append((x, bins, lo, hi))
    return cases


@pytest.fixture(params=["avx2", "sse2"])
def simd(request: pytest.FixtureRequest) -> Iterator[None]:
    """The kernels' AVX2 code (where the CPU has AVX2) and their SSE2/scalar code: the same results."""
    if not kernels.available():
        pytest.skip("native kernels not built")
    with simd_code(request.param == "avx2"):
        yield


@native
def test_native_binning_is_torch_histc_bit_for_bit(simd: None) -> None:
    done = 0
    for x, bins, lo, hi in _histc_cases(seed=3, trials=240):
        expected = torch.histc(x, bins, min=lo, max=hi)
        binning = LinearBinning.make(bins, lo, hi)
        if binning is None:
            continue
        out = torch.full((bins,), -1.0)
        binning.count_into(x, out)
        assert torch.equal(out, expected), (bins, lo, hi)
        given = torch.full((bins,), -1.0)  # told the extremes: only their bins are counted
        binning.count_into(x, given, extremes=kernels.minmax(x) or (lo, hi))
        assert torch.equal(given, expected), (bins, lo, hi)
        start = torch.rand(bins) * 1000  # accumulating rounds as torch's float32 add does
        accumulated = start.clone()
        binning.count_into(x, accumulated, accumulate=True)
        assert torch.equal(accumulated, start + expected), (bins, lo, hi)
        with kernels.disabled():  # and the torch path agrees
            torch_path = start.clone()
            binning.count_into(x, torch_path, accumulate=True)
        assert torch.equal(torch_path, accumulated)
        done += 1
    assert done > 150


@pytest.mark.parametrize("path", ["native", "torch"])
def test_histc_and_add_histc_are_torch_histc(path: str) -> None:
    if path == "native" and not kernels.available():
        pytest.skip("native kernels not built")
    for x, bins, lo, hi in _histc_cases(seed=4, trials=80):
        expected = torch.histc(x, bins, min=lo, max=hi)
        with kernels.disabled() if path == "torch" else contextlib.nullcontext():
            assert torch.equal(histc(x, bins, lo, hi), expected)
            out = torch.ones(bins, dtype=torch.float64)  # off the fast path: torch.histc's counts
            add_histc(out, x, lo, hi)
            assert torch.equal(out, expected.double() + 1)


def test_quantplug_histogram_observer_state_is_the_same_on_both_paths() -> None:
    if not kernels.available():
        pytest.skip("native kernels not built")
    from _quantplug.observers.histogram import HistogramObserver

    g = torch.Generator().manual_seed(6)
    for trial in range(30):
        observers = (
            HistogramObserver(bins=[2048, 300, 16][trial % 3]),
            HistogramObserver(bins=[2048, 300, 16][trial % 3]),
        )
        for o in observers:
            o.nonfinite = "ignore"  # the inf below is left out (and counted), on both paths alike
        for batch in range(1 + trial % 5):
            x = torch.randn(int(torch.randint(1, 5000, (1,), generator=g)), generator=g) * (1 + batch) ** 2
            if trial % 4 == 1:
                x = x.relu()  # a zero minimum: torch's aminmax decides its sign
            elif trial % 4 == 2 and batch:
                x[0] = float("inf")
            elif trial % 4 == 3:
                x = x.reshape(-1, 1).expand(-1, 2)
            observers[0](x)
            with kernels.disabled():
                observers[1](x)
            native, torch_path = (o.state_dict() for o in observers)
            for key, value in native.items():
                assert torch.equal(value, torch_path[key]), (trial, batch, key)
            assert observers[0].nonfinite_ignored == observers[1].nonfinite_ignored


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return (
        sa.keys() == sb.keys()
        and all(torch.equal(sa[k], sb[k]) for k in sa)
        and int(a.num_batches) == int(b.num_batches)
    )


def _counting_native_steps(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call of the histogram observer's native steps (a first batch's, a batch's
    within the range) counted its batch."""
    done: list[bool] = []
    step, start = kernels.observe_histogram, kernels.start_histogram

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        found = step(*args, **kwargs)
        done.append(found is None)
        return found

    def starting(*args, **kwargs):  # type: ignore[no-untyped-def]
        found = start(*args, **kwargs)
        if found is not None:  # None: the kernels are off or cannot read the batch
            done.append(len(found) == 5)
        return found

    monkeypatch.setattr(kernels, "observe_histogram", counting)
    monkeypatch.setattr(kernels, "start_histogram", starting)
    return done


LAYOUTS = ("contiguous", "transposed", "rows", "head", "strided", "float64", "nan")


@native
@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(LAYOUTS), st.floats(0.05, 4.0), st.integers(1, 3000)),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 2**16),
    st.sampled_from([2048, 300, 16]),
)
def test_native_steps_end_in_the_general_paths_state(
    batches: list[tuple[str, float, int]], seed: int, bins: int
) -> None:
    """First batches, batches within the range, wider ones, and what the step leaves to the general
    path (views it cannot read, other dtypes, NaN): after each, the state of the torch path."""
    from _quantplug.observers.histogram import HistogramObserver

    native_obs, torch_obs = HistogramObserver(bins=bins), HistogramObserver(bins=bins)
    for o in (native_obs, torch_obs):
        o.nonfinite = "ignore"
    g = torch.Generator().manual_seed(seed)
    for layout, scale, n in batches:
        x = torch.randn(n, 2, generator=g) * scale
        if layout == "transposed":
            x = x.t()
        elif layout == "rows":  # rows of 3 contiguous values, 7 apart: read in place
            x = (torch.randn(n, 7, generator=g) * scale)[:, 2:5]
        elif layout == "head":  # an attention head split from a projection, transposed
            x = (torch.randn(1, n, 12, generator=g) * scale)[..., 4:8].reshape(1, n, 2, 2).transpose(1, 2)
        elif layout == "strided":  # every other value: the general path's copy
            x = x[:, :1]
        elif layout == "float64":
            x = x.double()
        elif layout == "nan":
            x[0, 0] = float("nan")
        native_obs(x)
        with kernels.disabled():
            torch_obs(x)
        assert _same_state(native_obs, torch_obs), (layout, scale, n)
    assert getattr(native_obs, "nonfinite_ignored", 0) == getattr(torch_obs, "nonfinite_ignored", 0)


@native
def test_batches_within_the_range_are_counted_by_the_native_step(
    simd: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from _quantplug.observers.histogram import HistogramObserver

    done = _counting_native_steps(monkeypatch)
    native_obs, torch_obs = HistogramObserver(), HistogramObserver()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(64, 256, generator=g) * s for s in (4.0, 1.0, 0.5, 2.0, 8.0, 1.0)]
    batches.append(batches[1].relu())  # a zero minimum: inside the range, counted natively too
    projection = torch.randn(1, 64, 768, generator=g)
    head = projection[..., 256:512]  # rows of 256 values, 768 apart
    batches += [head, head.reshape(1, 64, 4, 64).transpose(1, 2), projection.transpose(1, 2)]
    for x in batches:
        native_obs(x)
        with kernels.disabled():
            torch_obs(x)
        assert _same_state(native_obs, torch_obs)
    # the first batch starts the range natively, the 8x one widens it (the general path)
    assert done == [True, True, True, True, False, True, True, True, True, True]


@native
@pytest.mark.parametrize("move", ["fill", "load_state_dict", "merge", "double", "new_buffer"])
def test_the_native_step_follows_state_moved_under_it(move: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A range or buffers changed outside forward (a fill_, a checkpoint, a merge of ranks,
    ``.double()``, a buffer assigned): the step declines, the general path counts, and the state
    is the torch path's."""
    from _quantplug.observers.histogram import HistogramObserver

    g = torch.Generator().manual_seed(4)
    native_obs = HistogramObserver(bins=256)
    native_obs(torch.randn(4096, generator=g))
    torch_obs = copy.deepcopy(native_obs)
    other = HistogramObserver(bins=256)
    other(torch.randn(4096, generator=g) * 3)
    for o in (native_obs, torch_obs):
        if move == "fill":
            o.max_val.fill_(float(o.max_val) * 2)
        elif move == "load_state_dict":
            o.load_state_dict(other.state_dict())
        elif move == "merge":
            o.merge_([other])
        elif move == "double":
            o.double()
        else:
            o.histogram = o.histogram.clone()
    done = _counting_native_steps(monkeypatch)
    x = torch.randn(4096, generator=g) * 0.5
    native_obs(x)
    with kernels.disabled():
        torch_obs(x)
    assert _same_state(native_obs, torch_obs)
    assert done == ([] if move in ("double", "new_buffer") else [False])  # declined, or not tried
    native_obs(x)  # the step the general path made again
    with kernels.disabled():
        torch_obs(x)
    assert _same_state(native_obs, torch_obs)
    assert done[-1:] == ([] if move == "double" else [True])  # float64 buffers: never the step


EDGE_VALUES = st.sampled_from(
    [0.0, -0.0, math.inf, -math.inf, math.nan, -1000.0, -999.99994, 3.4e38, -3.4e38]
)


@native
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(FLOAT32, FLOAT32, EDGE_VALUES), min_size=1, max_size=80),
    st.sampled_from([2048, 300, 16, 7, 1]),
    st.sampled_from([-math.inf, -1000.0]),
    st.integers(0, 3),
    st.booleans(),
)
@example(values=[-1000.0, 5.0], bins=16, floor=-1000.0, offset=0, avx2=True)  # at the floor: declined
@example(values=[-999.99994, 5.0], bins=16, floor=-1000.0, offset=0, avx2=True)  # above it: counted
def test_start_is_the_first_batch_torch_would_count(
    values: list[float], bins: int, floor: float, offset: int, avx2: bool
) -> None:
    """A first batch in one native call: the counts torch.histc gives over the batch's own range,
    with that range and LinearBinning's operands, or (nothing written) the batch's extremes
    where torch decides (a zero extreme) or the general path must (NaN, infinities, an empty
    range, values at or below ``floor``)."""
    from _quantplug.observers import _histogram_kernels as raw

    x = torch.tensor([0.0] * offset + values, dtype=torch.float32)[offset:]  # any alignment
    buffers = (torch.full((bins,), -1.0), torch.tensor(math.inf), torch.tensor(-math.inf), torch.tensor(5))
    with simd_code(avx2):
        found = kernels.start_histogram(x, bins, floor, *buffers)
    histogram, min_val, max_val, num_batches = buffers
    assert found is not None
    extremes = raw.minmax(x.data_ptr(), x.numel())
    lo, hi = extremes
    binning = LinearBinning.make(bins, lo, hi)
    if lo == 0.0 or hi == 0.0 or not lo > floor or binning is None:
        assert len(found) == 2
        assert found == extremes or (math.isnan(found[0]) and math.isnan(extremes[0]))
        assert torch.equal(histogram, torch.full((bins,), -1.0)) and int(num_batches) == 5
        assert float(min_val) == math.inf and float(max_val) == -math.inf
        return
    scale = 0.0 if binning.scale is None else float(binning.scale)
    assert found == (lo, hi, scale, binning.divisor, bins)
    assert (lo, hi) == tuple(torch.stack(list(torch.aminmax(x))).tolist())
    assert torch.equal(histogram, torch.histc(x, bins, min=lo, max=hi))
    assert (float(min_val), float(max_val), int(num_batches)) == (lo, hi, 6)
    # a range already held: declined, nothing written
    again = histogram.clone()
    assert kernels.start_histogram(x, bins, floor, *buffers) == (lo, hi)
    assert torch.equal(histogram, again) and int(num_batches) == 6


#: where the native step's range comes from: the values' own extremes (every value in range),
#: wider (an observer whose range grew), or narrower (declined: nothing written)
RANGES = st.sampled_from(["own", "wider", "narrower"])


@native
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(FLOAT32, FLOAT32, FLOAT32, EDGE_VALUES), min_size=1, max_size=90),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(0, 5),
    st.sampled_from([2048, 300, 16, 7, 1]),
    RANGES,
    st.none() | st.integers(0, 300),
    st.booleans(),
)
@example(values=[1.0, 2.0] * 20, repeat=1, rows=2, gap=3, bins=16, source="own", nan_at=None, avx2=True)
@example(values=[1.0, 2.0] * 20, repeat=1, rows=1, gap=0, bins=16, source="own", nan_at=0, avx2=True)
@example(values=[1.0, 2.0] * 20, repeat=1, rows=2, gap=1, bins=300, source="own", nan_at=39, avx2=False)
def test_observe_is_torch_histc_added_or_declined(
    values: list[float],
    repeat: int,
    rows: int,
    gap: int,
    bins: int,
    source: str,
    nan_at: int | None,
    avx2: bool,
) -> None:
    """The native step of a batch within the range, on its AVX2 (one pass: binning, counting and
    min/max of 32 values at a time, then 8, then one) and scalar code, rows of values with NaN
    between them: torch.histc's counts added to the histogram as torch's float32 add rounds
    them and one batch more, or, with a value outside the range or a NaN, nothing written and
    the values' extremes returned (NaN, NaN with a NaN)."""
    from _quantplug.observers import _histogram_kernels as raw

    n = len(values) * repeat
    row = torch.tensor(values * repeat, dtype=torch.float32)
    stride = n + gap
    base = torch.full((rows * stride + 3,), math.nan)  # the gaps hold NaN: read, they would show
    view = base[3:].as_strided((rows, n), (stride, 1))  # rows of n values, stride apart, unaligned
    for r in range(rows):
        view[r] = row * (r + 1) if math.isfinite(float(row.abs().max())) else row
    if nan_at is not None:  # anywhere in a row: its 32-value part, its 8-value part or its last ones
        view[nan_at % rows, nan_at % n] = math.nan
    batch = view.clone()
    finite = batch[torch.isfinite(batch)]  # the range is made of these
    if finite.numel() == 0:
        return
    lo, hi = (float(v) for v in torch.aminmax(finite))
    if source == "wider":
        lo, hi = float(torch.tensor(lo - abs(lo) - 1.0)), float(torch.tensor(hi + abs(hi) * 0.5 + 1.0))
    elif source == "narrower":
        hi = float(torch.tensor(hi - abs(hi - lo) * 0.25)) if hi > lo else hi
    binning = LinearBinning.make(bins, lo, hi)
    if binning is None:
        return
    scale = 0.0 if binning.scale is None else float(binning.scale)
    start = torch.floor(torch.rand(bins) * 1000) + 0.5  # added to as torch's float32 add does
    buffers = (start.clone(), torch.tensor(lo), torch.tensor(hi), torch.tensor(5))
    with simd_code(avx2):
        operands = (lo, hi, scale, binning.divisor, bins)
        found = raw.observe(view.data_ptr(), n, rows, stride, *operands, *(t.data_ptr() for t in buffers))
    histogram, _, _, num_batches = buffers
    low, high = (float(v) for v in torch.aminmax(batch))
    if math.isnan(low) or not (lo <= low and high <= hi):
        assert found is not None
        assert (math.isnan(found[0]) and math.isnan(low)) or found == (low, high)
        assert torch.equal(histogram, start) and int(num_batches) == 5
        return
    assert found is None
    assert torch.equal(histogram, start + torch.histc(batch, bins, min=lo, max=hi))
    assert int(num_batches) == 6


@native
@settings(max_examples=200, deadline=None)
@given(
    st.lists(FLOAT32, min_size=1, max_size=90),
    st.integers(1, 4),
    st.sampled_from([2048, 300, 16, 7, 1]),
    st.booleans(),
    st.booleans(),
)
def test_bin_counts_of_the_values_range_is_torch_histc(
    values: list[float], repeat: int, bins: int, known: bool, avx2: bool
) -> None:
    """bin_counts over the values' own range (the bins between their extremes' only), on its
    AVX2 (one pass) and scalar code: torch.histc's counts, set or added."""
    from _quantplug.observers import _histogram_kernels as raw

    x = torch.tensor(values * repeat, dtype=torch.float32)
    lo, hi = (float(v) for v in torch.aminmax(x))
    binning = LinearBinning.make(bins, lo, hi)
    if binning is None:
        return
    scale = 0.0 if binning.scale is None else float(binning.scale)
    out = torch.full((bins,), -1.0)
    extremes = (lo, hi) if known else ()
    operands = (x.data_ptr(), x.numel(), lo, scale, binning.divisor, bins)
    with simd_code(avx2):
        raw.bin_counts(*operands, out.data_ptr(), False, *extremes)
        added = torch.full((bins,), 3.0)
        raw.bin_counts(*operands, added.data_ptr(), True, *extremes)
    expected = torch.histc(x, bins, min=lo, max=hi)
    assert torch.equal(out, expected)
    assert torch.equal(added, expected + 3.0)


@native
def test_start_declines_what_it_cannot_read_and_rejects_bad_arguments() -> None:
    from _quantplug.observers import _histogram_kernels as raw

    buffers = (torch.zeros(16), torch.tensor(math.inf), torch.tensor(-math.inf), torch.tensor(0))
    x = torch.rand(64, 4) + 1.0
    assert kernels.start_histogram(x[:, :2], 16, -math.inf, *buffers) is None  # not contiguous
    assert kernels.start_histogram(x.double(), 16, -math.inf, *buffers) is None
    assert kernels.start_histogram(torch.empty(0), 16, -math.inf, *buffers) is None
    with kernels.disabled():
        assert kernels.start_histogram(x, 16, -math.inf, *buffers) is None
    assert int(buffers[3]) == 0
    addresses = [t.data_ptr() for t in buffers]
    with pytest.raises(TypeError, match="takes 8 arguments"):
        raw.start(x.data_ptr(), 256, 16, -1.0, *addresses[:3])
    with pytest.raises(ValueError, match="2\\*\\*24"):
        raw.start(x.data_ptr(), 1 << 24, 16, -1.0, *addresses)
    with pytest.raises(ValueError, match="non-null"):
        raw.start(x.data_ptr(), 256, 16, -1.0, 0, *addresses[1:])


def test_a_build_from_an_older_source_is_left_unused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-place build not redone after the C source gained an entry point: its calls differ,
    so kernels.py leaves it unused and the torch code paths run."""
    import importlib.util
    import types

    import _quantplug.observers as package

    old = types.ModuleType("_quantplug.observers._histogram_kernels")
    for name in ("minmax", "bin_counts", "rebin", "observe", "_use_avx2"):  # all but `start`
        setattr(old, name, lambda *args: None)
    monkeypatch.setitem(sys.modules, old.__name__, old)
    monkeypatch.setattr(package, "_histogram_kernels", old, raising=False)
    spec = importlib.util.spec_from_file_location("_kernels_over_an_old_build", kernels.__file__)
    assert spec is not None and spec.loader is not None
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert not fresh.available() and not fresh.enabled()
    x = torch.rand(64) + 1.0
    assert fresh.minmax(x) is None
    assert fresh.start_histogram(x, 16, -math.inf, torch.zeros(16), *torch.zeros(3)) is None
    old.start = lambda *args: None  # type: ignore[attr-defined]  # the current source's entry points: used
    spec.loader.exec_module(fresh)
    assert fresh.available()


@native
@pytest.mark.parametrize(
    "before", ["nothing", "fresh_copy", "deepcopy", "load_state_dict", "double", "new_buffer"]
)
def test_a_first_batch_after_copies_and_moves(before: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step an observer makes with its buffers serves its first batch only while they are the
    same tensors; a copy's is bound to the copy's buffers (never writing the original's); a
    checkpoint loaded first leaves the batch to the general path. The state is the torch path's."""
    from _quantplug.observers.copies import fresh_copy
    from _quantplug.observers.histogram import HistogramObserver

    g = torch.Generator().manual_seed(5)
    loaded = HistogramObserver(bins=64)
    loaded(torch.randn(500, generator=g) * 3)
    made = HistogramObserver(bins=64)
    pristine = copy.deepcopy(made.state_dict())

    def moved(o: HistogramObserver) -> HistogramObserver:
        if before == "fresh_copy":
            return fresh_copy(o)  # type: ignore[return-value]
        if before == "deepcopy":
            return copy.deepcopy(o)
        if before == "load_state_dict":
            o.load_state_dict(loaded.state_dict())
        elif before == "double":
            o.double()
        elif before == "new_buffer":
            o.histogram = o.histogram.clone()
        return o

    native_obs, torch_obs = moved(made), moved(HistogramObserver(bins=64))
    if before in ("nothing", "fresh_copy"):  # prepare's observers are fresh copies: their own step
        assert native_obs.__dict__[kernels.STEP_ATTR].serves(native_obs._buffers)
    done = _counting_native_steps(monkeypatch)
    x = torch.randn(3000, generator=g)
    native_obs(x)
    with kernels.disabled():
        torch_obs(x)
    assert _same_state(native_obs, torch_obs)
    assert int(native_obs.num_batches) == 1
    counted_natively = before in ("nothing", "fresh_copy", "deepcopy", "new_buffer")
    assert done == ([True] if counted_natively else [False] if before == "load_state_dict" else [])
    if before in ("fresh_copy", "deepcopy"):
        assert all(torch.equal(made.state_dict()[k], v) for k, v in pristine.items())
