"""Histogram (MSE / percentile) and per-block observers on real data, no mocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _quantplug.errors import AnnotationError, NonFiniteError
from _quantplug.observers.histogram import HistogramObserver, rebin_histogram
from _quantplug.observers.minmax import MinMaxObserver
from _quantplug.observers.per_block import (
    PerBlockMinMaxObserver,
    block_grid_shape,
    dequantize_per_block,
    expand_block_param,
    quantize_per_block,
)


def _recon_mse(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int) -> float:
    q = torch.clamp(torch.round(x / scale) + zero_point, qmin, qmax)
    return float(((q - zero_point) * scale - x).pow(2).mean())


def _gaussian_with_outliers(seed: int = 0, n: int = 100_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[:3] = torch.tensor([40.0, -35.0, 60.0])
    return x


# ---------------------------------------------------------------- histogram observer


@pytest.mark.parametrize(
    ("dtype", "qscheme"),
    [
        (torch.uint8, torch.per_tensor_affine),
        (torch.int8, torch.per_tensor_symmetric),
        (torch.uint8, torch.per_tensor_symmetric),
        (torch.int4, torch.per_tensor_symmetric),
    ],
)
def test_mse_beats_minmax_on_outliers(dtype: torch.dtype, qscheme: torch.qscheme) -> None:
    x = _gaussian_with_outliers()
    hist = HistogramObserver(dtype=dtype, qscheme=qscheme)
    minmax = MinMaxObserver(dtype=dtype, qscheme=qscheme)
    hist(x)
    minmax(x)
    s_h, z_h = hist.calculate_qparams()
    s_m, z_m = minmax.calculate_qparams()
    assert s_h.shape == (1,) and z_h.shape == (1,)
    assert s_h.dtype == torch.float32 and not z_h.dtype.is_floating_point
    err_h = _recon_mse(x, s_h, z_h, hist.quant_min, hist.quant_max)
    err_m = _recon_mse(x, s_m, z_m, hist.quant_min, hist.quant_max)
    assert s_h.item() < s_m.item()
    assert err_h < 0.9 * err_m


def test_mse_matches_minmax_on_uniform_data() -> None:
    # uniform data has no tail worth clipping: the chosen range should stay close to the extremes
    x = torch.linspace(-2.0, 3.0, 50_001)
    hist = HistogramObserver(dtype=torch.int8, qscheme=torch.per_tensor_affine)
    hist(x)
    lo, hi = hist.clip_range()
    assert lo == pytest.approx(-2.0, rel=0.02)
    assert hi == pytest.approx(3.0, rel=0.02)


@pytest.mark.parametrize(
    ("dtype", "qscheme"), [(torch.uint16, torch.per_tensor_affine), (torch.int16, torch.per_tensor_symmetric)]
)
def test_uint16_and_int16(dtype: torch.dtype, qscheme: torch.qscheme) -> None:
    x = _gaussian_with_outliers(2)
    obs = HistogramObserver(dtype=dtype, qscheme=qscheme)
    ref = MinMaxObserver(dtype=dtype, qscheme=qscheme)
    obs(x)
    ref(x)
    scale, zp = obs.calculate_qparams()
    s_ref, z_ref = ref.calculate_qparams()
    assert obs.quant_max - obs.quant_min == 65535
    assert obs.quant_min <= int(zp) <= obs.quant_max
    if qscheme == torch.per_tensor_symmetric:
        assert int(zp) == 0
    err = _recon_mse(x, scale, zp, obs.quant_min, obs.quant_max)
    # with 65536 levels clipping rarely pays off: never worse than min-max beyond noise
    assert err <= _recon_mse(x, s_ref, z_ref, obs.quant_min, obs.quant_max) * 1.01
    assert err < 1e-5


def test_percentile_clips_tails() -> None:
    x = _gaussian_with_outliers(3, n=200_000)
    obs = HistogramObserver(
        method="percentile", percentile=99.9, dtype=torch.int8, qscheme=torch.per_tensor_affine
    )
    obs(x)
    lo, hi = obs.clip_range()
    ref = torch.quantile(x, torch.tensor([0.001, 0.999], dtype=x.dtype))
    assert lo == pytest.approx(float(ref[0]), abs=0.1)
    assert hi == pytest.approx(float(ref[1]), abs=0.1)
    scale, _ = obs.calculate_qparams()
    minmax = MinMaxObserver(dtype=torch.int8, qscheme=torch.per_tensor_affine)
    minmax(x)
    assert scale.item() < minmax.calculate_qparams()[0].item() / 10


def test_percentile_100_is_minmax() -> None:
    x = _gaussian_with_outliers(4)
    obs = HistogramObserver(method="percentile", percentile=100.0)
    obs(x)
    ref = MinMaxObserver()
    ref(x)
    assert torch.allclose(obs.calculate_qparams()[0], ref.calculate_qparams()[0], rtol=1e-5)


@pytest.mark.parametrize("method", ["mse", "percentile"])
@pytest.mark.parametrize(
    ("dtype", "qscheme"),
    [
        (torch.uint8, torch.per_tensor_affine),
        (torch.int8, torch.per_tensor_symmetric),
        (torch.uint16, torch.per_tensor_affine),
    ],
)
def test_rebinning_matches_single_pass(method: str, dtype: torch.dtype, qscheme: torch.qscheme) -> None:
    g = torch.Generator().manual_seed(5)
    first = torch.randn(100_000, generator=g)
    second = torch.randn(100_000, generator=g) * 3.0 + 1.0  # wider on both sides: range grows
    second[:4] = torch.tensor([12.0, -9.0, 10.5, -11.0])
    split = HistogramObserver(method=method, percentile=99.9, dtype=dtype, qscheme=qscheme)
    split(first)
    split(second)
    whole = HistogramObserver(method=method, percentile=99.9, dtype=dtype, qscheme=qscheme)
    whole(torch.cat([first, second]))
    assert float(split.min_val) == float(whole.min_val)
    assert float(split.max_val) == float(whole.max_val)
    assert float(split.histogram.sum()) == pytest.approx(200_000, rel=1e-6)
    s_split, z_split = split.calculate_qparams()
    s_whole, z_whole = whole.calculate_qparams()
    assert s_split.item() == pytest.approx(s_whole.item(), rel=0.01)
    # the zero point is where the grid starts: compare its real-valued offset, within 1% of the range
    off_split = (split.quant_min - z_split.item()) * s_split.item()
    off_whole = (whole.quant_min - z_whole.item()) * s_whole.item()
    assert off_split == pytest.approx(off_whole, abs=0.01 * (float(whole.max_val) - float(whole.min_val)))


def test_rebin_conserves_mass_and_location() -> None:
    hist = torch.zeros(8)
    hist[2] = 10.0  # mass on [2, 3) of the range [0, 8)
    out = rebin_histogram(hist, 0.0, 8.0, -8.0, 8.0)  # bins of width 2 on [-8, 8)
    assert float(out.sum()) == pytest.approx(10.0)
    assert int(out.argmax()) == 5  # [2, 4)
    point = rebin_histogram(torch.tensor([4.0, 0.0, 0.0, 0.0]), 1.5, 1.5, 0.0, 4.0)
    assert point.tolist() == [0.0, 4.0, 0.0, 0.0]


def test_many_growing_batches_track_single_pass() -> None:
    g = torch.Generator().manual_seed(6)
    chunks = [torch.randn(20_000, generator=g) * (1.0 + 0.2 * i) for i in range(20)]
    split = HistogramObserver(dtype=torch.int8, qscheme=torch.per_tensor_symmetric)
    for c in chunks:
        split(c)
    whole = HistogramObserver(dtype=torch.int8, qscheme=torch.per_tensor_symmetric)
    whole(torch.cat(chunks))
    assert int(split.num_batches) == 20
    assert split.calculate_qparams()[0].item() == pytest.approx(whole.calculate_qparams()[0].item(), rel=0.01)


def test_constant_zero_and_empty_tensors() -> None:
    const = HistogramObserver()
    const(torch.full((4, 4), 3.0))
    ref = MinMaxObserver()
    ref(torch.full((4, 4), 3.0))
    s, z = const.calculate_qparams()
    s_ref, z_ref = ref.calculate_qparams()
    assert torch.equal(s, s_ref) and torch.equal(z, z_ref)
    # the constant then grows into a range: the point mass survives re-binning
    const(torch.tensor([-1.0, 5.0]))
    assert float(const.histogram.sum()) == pytest.approx(18.0)
    s, z = const.calculate_qparams()
    assert torch.isfinite(s).all() and s.item() > 0

    zeros = HistogramObserver(dtype=torch.int8, qscheme=torch.per_tensor_symmetric)
    zeros(torch.zeros(100))
    s, z = zeros.calculate_qparams()
    assert s.item() == pytest.approx(zeros.eps) and int(z) == 0

    empty = HistogramObserver()
    empty(torch.empty(0, 3))
    assert not empty.observed
    assert int(empty.num_batches) == 0
    empty(torch.randn(10))
    assert empty.observed


def test_non_finite_values_raise_or_are_ignored_and_counted() -> None:
    batch = torch.tensor([1.0, float("inf"), -2.0, float("nan"), float("-inf")])
    with pytest.raises(NonFiniteError, match=r"1 NaN and 2 inf value\(s\)"):
        HistogramObserver()(batch)
    obs = HistogramObserver()
    obs.nonfinite = "ignore"
    obs(batch)
    assert float(obs.min_val) == -2.0 and float(obs.max_val) == 1.0
    assert float(obs.histogram.sum()) == 2.0
    assert obs.nonfinite_ignored == 3


def test_forward_returns_input_and_state_dict_round_trips() -> None:
    x = _gaussian_with_outliers(7, n=5_000)
    obs = HistogramObserver(bins=256)
    assert obs(x) is x
    clone = HistogramObserver(bins=256)
    clone.load_state_dict(obs.state_dict())
    assert torch.equal(clone.histogram, obs.histogram)
    assert torch.equal(clone.calculate_qparams()[0], obs.calculate_qparams()[0])


def test_bad_histogram_options() -> None:
    with pytest.raises(AnnotationError, match="method"):
        HistogramObserver(method="kl")
    with pytest.raises(AnnotationError, match="percentile"):
        HistogramObserver(method="percentile", percentile=10.0)
    with pytest.raises(AnnotationError, match="per-tensor"):
        HistogramObserver(qscheme=torch.per_channel_symmetric)


def test_with_args_factory() -> None:
    obs = HistogramObserver.with_args(method="percentile", percentile=99.0)(dtype=torch.int8)
    assert isinstance(obs, HistogramObserver)
    assert obs.method == "percentile" and obs.dtype == torch.int8


# ---------------------------------------------------------------- per-block observer


def test_per_block_linear_weight_round_trip() -> None:
    g = torch.Generator().manual_seed(8)
    w = torch.randn(8, 256, generator=g)
    obs = PerBlockMinMaxObserver(block_size=(1, 64), dtype=torch.int4)
    obs(w)
    scale, zp = obs.calculate_qparams()
    assert scale.shape == (8, 4) and zp.shape == (8, 4)
    assert torch.equal(zp, torch.zeros_like(zp))
    expected = w.reshape(8, 4, 64).abs().amax(dim=-1) / ((obs.quant_max - obs.quant_min) / 2)
    assert torch.allclose(scale, expected)
    q = quantize_per_block(w, scale, zp, (1, 64), obs.quant_min, obs.quant_max, torch.int4)
    assert q.dtype == torch.int8
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    dq = dequantize_per_block(q, scale, zp, (1, 64))
    full_scale = expand_block_param(scale, (1, 64), w.shape)
    assert ((dq - w).abs() <= full_scale / 2 + 1e-6).all()
    fq = obs.fake_quantize(w)
    assert torch.allclose(fq, dq)


def test_per_block_conv_weight_and_whole_dims() -> None:
    g = torch.Generator().manual_seed(9)
    w = torch.randn(4, 32, 3, 3, generator=g)
    obs = PerBlockMinMaxObserver(block_size=(1, 16, -1, 99), dtype=torch.int8)
    obs(w)
    scale, zp = obs.calculate_qparams()
    assert scale.shape == (4, 2, 1, 1)
    assert block_grid_shape((1, 16, -1, 99), w.shape) == (4, 2, 1, 1)
    q = quantize_per_block(w, scale, zp, (1, 16, -1, 99), obs.quant_min, obs.quant_max, torch.int8)
    dq = dequantize_per_block(q, scale, zp, (1, 16, -1, 99))
    assert ((dq - w).abs() <= expand_block_param(scale, (1, 16, -1, 99), w.shape) / 2 + 1e-6).all()


def test_per_block_affine_uint8_and_running_extremes() -> None:
    g = torch.Generator().manual_seed(10)
    a = torch.rand(4, 32, generator=g)
    b = torch.rand(4, 32, generator=g) * 2.0 - 0.5
    obs = PerBlockMinMaxObserver(block_size=(2, 8), dtype=torch.uint8, qscheme=torch.per_channel_affine)
    obs(a)
    obs(b)
    assert int(obs.num_batches) == 2 and obs.observed
    both = torch.stack([a, b]).reshape(2, 2, 2, 4, 8)
    assert torch.equal(obs.min_val, both.amin(dim=(0, 2, 4)))
    assert torch.equal(obs.max_val, both.amax(dim=(0, 2, 4)))
    scale, zp = obs.calculate_qparams()
    q = quantize_per_block(b, scale, zp, (2, 8), obs.quant_min, obs.quant_max, torch.uint8)
    assert q.dtype == torch.uint8
    dq = dequantize_per_block(q, scale, zp, (2, 8), out_dtype=torch.float64)
    assert dq.dtype == torch.float64
    assert ((dq - b).abs() <= expand_block_param(scale, (2, 8), b.shape) / 2 + 1e-5).all()


def test_per_block_uint16_storage() -> None:
    w = torch.linspace(-1.0, 1.0, 64).reshape(2, 32)
    obs = PerBlockMinMaxObserver(block_size=(1, 16), dtype=torch.uint16)
    obs(w)
    scale, zp = obs.calculate_qparams()
    assert torch.equal(zp, torch.full_like(zp, 32768))
    q = quantize_per_block(w, scale, zp, (1, 16), obs.quant_min, obs.quant_max, torch.uint16)
    assert q.dtype == torch.uint16
    dq = dequantize_per_block(q, scale, zp, (1, 16))
    assert ((dq - w).abs() <= expand_block_param(scale, (1, 16), w.shape) / 2 + 1e-6).all()


def test_bad_block_size_names_shapes_and_dims() -> None:
    obs = PerBlockMinMaxObserver(block_size=(1, 48), dtype=torch.int4)
    with pytest.raises(AnnotationError) as info:
        obs(torch.randn(8, 100))
    message = str(info.value)
    assert "(1, 48)" in message and "(8, 100)" in message and "dim(s) [1]" in message
    with pytest.raises(AnnotationError, match=r"\(1, 16\).*\(4, 16, 3\)"):
        PerBlockMinMaxObserver(block_size=(1, 16))(torch.randn(4, 16, 3))
    with pytest.raises(AnnotationError, match="block_size"):
        PerBlockMinMaxObserver(block_size=(1, 0))
    with pytest.raises(AnnotationError, match="block grid"):
        expand_block_param(torch.ones(3, 3), (1, 4), (4, 8))


def test_expand_block_param_is_repeat_interleave() -> None:
    param = torch.arange(6.0).reshape(2, 3)
    out = expand_block_param(param, (2, 4), (4, 12))
    assert torch.equal(out, param.repeat_interleave(2, dim=0).repeat_interleave(4, dim=1))


def test_per_block_fake_quantize_straight_through() -> None:
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(11))
    obs = PerBlockMinMaxObserver(block_size=(1, 8), dtype=torch.int4)
    obs(w)
    w_req = w.clone().requires_grad_(True)
    out = obs.fake_quantize(w_req)
    out.sum().backward()
    assert w_req.grad is not None
    # identity gradient on the grid, zero where clamped: a symmetric signed grid [-8, 7] with
    # scale max|w| / 7.5 clamps only each block's largest positive magnitude (it maps to 7.5)
    u = w / expand_block_param(obs.calculate_qparams()[0], (1, 8), w.shape)
    inside = (u >= obs.quant_min) & (u <= obs.quant_max)
    assert torch.equal(w_req.grad, inside.float())
    assert int((~inside).sum()) <= 16  # at most one per block
    assert inside.float().mean() > 0.9


@settings(max_examples=40, deadline=None)
@given(
    out_blocks=st.integers(1, 4),
    in_blocks=st.integers(1, 4),
    block_out=st.sampled_from([1, 2]),
    block_in=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.int4, torch.int8, torch.uint8, torch.int16]),
    symmetric=st.booleans(),
    log_scale=st.floats(-6.0, 6.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_per_block_error_is_at_most_half_a_step(
    out_blocks: int,
    in_blocks: int,
    block_out: int,
    block_in: int,
    dtype: torch.dtype,
    symmetric: bool,
    log_scale: float,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    shape = (out_blocks * block_out, in_blocks * block_in)
    x = (torch.randn(shape, generator=g) + torch.randn((), generator=g)) * (10.0**log_scale)
    block = (block_out, block_in)
    qscheme = torch.per_channel_symmetric if symmetric else torch.per_channel_affine
    obs = PerBlockMinMaxObserver(block_size=block, dtype=dtype, qscheme=qscheme)
    obs(x)
    scale, zp = obs.calculate_qparams()
    assert scale.shape == (out_blocks, in_blocks)
    q = quantize_per_block(x, scale, zp, block, obs.quant_min, obs.quant_max, dtype)
    dq = dequantize_per_block(q, scale, zp, block)
    step = expand_block_param(scale, block, shape)
    # float32 rounding of x / scale and of (q - zp) * scale can land a hair past the half step
    slack = (obs.quant_max - obs.quant_min) * 2.0**-21
    assert ((dq - x).abs() <= step * (0.5 + slack)).all()
    assert torch.allclose(obs.fake_quantize(x), dq, rtol=0, atol=float(step.max()) * slack)


@settings(max_examples=40, deadline=None)
@given(
    margin=st.floats(1.0, 16.0),
    lo=st.floats(-100.0, 0.0),
    hi=st.floats(0.01, 100.0),
    symmetric=st.booleans(),
)
def test_a_range_margin_is_the_observed_range_widened(
    margin: float, lo: float, hi: float, symmetric: bool
) -> None:
    """``range_margin=k`` gives exactly the qparams of the range ``k`` times as wide (both ends
    scaled away from zero); ``k = 1`` is the observer as it was."""
    qscheme = torch.per_tensor_symmetric if symmetric else torch.per_tensor_affine
    x = torch.tensor([lo, hi, 0.5 * (lo + hi)])
    widened = MinMaxObserver(dtype=torch.uint16, qscheme=qscheme, range_margin=margin)
    widened(x)
    plain = MinMaxObserver(dtype=torch.uint16, qscheme=qscheme)
    plain(x * margin)
    assert [torch.equal(a, b) for a, b in zip(widened.calculate_qparams(), plain.calculate_qparams())] == [
        True
    ] * 2


@pytest.mark.parametrize("margin", [0.5, float("inf"), float("nan")])
def test_a_range_margin_below_one_or_not_finite_is_refused(margin: float) -> None:
    from _quantplug.errors import OptionError

    with pytest.raises(OptionError, match="range_margin"):
        MinMaxObserver(range_margin=margin)
