"""The pure parts of AdaRound, SeqMSE and GPTQ: properties on small random problems (hypothesis).

Matrices come from a seeded generator (hypothesis draws the seed and the sizes), so shrinking
never produces exact rounding ties that would make "the same codes" ill-defined.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _quantplug.algorithms.gptq as gptq_module
import _quantplug.algorithms.seq_mse as seq_mse_module
from _quantplug.algorithms.adaround import AdaroundSchedule, adaround_codes, rectified_sigmoid
from _quantplug.algorithms.gptq import gptq_codes, gptq_scale_search, undampened_error
from _quantplug.algorithms.seq_mse import (
    Encoder,
    GroupCandidates,
    candidate_fractions,
    candidate_weight,
    expand_groups,
    factor_group_losses,
    group_loss_function,
    group_losses,
    group_view,
    insert_sorted,
    seq_mse_encoding,
)
from _quantplug.algorithms.weight_matrix import (
    HessianAccumulator,
    HessianFactors,
    IntegerGrid,
    column_groups,
    dampened,
    dequantize_codes,
    fake_quantize,
    from_matrix,
    hessian_factor,
    low_rank_factor,
    output_error,
    quantize_codes,
    same_bits,
    seeded_probes,
    shrunk_toward_diagonal,
    to_matrix,
)

GRIDS = st.sampled_from([IntegerGrid(-7, 7), IntegerGrid(-8, 7), IntegerGrid(0, 15), IntegerGrid(-127, 127)])
FAST = settings(max_examples=25, deadline=None)


def problem(seed: int, rows: int, cols: int, samples: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``[rows, cols]`` and the Hessian of correlated inputs (float64)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    mix = torch.randn(cols, cols, generator=g, dtype=torch.float64) * 0.5 + torch.eye(
        cols, dtype=torch.float64
    )
    x = torch.randn(samples, cols, generator=g, dtype=torch.float64) @ mix
    return w, x.T @ x / samples


def encoding(
    w: torch.Tensor, grid: IntegerGrid, groups: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max per scale group (symmetric for a signed grid), expanded to the matrix."""
    view = group_view(w, groups)
    if grid.quant_min < 0:
        amax = view.abs().amax(dim=(1, 3)).clamp(min=1e-8)
        return expand_groups(amax / ((grid.quant_max - grid.quant_min) / 2), groups), torch.zeros_like(w)
    lo, hi = view.amin(dim=(1, 3)).clamp(max=0), view.amax(dim=(1, 3)).clamp(min=0)
    scale = ((hi - lo) / (grid.quant_max - grid.quant_min)).clamp(min=1e-8)
    zero = torch.clamp(torch.round(grid.quant_min - lo / scale), grid.quant_min, grid.quant_max)
    return expand_groups(scale, groups), expand_groups(zero, groups)


def encoder(grid: IntegerGrid, groups: tuple[int, int]) -> Encoder:
    return lambda clipped: encoding(clipped, grid, groups)


def sequential_solve(
    w: torch.Tensor, h: torch.Tensor, s: torch.Tensor, z: torch.Tensor, grid: IntegerGrid
) -> torch.Tensor:
    """GPTQ's definition, computed directly: quantize column i, then re-solve for the columns
    after it the least-squares problem ``min ||(W - Ŵ) X||`` given the columns already fixed."""
    cols = w.shape[1]
    fixed = torch.zeros_like(w)
    codes = torch.zeros_like(w)
    for i in range(cols):
        f, r = slice(0, i), slice(i, cols)
        shift = torch.linalg.solve(h[r, r], h[f, r].T @ (w[:, f] - fixed[:, f]).T).T
        current = w[:, i] + shift[:, 0]
        codes[:, i] = quantize_codes(current, s[:, i], z[:, i], grid)
        fixed[:, i] = dequantize_codes(codes[:, i], s[:, i], z[:, i])
    return codes


@FAST
@given(st.integers(0, 2**31), st.integers(1, 6), st.integers(1, 9), GRIDS)
def test_gptq_matches_the_direct_least_squares_solve(
    seed: int, rows: int, cols: int, grid: IntegerGrid
) -> None:
    w, h = problem(seed, rows, cols)
    h = dampened(h, 0.01)
    s, z = encoding(w, grid, (1, cols))
    got = gptq_codes(w, h, s, z, grid, damp=0.0)
    expected = sequential_solve(w, h, s, z, grid)
    assert torch.equal(got.codes.double(), expected)
    # the loss it reports is the output error of what it chose
    assert abs(got.loss - float(output_error(w - dequantize_codes(expected, s, z), h).sum())) < 1e-6 * (
        1 + got.loss
    )


@FAST
@given(
    st.integers(0, 2**31),
    st.integers(1, 6),
    st.integers(1, 40),
    st.booleans(),
    st.booleans(),
    st.sampled_from([0.001, 0.01, 0.3]),
    GRIDS,
)
def test_gptq_weighs_its_codes_and_the_given_ones_as_h_does(
    seed: int, rows: int, cols: int, act_order: bool, dead: bool, damp: float, grid: IntegerGrid
) -> None:
    """The errors GPTQ's choice is judged by, of its own codes (from its loss) and of the codes it
    was given (through its factor), are ``tr(D H D^T)`` on the undampened ``H``, inputs no sample
    reached included: what a product with ``H`` gives, up to float rounding."""
    w, h = problem(seed, rows, cols, samples=max(2, cols // 2))
    if dead:  # an input no sample reached: a zero row and column
        h[0], h[:, 0] = 0.0, 0.0
    s, z = encoding(w, grid, (1, cols))
    nearest = quantize_codes(w, s, z, grid)
    got = gptq_codes(w, h, s, z, grid, damp=damp, act_order=act_order, given=nearest, block=7)
    assert got.given_loss is not None
    diagonal = torch.diagonal(h)
    for loss, codes in ((got.loss, got.codes), (got.given_loss, nearest)):
        exact = float(output_error(w - dequantize_codes(codes, s, z), h).sum())
        weighed = undampened_error(loss, w, codes, s, z, diagonal, damp)
        assert math.isclose(weighed, exact, rel_tol=1e-9, abs_tol=1e-9 * loss)  # loss >= exact


def test_the_papers_inverse_factor_is_the_inverse_of_the_update_factors_v() -> None:
    """0.1.0's ``inverse_hessian_factor`` (the paper's ``U``, ``H^-1 = U^T U``) still resolves and
    still is that factor, in any column order: ``U^T U`` inverts the dampened ``H``, and ``U`` is
    ``V^-1`` for the ``V`` GPTQ now reads its updates from (so their diagonals are reciprocal)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 12, generator=g, dtype=torch.float64)
    h = x.T @ x
    order = torch.randperm(12, generator=g)
    dampened = h[order][:, order] + 0.01 * float(h.diagonal().mean()) * torch.eye(12, dtype=torch.float64)
    u = gptq_module.inverse_hessian_factor(h, 0.01, order=order)
    assert torch.allclose(torch.triu(u), u)
    assert torch.allclose(u.T @ u, torch.linalg.inv(dampened), rtol=1e-9, atol=1e-12)
    f = gptq_module.update_factor(h, 0.01, order=order)
    assert torch.allclose(u.diagonal() * f.diagonal(), torch.ones(12, dtype=torch.float64), rtol=1e-10)


@FAST
@given(st.integers(0, 2**31), st.integers(1, 5), st.integers(2, 12), st.integers(1, 5), GRIDS)
def test_gptq_lazy_batches_do_not_change_the_codes(
    seed: int, rows: int, cols: int, block: int, grid: IntegerGrid
) -> None:
    w, h = problem(seed, rows, cols)
    s, z = encoding(w, grid, (1, cols))
    one = gptq_codes(w, h, s, z, grid, block=1).codes
    assert torch.equal(gptq_codes(w, h, s, z, grid, block=block).codes, one)
    assert torch.equal(gptq_codes(w, h, s, z, grid, block=1000).codes, one)


@FAST
@given(st.integers(0, 2**31), st.integers(1, 5), st.integers(2, 10), GRIDS)
def test_gptq_act_order_is_gptq_on_the_permuted_problem(
    seed: int, rows: int, cols: int, grid: IntegerGrid
) -> None:
    w, h = problem(seed, rows, cols)
    s, z = encoding(w, grid, (1, cols))
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    permuted = gptq_codes(w[:, order], h[order][:, order], s[:, order], z[:, order], grid).codes
    got = gptq_codes(w, h, s, z, grid, act_order=True).codes
    assert torch.equal(got[:, order], permuted)


@FAST
@given(
    st.integers(0, 2**31), st.integers(1, 4), st.sampled_from([(2, 3), (4, 2), (3, 4)]), GRIDS, st.booleans()
)
def test_gptq_codes_stay_on_the_block_grid(
    seed: int, rows: int, blocks: tuple[int, int], grid: IntegerGrid, act_order: bool
) -> None:
    size, count = blocks
    w, h = problem(seed, rows, size * count)
    w[:, 0] *= 50  # an outlier column: its error spreads onto the others, which must still clamp
    s, z = encoding(w, grid, (1, size))
    codes = gptq_codes(w, h, s, z, grid, act_order=act_order).codes
    assert codes.min() >= grid.quant_min and codes.max() <= grid.quant_max
    assert torch.equal(codes, codes.round())


@FAST
@given(
    st.integers(0, 2**31),
    st.sampled_from([(1, 12), (1, 4), (2, 3), (6, 12)]),
    st.booleans(),
    st.lists(st.integers(1, 150), min_size=1, max_size=24),
    GRIDS,
)
def test_group_candidates_are_the_expanded_candidates_and_their_errors(
    seed: int, groups: tuple[int, int], symmetric: bool, numerators: list[int], grid: IntegerGrid
) -> None:
    """SeqMSE's screened search makes its candidates per group in one scratch buffer; they must be
    :func:`candidate_weight`'s values (the backend's observer reads them), for fractions below, at
    and above 1 mixed across groups, on rows of zeros and negative zeros, and their errors those
    of ``W - fake_quantize(W)`` however many were made before in the same buffer."""
    w, _ = problem(seed, 6, 12)
    w[1] = 0.0
    w[2, :5] = -0.0
    w[3] = -w[3].abs()
    shape = (6 // groups[0], 12 // groups[1])
    candidates = GroupCandidates(w, groups, symmetric)
    picks = torch.tensor(numerators * (shape[0] * shape[1] // len(numerators) + 1))
    for shift in range(3):
        fraction = picks.roll(shift)[: shape[0] * shape[1]].reshape(shape).to(torch.float64) / 100
        made = candidates.weight_at(fraction)
        expected = candidate_weight(w, fraction, groups, symmetric)
        assert torch.equal(made, expected)
        scale = group_view(expected, groups).abs().amax(dim=(1, 3)).clamp(min=1e-6) / grid.quant_max
        zero = torch.zeros_like(scale) if symmetric else torch.full_like(scale, float(grid.quant_min < 0))
        error = candidates.error(scale, zero, grid)
        wide = expand_groups(scale, groups), expand_groups(zero, groups)
        assert torch.equal(error, w - fake_quantize(w, *wide, grid))


@FAST
@given(
    st.integers(0, 2**31),
    st.sampled_from([(1, 12), (1, 4), (2, 3), (6, 12)]),
    st.booleans(),
    st.lists(st.integers(1, 150), min_size=1, max_size=24),
    st.sampled_from([None, torch.float32]),
)
def test_group_candidates_extremes_are_those_of_their_values(
    seed: int, groups: tuple[int, int], symmetric: bool, numerators: list[int], dtype: torch.dtype | None
) -> None:
    """:meth:`GroupCandidates.extremes_at` stands for the candidate where an observer reads only
    its extremes: each group's min and max of :meth:`~GroupCandidates.weight_at`'s values, bit for
    bit, for fractions below, at and above 1 mixed across groups, in float64 and in the float32
    copy the screening makes (its extremes rounded from the float64 ones, not found again)."""
    w, _ = problem(seed, 6, 12)
    w[1] = 0.0
    w[2, :5] = -0.0
    w[3] = -w[3].abs()
    w[4] = w[4].abs()
    shape = (6 // groups[0], 12 // groups[1])
    made = GroupCandidates(w, groups, symmetric)
    if dtype is not None:
        made.extremes_at(torch.ones(shape, dtype=torch.float64))  # found in float64 first
        made = made.in_dtype(dtype)
    picks = torch.tensor(numerators * (shape[0] * shape[1] // len(numerators) + 1))
    for shift in range(3):
        fraction = picks.roll(shift)[: shape[0] * shape[1]].reshape(shape).to(torch.float64) / 100
        low, high = made.extremes_at(fraction)
        view = group_view(made.weight_at(fraction), groups)
        assert low.dtype == high.dtype == view.dtype
        assert torch.equal(low, view.amin(dim=(1, 3)))
        assert torch.equal(high, view.amax(dim=(1, 3)))


@FAST
@given(
    st.integers(0, 2**31),
    st.sampled_from([(1, 12), (1, 4), (2, 3), (6, 12)]),
    st.booleans(),
    st.lists(st.integers(1, 150), min_size=1, max_size=24),
    GRIDS,
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_group_candidates_read_from_their_source_are_those_of_the_weight(
    seed: int,
    groups: tuple[int, int],
    symmetric: bool,
    numerators: list[int],
    grid: IntegerGrid,
    narrow: torch.dtype,
) -> None:
    """SeqMSE makes its float64 candidates from a float32 weight made float64 and hands them the
    weight as it was (``source``): their ranges found on it, and the float32 copy the screening
    reads being it. Ranges, candidates, extremes and errors must be, bit for bit, those made from
    the float64 weight alone, in float64 and in the screening's copy, on rows of zeros, negative
    zeros, and all-negative and all-positive rows; a source that does not hold the weight's values
    in a narrower dtype (float64 itself, another shape) is not read."""
    w64, _ = problem(seed, 6, 12)
    w64[1] = 0.0
    w64[2, :5] = -0.0
    w64[3] = -w64[3].abs()
    w64[4] = w64[4].abs()
    source = w64.to(narrow)
    w = source.to(torch.float64)
    shape = (6 // groups[0], 12 // groups[1])
    plain = GroupCandidates(w, groups, symmetric)
    read = GroupCandidates(w, groups, symmetric, source=source)
    assert same_bits(read.lo, plain.lo) and same_bits(read.hi, plain.hi)
    for ignored in (w, source[:, :6].contiguous(), source.T.contiguous().T):
        unread = GroupCandidates(w, groups, symmetric, source=ignored)
        assert same_bits(unread.lo, plain.lo) and same_bits(unread.hi, plain.hi)
        assert unread.in_dtype(narrow).view.data_ptr() != source.data_ptr()
    pairs = [(plain, read), (plain.in_dtype(torch.float32), read.in_dtype(torch.float32))]
    pairs.append((plain.in_dtype(narrow), read.in_dtype(narrow)))
    picks = torch.tensor(numerators * (shape[0] * shape[1] // len(numerators) + 1))
    for want, got in pairs:
        assert same_bits(got.view, want.view) and same_bits(got.lo, want.lo) and same_bits(got.hi, want.hi)
        for shift in range(3):
            fraction = picks.roll(shift)[: shape[0] * shape[1]].reshape(shape).to(torch.float64) / 100
            for a, b in zip(got.extremes_at(fraction), want.extremes_at(fraction)):
                assert torch.equal(a, b) and a.dtype == b.dtype
            candidate = want.weight_at(fraction).clone()
            assert same_bits(got.weight_at(fraction), candidate)
            scale = group_view(candidate, groups).abs().amax(dim=(1, 3)).clamp(min=1e-6) / grid.quant_max
            zero = torch.zeros_like(scale) if symmetric else torch.full_like(scale, float(grid.quant_min < 0))
            expected = want.error(scale, zero, grid).clone()
            assert same_bits(got.error(scale, zero, grid), expected)
    assert torch.equal(source.to(torch.float64), w)  # the source was read, not written


@FAST
@given(
    st.integers(0, 2**31),
    st.integers(1, 7),
    st.integers(1, 9),
    st.sampled_from([torch.per_channel_symmetric, torch.per_channel_affine]),
    st.lists(st.integers(1, 150), min_size=1, max_size=8),
)
def test_a_min_max_encoder_of_extremes_is_its_encoding_of_the_candidate(
    seed: int, rows: int, cols: int, qscheme: torch.qscheme, numerators: list[int]
) -> None:
    """SeqMSE asks a per-channel min/max observer for each candidate's encoding from the
    candidate's extremes alone (:meth:`SiteEncoder.of_extremes`); it must be the encoding the
    observer gives the candidate itself (:meth:`SiteEncoder.__call__`), scale and zero point bit
    for bit, and nothing where the observer would read more (a subclass of it, an infinity)."""
    from _quantplug.algorithms.spec import WeightGrid
    from _quantplug.algorithms.weight_choice import SiteObserver
    from _quantplug.algorithms.weight_layers import SiteEncoder, SiteMatrix
    from _quantplug.observers.minmax import MovingAveragePerChannelMinMaxObserver, PerChannelMinMaxObserver

    symmetric = qscheme == torch.per_channel_symmetric
    qmin, qmax = (-7, 7) if symmetric else (0, 15)
    w, _ = problem(seed, rows, cols)
    w[0] = w[0].abs() * 3  # a channel with no negative value
    prototype = PerChannelMinMaxObserver(dtype=torch.int8, qscheme=qscheme, quant_min=qmin, quant_max=qmax)
    grid = WeightGrid(
        quant_min=qmin,
        quant_max=qmax,
        dtype=torch.int8,
        qscheme=qscheme,
        granularity="channel",
        scale=torch.ones(rows),
        zero_point=torch.zeros(rows, dtype=torch.int64),
        symmetric=symmetric,
        ch_axis=0,
        _observe=SiteObserver(prototype),
    )
    matrix = SiteMatrix(
        weight=w,
        scale=torch.ones(rows, cols, dtype=torch.float64),
        zero_point=torch.zeros(rows, cols, dtype=torch.float64),
        grid=IntegerGrid(qmin, qmax),
        groups=(1, cols),
        shape=(rows, cols),
    )
    encode = SiteEncoder(matrix, grid)
    for made in (
        GroupCandidates(w, (1, cols), symmetric),
        GroupCandidates(w, (1, cols), symmetric, torch.float32),
    ):
        for shift in range(3):
            picks = torch.tensor(numerators * (rows // len(numerators) + 1)).roll(shift)[:rows]
            fraction = (picks.to(torch.float64) / 100).reshape(rows, 1)
            found = encode.of_extremes(*made.extremes_at(fraction))
            assert found is not None
            expected = encode(made.weight_at(fraction))
            for got, want in zip(found, expected):
                assert got.dtype == want.dtype and torch.equal(got, want)
    low, high = GroupCandidates(w, (1, cols), symmetric).extremes_at(torch.ones(rows, 1, dtype=torch.float64))
    assert encode.of_extremes(low, high.clone().fill_(math.inf)) is None
    averaging = MovingAveragePerChannelMinMaxObserver(
        dtype=torch.int8, qscheme=qscheme, quant_min=qmin, quant_max=qmax
    )
    assert SiteObserver(averaging).extremes(low, high) is None


def test_gptq_gives_back_the_callers_thread_count() -> None:
    """Each lazy batch's column loop runs on one thread; the caller's count is restored, also for
    a pass on a layer too small for threads at all."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows, cols in ((4, 6), (96, 64)):
            w, h = problem(1, rows, cols)
            s, z = encoding(w, IntegerGrid(-8, 7), (1, cols))
            gptq_codes(w, h, s, z, IntegerGrid(-8, 7), block=16)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_gptq_beats_rounding_to_nearest_on_correlated_inputs() -> None:
    w, h = problem(7, 32, 48, samples=256)
    grid = IntegerGrid(-7, 7)
    for groups in ((1, 48), (1, 16)):
        s, z = encoding(w, grid, groups)
        nearest = output_error(w - fake_quantize(w, s, z, grid), h).sum()
        for act_order in (False, True):
            codes = gptq_codes(w, h, s, z, grid, act_order=act_order).codes.double()
            assert output_error(w - dequantize_codes(codes, s, z), h).sum() < 0.7 * nearest


def test_gptq_rounds_inputs_no_sample_reached_to_nearest() -> None:
    w, h = problem(3, 4, 6)
    h[2, :] = 0
    h[:, 2] = 0
    grid = IntegerGrid(-7, 7)
    s, z = encoding(w, grid, (1, 6))
    for act_order in (False, True):
        codes = gptq_codes(w, h, s, z, grid, act_order=act_order).codes.double()
        assert torch.equal(codes[:, 2], quantize_codes(w[:, 2], s[:, 2], z[:, 2], grid))


def row_group_losses(
    w: torch.Tensor,
    h: torch.Tensor,
    grid: IntegerGrid,
    groups: tuple[int, int],
    fraction: torch.Tensor,
    act_order: bool,
) -> torch.Tensor:
    """Each row group's output error after GPTQ on the clipped encoding (one gptq_codes run)."""
    s, z = encoding(candidate_weight(w, fraction, groups, grid.quant_min < 0), grid, groups)
    codes = gptq_codes(w, h, s, z, grid, act_order=act_order).codes.double()
    return output_error(w - dequantize_codes(codes, s, z), h).reshape(-1, groups[0]).sum(dim=1)


@FAST
@given(
    st.integers(0, 2**31),
    st.sampled_from([(1, 6), (2, 3), (3, 2)]),
    st.sampled_from(["tensor", "channel", "block"]),
    GRIDS,
    st.booleans(),
)
def test_gptq_scale_search_keeps_each_row_groups_best_candidate(
    seed: int, shape: tuple[int, int], granularity: str, grid: IntegerGrid, act_order: bool
) -> None:
    """Rows never interact in GPTQ, so each row group's choice among the candidates (every
    fraction for the whole row, and SeqMSE's per-group choice), rounded stacked, is the brute-force
    best of running GPTQ once per candidate; the default (fraction 1) is a candidate, so the search
    never does worse than GPTQ on the backend's encoding."""
    rows, blocks = shape
    w, h = problem(seed, rows * 2, 4 * blocks)
    groups = {"tensor": (w.shape[0], w.shape[1]), "channel": (1, w.shape[1]), "block": (1, 4)}[granularity]
    symmetric = grid.quant_min < 0
    result = gptq_scale_search(
        w, h, encoder(grid, groups), grid, groups, symmetric=symmetric, candidates=4, act_order=act_order
    )
    shape_of_groups = (w.shape[0] // groups[0], w.shape[1] // groups[1])
    per_group = seq_mse_encoding(
        w, h, encoder(grid, groups), grid, groups, symmetric=symmetric, candidates=4
    ).fraction
    options = [torch.full(shape_of_groups, f, dtype=torch.float64) for f in candidate_fractions(4, 1.5)]
    brute = torch.stack([row_group_losses(w, h, grid, groups, f, act_order) for f in [*options, per_group]])
    best = brute.min(dim=0).values
    assert abs(result.loss - float(best.sum())) <= 1e-9 * (1 + result.loss)
    assert result.loss <= float(brute[0].sum()) + 1e-12  # never worse than the default encoding
    assert result.loss <= float(brute[-1].sum()) * (1 + 1e-12)  # nor than GPTQ on SeqMSE's choice
    chosen_rows = result.fraction.reshape(shape_of_groups)
    for row, fraction in enumerate(chosen_rows):  # each row group's fractions are one option's
        assert any(torch.equal(fraction, option[row]) for option in [*options, per_group])
    assert result.codes.min() >= grid.quant_min and result.codes.max() <= grid.quant_max
    chosen = output_error(w - dequantize_codes(result.codes, result.scale, result.zero_point), h)
    assert abs(float(chosen.sum()) - result.loss) <= 1e-9 * (1 + result.loss)  # the loss is its codes'


@FAST
@given(st.integers(0, 2**31), st.integers(1, 6), GRIDS)
def test_gptq_scale_search_gives_the_same_result_in_any_number_of_passes(
    seed: int, rows: int, grid: IntegerGrid
) -> None:
    """How many candidates are rounded per stacked pass is memory only (SEARCH_BYTES)."""
    w, h = problem(seed, rows, 8)
    symmetric = grid.quant_min < 0

    def search() -> gptq_module.GptqSearchResult:
        return gptq_scale_search(w, h, encoder(grid, (1, 4)), grid, (1, 4), symmetric=symmetric, candidates=5)

    stacked = search()
    before = gptq_module.SEARCH_BYTES
    try:
        gptq_module.SEARCH_BYTES = 1  # one candidate per pass
        alone = search()
    finally:
        gptq_module.SEARCH_BYTES = before
    assert torch.equal(alone.fraction, stacked.fraction)
    assert torch.equal(alone.codes, stacked.codes)


def test_gptq_scale_search_gives_an_outlier_inputs_block_its_own_range() -> None:
    """Two input channels 20x the others (LLM activations' outliers) in the first block of each
    row: that block needs another range than the rest of its row, which no row-wide fraction
    gives and SeqMSE's per-block choice does."""
    w, h = problem(1, 8, 32, samples=256)
    spread = torch.ones(32, dtype=torch.float64)
    spread[[1, 5]] = 20.0
    h = h * spread[:, None] * spread[None, :]
    grid, groups = IntegerGrid(-8, 7), (1, 8)
    result = gptq_scale_search(w, h, encoder(grid, groups), grid, groups, symmetric=True, act_order=True)
    row_wide = torch.stack(
        [
            row_group_losses(w, h, grid, groups, torch.full((8, 4), f, dtype=torch.float64), True)
            for f in candidate_fractions(20, 1.5)
        ]
    )
    assert result.loss < 0.8 * float(row_wide.min(dim=0).values.sum())


def test_gptq_scale_search_clips_where_feedback_pays_for_a_finer_grid() -> None:
    """On correlated inputs and heavy-tailed weights the search picks ranges other than
    min-max's and leaves less error than GPTQ on min-max's encoding."""
    g = torch.Generator().manual_seed(5)
    w, h = problem(5, 16, 32, samples=256)
    w = w * (1 + 4 * (torch.rand(w.shape, generator=g, dtype=torch.float64) > 0.97))  # a few large weights
    grid = IntegerGrid(-7, 7)
    s, z = encoding(w, grid, (1, 32))
    plain = gptq_codes(w, h, s, z, grid, act_order=True).codes.double()
    plain_loss = float(output_error(w - dequantize_codes(plain, s, z), h).sum())
    result = gptq_scale_search(w, h, encoder(grid, (1, 32)), grid, (1, 32), symmetric=True, act_order=True)
    assert bool((result.fraction != 1).any())
    assert result.loss < 0.9 * plain_loss, (result.loss, plain_loss)


@FAST
@given(st.integers(0, 2**31), st.integers(1, 6), st.integers(1, 10), GRIDS, st.integers(0, 60))
def test_adaround_codes_are_floor_or_ceil_and_in_range(
    seed: int, rows: int, cols: int, grid: IntegerGrid, iterations: int
) -> None:
    w, h = problem(seed, rows, cols)
    w[0, 0] *= 40  # beyond the range: clamped like round-to-nearest
    s, z = encoding(w, grid, (1, cols))
    s = s * 0.6  # a clipping encoding, as SeqMSE gives
    result = adaround_codes(w, h, s, z, grid, AdaroundSchedule(iterations=iterations))
    codes = result.codes.double()
    nearest = quantize_codes(w, s, z, grid)
    floor = torch.clamp(torch.floor(w / s) + z, grid.quant_min, grid.quant_max)
    assert codes.min() >= grid.quant_min and codes.max() <= grid.quant_max
    assert ((codes - nearest).abs() <= 1).all()
    assert ((codes == floor) | (codes == torch.clamp(floor + 1, grid.quant_min, grid.quant_max))).all()
    assert result.loss <= result.nearest_loss


def test_adaround_time_budget_stops_training_with_a_valid_rounding() -> None:
    w, h = problem(1, 8, 16)
    grid = IntegerGrid(-7, 7)
    s, z = encoding(w, grid, (1, 16))
    result = adaround_codes(w, h, s, z, grid, AdaroundSchedule(iterations=10_000, time_budget=0.0))
    assert result.stopped_by_budget and result.iterations == 0
    assert torch.equal(result.codes.double(), quantize_codes(w, s, z, grid))


def test_adaround_learns_a_rounding_better_than_nearest() -> None:
    w, h = problem(11, 32, 48, samples=256)
    grid = IntegerGrid(-7, 7)
    s, z = encoding(w, grid, (1, 16))
    result = adaround_codes(w, h, s, z, grid, AdaroundSchedule(iterations=300, damp=0.0))
    assert not result.stopped_by_budget and result.iterations == 300
    assert result.loss < 0.7 * result.nearest_loss
    codes = result.codes.double()  # the loss reported is the output error of the codes returned
    actual = float(output_error(w - dequantize_codes(codes, s, z), h).sum())
    assert abs(actual - result.loss) < 1e-3 * result.loss


@FAST
@given(st.integers(0, 2**31), st.integers(-100, 100), st.integers(-200, 200), GRIDS)
def test_adaround_is_the_same_at_any_magnitude(
    seed: int, weight_exp: int, input_exp: int, grid: IntegerGrid
) -> None:
    """Weights and scales times 2^a, H times 2^b (inputs of 1e30 make H 1e60, beyond float32):
    the same codes bit for bit, the losses times 2^(2a + b). Powers of two keep the scaled
    problem exact, so any difference is the algorithm's. Unnormalised, such inputs overflowed
    float32 in the steps (a bare RuntimeError at convert)."""
    w, h = problem(seed, 4, 8, samples=32)
    s, z = encoding(w, grid, (1, 8))
    schedule = AdaroundSchedule(iterations=40)
    base = adaround_codes(w, h, s, z, grid, schedule)
    a, b = 2.0**weight_exp, 2.0**input_exp
    scaled = adaround_codes(w * a, h * b, s * a, z, grid, schedule)
    assert torch.equal(scaled.codes, base.codes)
    units = a * a * b
    assert math.isclose(scaled.loss, base.loss * units, rel_tol=1e-9, abs_tol=1e-300)
    assert math.isclose(scaled.nearest_loss, base.nearest_loss * units, rel_tol=1e-9, abs_tol=1e-300)


def test_rectified_sigmoid_reaches_both_ends() -> None:
    h = rectified_sigmoid(torch.tensor([-10.0, 0.0, 10.0]))
    assert h.tolist() == [0.0, 0.5, 1.0]


@FAST
@given(
    st.integers(0, 2**31),
    st.integers(1, 6),
    st.sampled_from([(4, 1), (2, 3), (3, 2)]),
    GRIDS,
    st.sampled_from([1.0, 1.5, 2.0]),
)
def test_seq_mse_per_channel_picks_each_rows_best_candidate(
    seed: int, rows: int, blocks: tuple[int, int], grid: IntegerGrid, top: float
) -> None:
    size, count = blocks
    w, h = problem(seed, rows, size * count)
    symmetric = grid.quant_min < 0
    for groups in ((1, size * count), (1, size)):
        result = seq_mse_encoding(
            w, h, encoder(grid, groups), grid, groups, symmetric=symmetric, candidates=8, max_fraction=top
        )
        assert result.loss <= result.default_loss
        assert ((result.fraction > 0) & (result.fraction <= top)).all()
        if groups[1] == w.shape[1]:  # rows are independent: brute force over the candidates agrees
            errors = torch.stack(
                [
                    output_error(
                        w
                        - fake_quantize(
                            w, *encoding(candidate_weight(w, f, groups, symmetric), grid, groups), grid
                        ),
                        h,
                    )
                    for f in (
                        torch.full((rows, 1), k, dtype=torch.float64) for k in candidate_fractions(8, top)
                    )
                ]
            )
            if result.loss < result.default_loss:
                assert abs(result.loss - float(errors.min(dim=0).values.sum())) < 1e-9 * (1 + result.loss)


@FAST
@given(st.integers(1, 200), st.floats(1.0, 4.0))
def test_candidate_fractions_are_the_steps_up_to_the_largest(candidates: int, top: float) -> None:
    fractions = candidate_fractions(candidates, top)
    assert fractions[0] == 1.0  # the backend's own range first: ties keep it
    assert len(fractions) == len(set(fractions)) == int(top * candidates + 1e-9)
    assert all(0 < f <= top + 1e-12 for f in fractions)
    assert sorted(fractions) == [k / candidates for k in range(1, len(fractions) + 1)]


@FAST
@given(st.integers(0, 2**31), st.integers(1, 5), st.integers(1, 8), GRIDS, st.floats(0.05, 3.0))
def test_candidate_weight_has_the_fraction_of_each_groups_range(
    seed: int, rows: int, cols: int, grid: IntegerGrid, fraction: float
) -> None:
    w, _ = problem(seed, rows, cols)
    symmetric = grid.quant_min < 0
    f = torch.full((rows, 1), fraction, dtype=torch.float64)
    got = candidate_weight(w, f, (1, cols), symmetric)
    if symmetric:
        assert torch.allclose(got.abs().amax(dim=1), fraction * w.abs().amax(dim=1))
    else:
        assert torch.allclose(got.amax(dim=1).clamp(min=0), fraction * w.amax(dim=1).clamp(min=0))
        assert torch.allclose(got.amin(dim=1).clamp(max=0), fraction * w.amin(dim=1).clamp(max=0))
    if fraction > 1:  # a coarser grid for the same weights: only the range grows
        assert torch.allclose(got, w * fraction)


def test_seq_mse_widens_the_range_where_a_few_inputs_carry_the_output() -> None:
    """LLM activations have outlier channels: ``H`` is dominated by a few inputs, and the best
    scale is the one that puts those inputs' weights on grid points, wider than min-max or not.
    AIMET's candidates (``k / 20``, k = 1..20) lose a large part of what a fine search over
    ``(0, 1.5]`` finds (defaults)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 48, generator=g, dtype=torch.float64) * 0.05
    spread = torch.ones(48, dtype=torch.float64)
    spread[[3, 17, 40]] = 20.0  # outlier input channels
    x = torch.randn(512, 48, generator=g, dtype=torch.float64) * spread
    h = x.T @ x / len(x)
    grid, groups = IntegerGrid(-7, 7), (1, 48)
    aimet = seq_mse_encoding(
        w, h, encoder(grid, groups), grid, groups, symmetric=True, candidates=20, max_fraction=1
    )
    ours = seq_mse_encoding(w, h, encoder(grid, groups), grid, groups, symmetric=True)
    assert ours.loss < 0.9 * aimet.loss
    assert (ours.fraction > 1).any()


def test_seq_mse_clips_heavy_tailed_weights_for_a_finer_grid() -> None:
    w, h = problem(5, 16, 32, samples=256)
    g = torch.Generator().manual_seed(5)
    chi2 = (torch.randn(3, 16, 32, generator=g, dtype=torch.float64) ** 2).sum(dim=0)
    w = w / (chi2 / 3).sqrt()  # Student-t weights: a few large ones set min-max's range
    grid = IntegerGrid(-7, 7)
    for groups in ((1, 32), (1, 8)):
        result = seq_mse_encoding(w, h, encoder(grid, groups), grid, groups, symmetric=True)
        assert result.loss < 0.95 * result.default_loss
        assert (result.fraction < 1).any()


def test_column_groups_of_weight_layouts() -> None:
    assert column_groups((8, 16), 0, None) == (1, 16)
    assert column_groups((8, 16), None, None) == (8, 16)
    assert column_groups((8, 16), 0, (1, 4)) == (1, 4)
    assert column_groups((8, 16), 0, (1, -1)) == (1, 16)
    assert column_groups((8, 6, 3, 3), 0, (1, 2, 3, 3)) == (1, 18)
    assert column_groups((8, 6, 3, 3), 0, (1, 2, -1, -1)) == (1, 18)
    assert column_groups((8, 6, 3, 3), 0, (1, 2, 1, 1)) is None  # one block per kernel tap
    assert column_groups((8, 16), 0, (2, 4)) is None  # blocks spanning output channels
    assert column_groups((8, 16), 0, (1, 5)) is None  # ragged


@FAST
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_matrix_round_trip(shape: list[int], data: st.DataObject) -> None:
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    w = torch.arange(float(torch.tensor(shape).prod())).reshape(shape)
    m = to_matrix(w, axis)
    assert m.shape[0] == shape[axis]
    assert torch.equal(from_matrix(m, shape, axis), w)


def test_hessian_accumulates_in_batches_and_skips_nonfinite_rows() -> None:
    x = torch.randn(50, 6)
    whole, parts = HessianAccumulator(6), HessianAccumulator(6)
    whole.add(x)
    for chunk in x.split(7):
        parts.add(chunk)
    parts.add(torch.full((2, 6), float("nan")))
    assert parts.rows == 50
    torch.testing.assert_close(parts.mean(), whole.mean())
    torch.testing.assert_close(whole.mean(), (x.double().T @ x.double()) / 50)
    products = x.double()[:, :, None] ** 2 * x.double()[:, None, :] ** 2  # x_ki^2 x_kj^2
    off_diagonal = products.sum() - torch.diagonal(products, dim1=1, dim2=2).sum()
    torch.testing.assert_close(parts.fourth, whole.fourth)
    torch.testing.assert_close(whole.fourth, off_diagonal)


def _rows(seed: int, samples: int, columns: int, correlation: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with channel scales from 0.1 to 10 and ``correlation`` between every two channels,
    and their population mean ``x x^T``."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1, 1, columns, dtype=torch.float64)
    corr = torch.full((columns, columns), correlation, dtype=torch.float64)
    corr.fill_diagonal_(1.0)
    population = scales[:, None] * corr * scales[None, :]
    factor = torch.linalg.cholesky(population)
    return torch.randn(samples, columns, generator=g, dtype=torch.float64) @ factor.T, population


@FAST
@given(st.integers(0, 2**31), st.integers(1, 40), st.integers(1, 12), st.floats(-0.3, 0.9))
def test_shrinkage_intensity_is_the_sampling_variance_over_the_off_diagonal_energy(
    seed: int, samples: int, columns: int, correlation: float
) -> None:
    """Against the formula evaluated entry by entry on the rows: ``d = sum_{i!=j} Var(s_ij) /
    sum_{i!=j} s_ij^2`` clipped to [0, 1]. The diagonal is kept, the off-diagonal scaled by
    ``1 - d``, and the result stays positive semidefinite (a convex mix of two such matrices)."""
    x, _ = _rows(seed, samples, columns, correlation / max(columns - 1, 1))
    acc = HessianAccumulator(columns)
    acc.add(x)
    mean = acc.mean()
    shrunk, intensity = shrunk_toward_diagonal(mean, float(acc.fourth), acc.rows)
    off = ~torch.eye(columns, dtype=torch.bool)
    products = x[:, :, None] * x[:, None, :]
    variance = ((products**2).mean(dim=0) - mean**2) / samples
    energy = float((mean[off] ** 2).sum())
    if samples < 2 or energy == 0.0:
        assert intensity == 0.0
    else:
        expected = min(max(float(variance[off].sum()) / energy, 0.0), 1.0)
        assert abs(intensity - expected) <= 1e-9 * max(1.0, expected)
    assert 0.0 <= intensity <= 1.0
    torch.testing.assert_close(torch.diagonal(shrunk), torch.diagonal(mean), rtol=0, atol=0)
    torch.testing.assert_close(shrunk[off], (1 - intensity) * mean[off])
    assert float(torch.linalg.eigvalsh(shrunk).min()) >= -1e-9 * float(torch.diagonal(mean).max())


def test_shrinkage_estimates_the_population_hessian_better_from_few_rows() -> None:
    """What it is for: 16 rows of 64 inputs estimate the population ``x x^T`` better shrunk
    than raw, and better than the diagonal alone (the intensity lands between the two); from
    4096 rows it hardly shrinks. Averaged over draws, as the estimate's claim is."""
    errors = {"raw": 0.0, "shrunk": 0.0, "diagonal": 0.0}
    for seed in range(10):
        x, population = _rows(seed, 16, 64, 0.2)
        acc = HessianAccumulator(64)
        acc.add(x)
        shrunk, intensity = shrunk_toward_diagonal(acc.mean(), float(acc.fourth), acc.rows)
        assert 0.2 < intensity < 0.95
        for name, estimate in (
            ("raw", acc.mean()),
            ("shrunk", shrunk),
            ("diagonal", torch.diag(torch.diagonal(acc.mean()))),
        ):
            errors[name] += float(torch.linalg.matrix_norm(estimate - population))
    assert errors["shrunk"] < 0.8 * errors["raw"]
    assert errors["shrunk"] < errors["diagonal"]
    x, _ = _rows(0, 4096, 64, 0.2)
    acc = HessianAccumulator(64)
    acc.add(x)
    assert shrunk_toward_diagonal(acc.mean(), float(acc.fourth), acc.rows)[1] < 0.05


def dead_input_hessian(seed: int, cols: int, live: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``H`` of ``samples`` rows where only ``live`` of ``cols`` inputs ever carry a value (dead
    channels after a ReLU), and the mask of the live ones."""
    g = torch.Generator().manual_seed(seed)
    alive = torch.zeros(cols, dtype=torch.bool)
    alive[torch.randperm(cols, generator=g)[:live]] = True
    x = torch.randn(samples, cols, generator=g, dtype=torch.float64) * alive
    return x.T @ x / samples, alive


@FAST
@given(st.integers(0, 2**31), st.integers(2, 120), st.integers(0, 40), st.integers(1, 60))
def test_hessian_factor_reproduces_h_and_leaves_dead_inputs_out(
    seed: int, cols: int, live: int, samples: int
) -> None:
    """``L L^T = H`` (to the dropped eigenvalues' size), zero rows for inputs that never carry a
    value, at most as many columns as ``H``'s rank. The many zero eigenvalues of dead inputs are
    what made LAPACK's eigensolver fail on SqueezeNet's convolutions; they are never decomposed."""
    h, alive = dead_input_hessian(seed, cols, min(live, cols), samples)
    factor = hessian_factor(h)
    assert factor.dtype == torch.float64 and factor.shape[0] == cols
    scale = float(h.abs().max()) or 1.0
    assert torch.allclose(factor @ factor.T, h, atol=1e-6 * scale, rtol=0)
    assert not bool(factor[~alive].any())
    assert factor.shape[1] <= max(1, min(int(alive.sum()), samples))


@FAST
@given(st.integers(0, 2**31), st.integers(1, 24), st.integers(8, 64), st.integers(1, 40), st.booleans())
def test_seq_mse_losses_through_the_factor_equal_the_direct_ones(
    seed: int, rows: int, cols: int, samples: int, per_tensor: bool
) -> None:
    """The low-rank path (many evaluations, fewer rows than inputs) and ``group_losses`` agree."""
    w, _ = problem(seed, rows, cols)
    h, _ = dead_input_hessian(seed, cols, cols, samples)
    groups = (rows, cols) if per_tensor else (1, cols)
    delta = w - torch.round(w * 3) / 3
    fast = group_loss_function(h, groups, w.shape, evaluations=10 * cols)(delta)
    direct = group_losses(delta, h, groups)
    assert fast.shape == direct.shape
    assert torch.allclose(fast, direct, rtol=1e-6, atol=1e-9 * float(direct.abs().max()))


def stacked_problem(seed: int, blocks: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A grouped layer's weight ``[blocks * rows, cols]`` and one Hessian per row block."""
    parts = [problem(seed + b, rows, cols) for b in range(blocks)]
    return torch.cat([w for w, _ in parts]), torch.stack([h for _, h in parts])


@FAST
@given(
    st.integers(0, 2**31),
    st.integers(1, 4),
    st.integers(1, 3),
    st.sampled_from([4, 8]),
    st.sampled_from(["channel", "block"]),
    GRIDS,
    st.booleans(),
)
def test_a_stack_of_hessians_is_each_row_block_on_its_own(
    seed: int, blocks: int, rows: int, cols: int, granularity: str, grid: IntegerGrid, act_order: bool
) -> None:
    """A grouped convolution's row blocks each have their own ``H`` (``[G, I, I]``): the output
    error and GPTQ's codes on the stack are what each block gets alone, side by side; so are
    SeqMSE's encoding and GPTQ's scale search where SeqMSE's layer-wide fallback to the default
    does not join the blocks (losses up to float summation order)."""
    w, h = stacked_problem(seed, blocks, rows, cols)
    groups = (1, cols) if granularity == "channel" else (1, 4)
    symmetric = grid.quant_min < 0
    s, z = encoding(w, grid, groups)
    spans = [slice(b * rows, (b + 1) * rows) for b in range(blocks)]

    def close(stacked: float, parts: list[float]) -> bool:
        return abs(stacked - sum(parts)) <= 1e-9 * (1 + abs(stacked))

    delta = w - fake_quantize(w, s, z, grid)
    expected = torch.cat([output_error(delta[r], h[b]) for b, r in enumerate(spans)])
    torch.testing.assert_close(output_error(delta, h), expected, rtol=1e-12, atol=1e-12)
    codes = gptq_codes(w, h, s, z, grid, act_order=act_order)
    alone = [gptq_codes(w[r], h[b], s[r], z[r], grid, act_order=act_order) for b, r in enumerate(spans)]
    assert torch.equal(codes.codes, torch.cat([a.codes for a in alone]))
    assert close(codes.loss, [a.loss for a in alone])
    encode = encoder(grid, groups)
    chosen = seq_mse_encoding(w, h, encode, grid, groups, symmetric=symmetric, candidates=4)
    each = [
        seq_mse_encoding(w[r], h[b], encode, grid, groups, symmetric=symmetric, candidates=4)
        for b, r in enumerate(spans)
    ]
    assert close(chosen.default_loss, [e.default_loss for e in each])
    assert chosen.loss <= chosen.default_loss
    # SeqMSE keeps a layer's mixed choice only where it beats the default as a whole, so the
    # blocks agree with the layer where each block's own mix beats its own default (the scale
    # search tries SeqMSE's choice at the same candidates as a candidate of its own)
    separable = all(e.loss < e.default_loss for e in each)
    if separable:
        assert close(chosen.loss, [e.loss for e in each])
    searched = gptq_scale_search(
        w, h, encode, grid, groups, symmetric=symmetric, candidates=4, act_order=act_order
    )
    on_default = float(output_error(w - dequantize_codes(codes.codes, s, z), h).sum())
    assert searched.loss <= on_default * (1 + 1e-12) + 1e-15  # fraction 1 is a candidate
    if separable:
        apart = [
            gptq_scale_search(
                w[r], h[b], encode, grid, groups, symmetric=symmetric, candidates=4, act_order=act_order
            )
            for b, r in enumerate(spans)
        ]
        assert close(searched.loss, [a.loss for a in apart])


@FAST
@given(st.integers(0, 2**31), st.integers(1, 4), st.integers(1, 30), GRIDS)
def test_adaround_on_a_stack_of_hessians_rounds_each_weight_down_or_up(
    seed: int, blocks: int, steps: int, grid: IntegerGrid
) -> None:
    w, h = stacked_problem(seed, blocks, 2, 6)
    s, z = encoding(w, grid, (1, 6))
    result = adaround_codes(w, h, s, z, grid, AdaroundSchedule(iterations=steps))
    scaled = w / s + z
    assert bool(
        (
            (result.codes == torch.floor(scaled))
            | (result.codes == torch.ceil(scaled))
            | (result.codes == grid.quant_min)
            | (result.codes == grid.quant_max)
        ).all()
    )
    assert result.loss <= result.nearest_loss * (1 + 1e-9)


def test_a_grouped_accumulator_sums_each_groups_rows() -> None:
    """``[G, N, I]`` patches: each group's ``H`` is its own rows' (a position broken in any group
    is dropped from all, so every ``H`` counts the same rows), and each shrinks on its own."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 20, 5, generator=g, dtype=torch.float64)
    x[1, 4, 2] = float("nan")
    grouped = HessianAccumulator(5, 3)
    grouped.add(x)
    kept = torch.cat([x[:, :4], x[:, 5:]], dim=1)
    assert grouped.rows == 19
    for b in range(3):
        alone = HessianAccumulator(5)
        alone.add(kept[b])
        torch.testing.assert_close(grouped.sum[b], alone.sum)
        torch.testing.assert_close(grouped.fourth[b], alone.fourth)
        shrunk = shrunk_toward_diagonal(grouped.mean(), grouped.fourth, grouped.rows)[0][b]
        torch.testing.assert_close(
            shrunk, shrunk_toward_diagonal(alone.mean(), float(alone.fourth), alone.rows)[0]
        )


def wide_few_rows(seed: int, inputs: int, rows: int) -> torch.Tensor:
    """The mean ``x x^T`` of ``rows`` correlated samples of ``inputs`` inputs: rank ``rows``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inputs, generator=g, dtype=torch.float64) * torch.rand(
        inputs, generator=g, dtype=torch.float64
    )
    return x.T @ x / rows


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 100), st.sampled_from([(1, 512), (1, 32)]))
def test_a_low_rank_factor_is_the_hessian_and_gives_its_losses(
    seed: int, rows: int, groups: tuple[int, int]
) -> None:
    """A layer seen on fewer rows than inputs has ``rank(H) <= rows``: the randomized factor
    (``I^2 k``) reproduces ``H`` and the group losses SeqMSE compares; above ``max_rank`` there is none."""
    h = wide_few_rows(seed, 512, rows)
    factor = low_rank_factor(h, 128)
    assert factor is not None and factor.shape[1] <= rows
    torch.testing.assert_close(factor @ factor.T, h, rtol=0, atol=1e-9 * float(h.abs().max()))
    delta = torch.randn(4, 512, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    torch.testing.assert_close(factor_group_losses(delta, factor, groups), group_losses(delta, h, groups))
    assert low_rank_factor(wide_few_rows(seed, 512, 300), 128) is None  # rank 300 > 128


def test_seq_mse_on_a_wide_layer_seen_on_few_rows_chooses_as_with_the_full_hessian() -> None:
    """The low-rank path (taken where the direct products would cost over ROWS_LOW_RANK_WORK) makes
    the same choice, at the same loss."""
    h = wide_few_rows(0, 512, 40)
    w = torch.randn(8, 512, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grid = IntegerGrid(-7, 7)

    def run() -> seq_mse_module.SeqMseResult:
        return seq_mse_encoding(w, h, encoder(grid, (1, 512)), grid, (1, 512), symmetric=True, candidates=20)

    direct = run()
    before, factor = seq_mse_module.ROWS_LOW_RANK_WORK, seq_mse_module.low_rank_factor
    factored: list[int] = []
    try:
        seq_mse_module.ROWS_LOW_RANK_WORK = 0
        seq_mse_module.low_rank_factor = lambda *a: factored.append(1) or factor(*a)  # type: ignore[assignment]
        low = run()
    finally:
        seq_mse_module.ROWS_LOW_RANK_WORK, seq_mse_module.low_rank_factor = before, factor
    assert factored == [1]  # the low-rank path ran
    assert torch.equal(low.fraction, direct.fraction)
    assert abs(low.loss - direct.loss) <= 1e-9 * direct.loss


def test_seq_mse_screening_on_large_layers_stays_near_the_exhaustive_search() -> None:
    """Above EXHAUSTIVE_WORK a layer's candidates are screened (H's leading directions and
    diagonal, or a narrow block's own slice; coarse to fine) and only the best few judged exactly:
    ~40 quantizations instead of 151 exact losses. Over correlated inputs, heavy-tailed weights,
    symmetric, asymmetric and 8-bit grids per tensor, channel and block, its output error stays
    within 10 % of the exhaustive search's (2 % on average), and never above the default's."""
    ratios = []
    before = seq_mse_module.EXHAUSTIVE_WORK
    try:
        for seed in range(4):
            w, h = problem(seed, 16, 128, samples=256)
            if seed % 2:  # Student-t weights
                g = torch.Generator().manual_seed(seed)
                w = (
                    w
                    / ((torch.randn(3, 16, 128, generator=g, dtype=torch.float64) ** 2).sum(dim=0) / 3).sqrt()
                )
            for grid in (IntegerGrid(-7, 7), IntegerGrid(0, 15), IntegerGrid(-127, 127)):
                for groups in ((16, 128), (1, 128), (1, 32)):
                    run = seq_mse_module.seq_mse_encoding
                    symmetric = grid.quant_min < 0
                    seq_mse_module.EXHAUSTIVE_WORK = 2**62
                    full = run(w, h, encoder(grid, groups), grid, groups, symmetric=symmetric)
                    seq_mse_module.EXHAUSTIVE_WORK = 0
                    screened = run(w, h, encoder(grid, groups), grid, groups, symmetric=symmetric)
                    assert screened.loss <= screened.default_loss
                    ratios.append(screened.loss / full.loss)
    finally:
        seq_mse_module.EXHAUSTIVE_WORK = before
    assert max(ratios) < 1.1
    assert sum(ratios) / len(ratios) < 1.02


def test_layers_reading_one_input_share_the_factors_of_its_hessian() -> None:
    """A transformer's query, key and value projections read one input: with one HessianFactors
    their searches factor that ``H`` once (given equal copies, as convert gives each layer its
    own), with the choices and losses each search makes alone; an ``H`` one value off is factored
    anew."""
    w, h = problem(0, 32, 16, samples=4)  # rank 4: the full factor's products are the cheaper
    weights = [w, problem(1, 32, 16)[0], problem(2, 32, 16)[0]]
    grid, groups = IntegerGrid(-7, 7), (1, 16)
    made: list[str] = []
    before = (
        seq_mse_module.EXHAUSTIVE_WORK,
        seq_mse_module.hessian_factor,
        seq_mse_module.leading_factor,
    )
    full, leading = before[1], before[2]

    def run(weight: torch.Tensor, hessian: torch.Tensor, factors: HessianFactors | None) -> Any:
        return seq_mse_encoding(
            weight, hessian, encoder(grid, groups), grid, groups, symmetric=True, factors=factors
        )

    try:
        seq_mse_module.EXHAUSTIVE_WORK = 0  # screened: the leading directions and the full factor
        seq_mse_module.hessian_factor = lambda *a: made.append("full") or full(*a)  # type: ignore[assignment]
        seq_mse_module.leading_factor = lambda *a: made.append("leading") or leading(*a)  # type: ignore[assignment]
        alone = [run(x, h, None) for x in weights]
        assert made == ["full", "leading"] * 3
        made.clear()
        shared = HessianFactors()
        together = [run(x, h.clone(), shared) for x in weights]
        assert made == ["full", "leading"]
        made.clear()
        changed = h.clone()
        changed[0, 0] *= 1 + 1e-15
        run(w, changed, shared)
        assert made == ["full", "leading"]
    finally:
        (
            seq_mse_module.EXHAUSTIVE_WORK,
            seq_mse_module.hessian_factor,
            seq_mse_module.leading_factor,
        ) = before
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a.fraction, b.fraction) and torch.equal(a.scale, b.scale)
        assert (a.loss, a.default_loss) == (b.loss, b.default_loss)


def test_group_losses_in_float32_products_are_the_float64_ones_to_float32_precision() -> None:
    """A screened search judges its survivors with float32 products (half the time of float64's):
    on each path (the full factor, the low-rank factor, ``H`` itself) the group losses are those
    of float64 products to float32's precision, and returned in float64."""
    h = problem(0, 64, 32, samples=8)[1]  # rank 8: the full factor's path
    wide = wide_few_rows(1, 512, 16)  # rank 16: the low-rank factor's path (max rank 512 / 8)
    delta = torch.randn(64, 512, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    cases = [
        ("full", h, (1, 32), delta[:, :32], 6),  # 6 evaluations * 64 rows > 10 * 32 inputs
        ("low rank", wide, (1, 64), delta, 10**6),  # blocks: 1e6 * 64 * 512^2 > LOW_RANK_WORK
        ("H", h, (1, 8), delta[:, :32], 6),
    ]
    for path, hessian, groups, d, evaluations in cases:
        factors = HessianFactors()
        exact = group_loss_function(hessian, groups, d.shape, evaluations, factors)(d)
        assert [k for k, v in factors._made.items() if v is not None] == ([] if path == "H" else [path])
        fast = group_loss_function(hessian, groups, d.shape, evaluations, dtype=torch.float32)(d)
        assert fast.dtype == torch.float64 and fast.shape == exact.shape
        assert not torch.equal(fast, exact)  # the products were float32
        torch.testing.assert_close(fast, exact, rtol=1e-5, atol=0)


@FAST
@given(
    st.integers(0, 2**31),
    st.sampled_from([(1, 12), (1, 4), (2, 12), (6, 12), (2, 3), (3, 4)]),
    st.booleans(),
    st.sampled_from([None, torch.float32]),
    st.lists(st.integers(1, 150), min_size=1, max_size=12),
)
def test_group_candidates_error_is_the_same_on_every_path(
    seed: int, groups: tuple[int, int], symmetric: bool, dtype: torch.dtype | None, numerators: list[int]
) -> None:
    """:meth:`GroupCandidates.error` in one native pass (symmetric codes, one scale per row of a
    block or row-group layout), in row-group slices (an lm_head's size) or whole in torch: the
    same values, bit for bit, on the encodings a search gives its candidates (fractions below,
    at and above 1; a zero weight group; a zero scale) and with a zero point."""
    from _quantplug.observers import kernels

    w, _ = problem(seed, 6, 12)
    w[1] = 0.0
    w[2, :5] = -0.0
    grid = IntegerGrid(-8, 7) if symmetric else IntegerGrid(0, 15)
    shape = (6 // groups[0], 12 // groups[1])
    made = GroupCandidates(w, groups, symmetric, dtype)
    picks = torch.tensor(numerators * (shape[0] * shape[1] // len(numerators) + 1))
    fraction = picks[: shape[0] * shape[1]].reshape(shape).to(torch.float64) / 100
    view = group_view(made.weight_at(fraction), groups)
    span = view.amax(dim=(1, 3)) - view.amin(dim=(1, 3)) if not symmetric else view.abs().amax(dim=(1, 3))
    scale = (span.to(torch.float64) / 15).to(torch.float32).to(torch.float64)
    scale[0, 0] = 0.0
    zero_points = [torch.zeros(shape, dtype=torch.float64)]
    if not symmetric:
        zero_points.append(
            torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(seed)).double()
        )
    for zero_point in zero_points:
        found = made.error(scale, zero_point, grid).clone()
        with kernels.disabled():
            whole = made.error(scale, zero_point, grid).clone()
            saved = seq_mse_module.WHOLE_ERROR, seq_mse_module.ERROR_SLICE
            seq_mse_module.WHOLE_ERROR, seq_mse_module.ERROR_SLICE = 0, 20  # slices of 1-2 row groups
            try:
                sliced = made.error(scale, zero_point, grid).clone()
            finally:
                seq_mse_module.WHOLE_ERROR, seq_mse_module.ERROR_SLICE = saved
        for other in (whole, sliced):
            nan = found.isnan()
            assert torch.equal(nan, other.isnan())
            assert torch.equal(found[~nan], other[~nan]) and torch.equal(found.signbit(), other.signbit())


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 1.0, 2.0, 2.5, math.inf, math.nan]), min_size=4 * 6, max_size=4 * 6),
    st.lists(st.integers(-1, 5), min_size=4 * 6, max_size=4 * 6),
)
def test_insert_sorted_is_the_stable_sort_of_the_kept_and_the_new(
    losses: list[float], keys: list[int]
) -> None:
    """The screening's top-``SCREENED`` update without a sort: what the first three of a stable
    ``argsort`` of the kept (sorted) losses and the new one give, NaN and ties included."""
    values = torch.tensor(losses, dtype=torch.float32).reshape(4, 3, 2)
    kept_loss = values[:3].sort(dim=0, stable=True).values
    loss = values[3]
    ks = torch.tensor(keys).reshape(4, 3, 2)
    kept, key = ks[:3], ks[3]
    both, both_keys = torch.cat([kept_loss, loss[None]]), torch.cat([kept, key[None]])
    order = torch.argsort(both, dim=0, stable=True)[:3]
    got_loss, got_keys = insert_sorted(kept_loss, kept, loss, key)
    assert torch.equal(got_keys, both_keys.gather(0, order))
    assert torch.equal(got_loss.nan_to_num(), both.gather(0, order).nan_to_num())
    assert torch.equal(got_loss.isnan(), both.gather(0, order).isnan())


def _low_rank_factor_drawn_in_the_loop(
    hessian: torch.Tensor, max_rank: int, seed: int = 0
) -> torch.Tensor | None:
    """:func:`low_rank_factor` as it was: each rank's probes drawn as the loop reaches it."""
    from _quantplug.algorithms.weight_matrix import RANGE_PROBES, RANGE_TOLERANCE

    h = hessian.to(torch.float64)
    inputs = h.shape[0]
    generator = torch.Generator().manual_seed(seed)
    rank = 64
    while rank <= max_rank:
        probes = torch.randn(inputs, rank + RANGE_PROBES, generator=generator, dtype=torch.float64)
        reach = h @ probes
        basis = torch.linalg.qr(reach[:, :rank]).Q
        check = reach[:, rank:]
        outside = check - basis @ (basis.T @ check)
        if float(outside.norm()) <= RANGE_TOLERANCE * float(check.norm()):
            values, vectors = torch.linalg.eigh(basis.T @ h @ basis)
            keep = values > 1e-7 * float(values.max().clamp(min=0))
            if not bool(keep.any()):
                return torch.zeros(inputs, 1, dtype=torch.float64)
            return (basis @ vectors[:, keep]) * values[keep].sqrt()
        rank *= 2
    return None


@FAST
@given(st.integers(0, 2**31), st.sampled_from([40, 100, 200]), st.sampled_from([63, 64, 127, 128, 255]))
def test_low_rank_factor_on_kept_probes_is_the_one_drawn_each_time(
    seed: int, samples: int, max_rank: int
) -> None:
    """The probes :func:`low_rank_factor` and :func:`leading_factor` share between layers
    (:func:`seeded_probes`) are those each call drew: the same factor (or None), bit for bit,
    on the first call, on a later one, and where they are too large to keep."""
    import _quantplug.algorithms.weight_matrix as weight_matrix_module

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 300, generator=g, dtype=torch.float64)
    h = x.T @ x
    expected = _low_rank_factor_drawn_in_the_loop(h, max_rank, seed % 3)
    runs = [low_rank_factor(h, max_rank, seed % 3), low_rank_factor(h, max_rank, seed % 3)]
    saved = weight_matrix_module.PROBE_BYTES
    weight_matrix_module.PROBE_BYTES = 0
    try:
        runs.append(low_rank_factor(h, max_rank, seed % 3))
        drawn = seeded_probes(300, (40,), seed % 3)
    finally:
        weight_matrix_module.PROBE_BYTES = saved
    for found in runs:
        assert (found is None) == (expected is None)
        assert found is None or expected is None or torch.equal(found, expected)
    generator = torch.Generator().manual_seed(seed % 3)
    fresh = torch.randn(300, 40, generator=generator, dtype=torch.float64)
    assert torch.equal(seeded_probes(300, (40,), seed % 3)[0], fresh) and torch.equal(drawn[0], fresh)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(-1e4, 1e4, width=32) | st.sampled_from([0.0, -0.0, 1e-30]),
            st.floats(-1e4, 1e4, width=32) | st.sampled_from([0.0, -0.0, 1e-30]),
        ),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([torch.per_channel_symmetric, torch.per_channel_affine]),
    st.sampled_from([(-8, 7), (0, 15), (-128, 127), (-32768, 32767)]),
    st.sampled_from([1.0, 1.25]),
    st.sampled_from([2**-20, 1e-3]),
)
def test_min_max_extremes_are_what_a_fresh_copy_fed_them_gives(
    pairs: list[tuple[float, float]],
    qscheme: torch.qscheme,
    limits: tuple[int, int],
    margin: float,
    eps: float,
) -> None:
    """:meth:`SiteObserver.extremes` computes the encoding a fresh copy of the per-channel min/max
    observer gives after observing ``[channels, 2]`` of the extremes, without the copy: the same
    scale and zero point, bit for bit (signed zeros, ranges with no negative or no positive
    value, a range margin, eps); an observer that has seen a tensor is copied as before."""
    from _quantplug.algorithms.weight_choice import SiteObserver, _encoding
    from _quantplug.observers.minmax import PerChannelMinMaxObserver

    low = torch.tensor([min(p) for p in pairs], dtype=torch.float32)
    high = torch.tensor([max(p) if min(p) != max(p) else p[1] for p in pairs], dtype=torch.float32)
    prototype = PerChannelMinMaxObserver(
        dtype=torch.int16 if limits[1] > 255 else torch.uint8 if limits[0] == 0 else torch.int8,
        qscheme=qscheme,
        quant_min=limits[0],
        quant_max=limits[1],
        range_margin=margin,
        eps=eps,
    )
    for fed in (False, True):
        if fed:  # its copies merge the extremes with what it saw
            prototype(torch.linspace(-3, 2, 2 * len(pairs)).reshape(len(pairs), 2))
        found = SiteObserver(prototype).extremes(low, high)
        expected = _encoding(prototype, torch.stack([low, high], dim=1))
        assert found is not None
        for got, want in zip(found, expected):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
