"""GPTQ's faster paths compute what the paths they replace computed, bit for bit (issue 43.1): the
factor of an equal ``H`` reused (:class:`~_quantplug.algorithms.weight_matrix.HessianFactors`), values moved
and columns rounded through numpy, ``H`` put in order with one gather fewer, the given codes'
column sums taken from the pass that weighs them, default codes and codes back in the weight's
shape made in reused buffers and tiles. Each is checked against the torch path it
replaced (numpy views refused), or against that computation written out as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _quantplug.algorithms.gptq as gptq_module
import _quantplug.algorithms.seq_mse as seq_mse_module
import _quantplug.algorithms.spec as spec_module
import _quantplug.algorithms.weight_matrix as matrix_module
import quantplug
from _quantplug.algorithms.gptq import column_squares, gptq_codes, gptq_factor
from _quantplug.algorithms.weight_layers import SiteMatrix
from _quantplug.algorithms.weight_matrix import (
    HessianFactors,
    IntegerGrid,
    dampen_,
    permute_columns_,
    reverse_,
    same_bits,
    transpose_,
)

FAST = settings(max_examples=25, deadline=None)
GRIDS = st.sampled_from([IntegerGrid(-7, 7), IntegerGrid(-8, 7), IntegerGrid(0, 15), IntegerGrid(-127, 127)])


@contextmanager
def torch_paths() -> Iterator[None]:
    """No numpy view of any tensor: every move and rounding takes its torch path."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matrix_module, "numpy_view", lambda matrix: None)
        patch.setattr(gptq_module, "numpy_view", lambda matrix: None)
        yield


def _matrix(seed: int, rows: int, cols: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(
        dtype
    )


@FAST
@given(
    st.integers(0, 2**31),
    st.integers(1, 150),
    st.integers(1, 150),
    st.sampled_from([torch.float64, torch.float32]),
    st.sampled_from([7, 64, 1 << 17]),
)
def test_moves_through_numpy_are_the_torch_moves(
    seed: int, rows: int, cols: int, dtype: torch.dtype, gather: int
) -> None:
    """Tiles of any size (one partial tile, many), slabs of any height: the same values where
    torch's transposition, flips and gather put them."""
    square = _matrix(seed, cols, cols, dtype)
    wide = _matrix(seed + 1, rows, cols, dtype)
    order = torch.randperm(cols, generator=torch.Generator().manual_seed(seed))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matrix_module, "GATHER_ELEMENTS", gather)
        patch.setattr(matrix_module, "TILE", max(1, gather // 8))
        fast = [
            transpose_(square.clone()),
            reverse_(square.clone()),
            reverse_(wide.clone()),
            permute_columns_(wide.clone(), order),
            gptq_module.permute_rows_(wide.T.clone(memory_format=torch.contiguous_format), order),
        ]
        with torch_paths():
            slow = [
                transpose_(square.clone()),
                reverse_(square.clone()),
                reverse_(wide.clone()),
                permute_columns_(wide.clone(), order),
                gptq_module.permute_rows_(wide.T.clone(memory_format=torch.contiguous_format), order),
            ]
    assert torch.equal(fast[0], square.T)
    assert torch.equal(fast[3], wide[:, order])
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)


def _old_update_factor(hessian: torch.Tensor, damp: float, order: torch.Tensor | None) -> torch.Tensor:
    """:func:`~_quantplug.algorithms.gptq.update_factor` as it was computed: columns permuted,
    transposed, columns permuted again, then factored and reversed."""
    size = hessian.shape[0]
    backwards = torch.arange(size - 1, -1, -1) if order is None else order.flip(0)
    buffer = hessian.clone()[:, backwards].T.contiguous()[:, backwards].contiguous()
    factor = dampen_(buffer.T, damp)
    torch.linalg.cholesky(factor, out=factor)
    buffer = buffer.flip(0, 1).contiguous()
    diagonal = buffer.diagonal().clone()
    buffer.div_(diagonal.unsqueeze(1))
    buffer.diagonal().copy_(diagonal)
    return buffer.T


@FAST
@given(st.integers(0, 2**31), st.integers(1, 40), st.booleans(), st.booleans())
def test_the_update_factor_is_the_one_of_before(seed: int, inputs: int, act_order: bool, lend: bool) -> None:
    """Rows permuted, columns permuted, transposed: what columns permuted, transposed and
    permuted again gave, on an ``H`` that is not exactly symmetric either (the transposition is
    not taken for granted)."""
    x = _matrix(seed, inputs + 5, inputs)
    hessian = x.T @ x + 1e-9 * _matrix(seed + 1, inputs, inputs)  # the last bits asymmetric
    order = gptq_module.column_order(hessian, True) if act_order else None
    expected = _old_update_factor(hessian, 0.01, order)
    given_up = hessian.clone()
    got = gptq_module.update_factor(given_up, 0.01, lend, order)
    assert torch.equal(got, expected)
    assert (got.data_ptr() == given_up.data_ptr()) == lend


@FAST
@given(
    st.integers(0, 2**31),
    st.sampled_from([1, 5, 40, 300]),
    st.integers(1, 40),
    st.integers(1, 20),
    st.booleans(),
    st.sampled_from(["compact", "expanded", "float32", "bfloat16"]),
    GRIDS,
    st.booleans(),
)
def test_gptq_in_numpy_is_gptq_in_torch(
    seed: int, out: int, inputs: int, block: int, act_order: bool, form: str, grid: IntegerGrid, ties: bool
) -> None:
    """The codes, loss and the given codes' loss of the numpy path are the torch path's, bit for
    bit: symmetric and asymmetric grids, a compact or expanded encoding, float32 and float64
    weights (bfloat16: no numpy twin, the torch path either way); ``ties``: weights halfway
    between two codes (the columns no error reached yet round half to even, as torch's do)."""
    weight = _matrix(seed, out, inputs)
    if ties:  # halves of a power-of-two step: exactly halfway at a scale of 1/8
        weight = (torch.round(weight * 4) + 0.5) / 8
    x = _matrix(seed + 1, max(2, inputs // 2), inputs)
    hessian = x.T @ x / len(x)
    levels = grid.quant_max - grid.quant_min
    scale = weight.abs().amax(dim=1, keepdim=True) * 2 / levels + 1e-3
    if ties:
        scale = torch.full_like(scale, 1 / 8)
    zero_point = torch.full_like(scale, float((grid.quant_min + grid.quant_max + 1) // 2))
    if form == "expanded":
        scale, zero_point = scale.expand_as(weight).contiguous(), zero_point.expand_as(weight).contiguous()
    if form in ("float32", "bfloat16"):
        weight = weight.to(getattr(torch, form))
    nearest = torch.clamp(torch.round(weight.double() / scale) + zero_point, grid.quant_min, grid.quant_max)

    def run() -> Any:
        return gptq_codes(
            weight, hessian, scale, zero_point, grid, block=block, act_order=act_order, given=nearest
        )

    original = weight.clone()
    with pytest.MonkeyPatch.context() as patch:  # 300 rows: slices of 16 (the last takes the rest)
        patch.setattr(gptq_module, "UPDATE_SLICE_ROWS", 16)
        patch.setattr(gptq_module, "UPDATE_SLICE_ELEMENTS", 16)
        fast = run()
        with torch_paths():
            slow = run()
        squares = column_squares(weight, nearest, scale, zero_point)  # as undampened_error sums
    assert torch.equal(weight, original)  # GPTQ's working weight is never the caller's memory
    assert torch.equal(fast.codes, slow.codes)
    assert (fast.loss, fast.given_loss) == (slow.loss, slow.given_loss)
    assert fast.given_squares is not None and slow.given_squares is not None
    assert torch.equal(fast.given_squares, squares) and torch.equal(slow.given_squares, squares)


def test_a_factor_is_reused_only_for_the_same_bits_and_options() -> None:
    """The factor made first serves the readers of an equal ``H`` (the one object, ``make`` not
    called again), and is dropped after the last of them; an ``H`` one ulp off, a zero of the
    other sign, another kind (dampening, order), a single reader, or an ``H`` over the size limit:
    made anew. Readers unknown: kept until another ``H`` replaces it."""
    x = _matrix(0, 30, 12)
    h = x.T @ x
    calls: list[torch.Tensor] = []

    def make(damp: float = 0.01, act_order: bool = True) -> Any:
        def made(hessian: torch.Tensor) -> Any:
            calls.append(hessian)
            return gptq_factor(hessian.clone(), damp, act_order)

        return made

    shared = HessianFactors()
    kind = ("gptq", 0.01, True)
    first = shared.get(kind, h.clone(), make(), readers=3)
    assert shared.get(kind, h.clone(), make(), readers=3) is first
    assert shared.get(kind, h.clone(), make(), readers=3) is first and len(calls) == 1
    fourth = shared.get(kind, h.clone(), make(), readers=3)  # no fourth reader: dropped
    assert fourth is not first and torch.equal(fourth.factor, first.factor) and len(calls) == 2
    off = h.clone()
    off[3, 5] = torch.nextafter(off[3, 5], torch.tensor(float("inf"), dtype=torch.float64))
    zeros, signed = torch.zeros(4, 4, dtype=torch.float64), torch.zeros(4, 4, dtype=torch.float64)
    signed[1, 2] = -0.0
    assert same_bits(h, h.clone()) and not same_bits(h, off) and not same_bits(zeros, signed)
    assert not same_bits(h, h.float())
    zero = shared.get(kind, zeros.clone(), make(), readers=2)
    assert shared.get(kind, signed.clone(), make(), readers=2) is not zero
    for other, damp, act_order in ((off, 0.01, True), (h, 0.02, True), (h, 0.01, False)):
        kept = shared.get(kind, h.clone(), make(), readers=2)
        made = shared.get(("gptq", damp, act_order), other.clone(), make(damp, act_order), readers=2)
        assert made is not kept
        assert torch.equal(made.factor, gptq_factor(other.clone(), damp, act_order).factor)
    alone = shared.get(kind, h.clone(), make(), readers=1)
    assert shared.get(kind, h.clone(), make(), readers=1) is not alone
    unknown = shared.get(kind, h.clone(), make())
    assert all(shared.get(kind, h.clone(), make()) is unknown for _ in range(4))
    assert shared.get(kind, off.clone(), make()) is not unknown
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HessianFactors, "MAX_BYTES", h.numel() * 8 - 1)
        large = shared.get(kind, h.clone(), make(), readers=2)
        assert shared.get(kind, h.clone(), make(), readers=2) is not large
    with shared.reading(2):  # the count for calls that give none, until the block ends
        counted = shared.get(kind, off.clone(), make())
        assert shared.get(kind, off.clone(), make()) is counted
        assert shared.get(kind, off.clone(), make()) is not counted  # its 2 readers asked
    assert shared.get(kind, off.clone(), make()) is not counted
    after = shared.get(kind, off.clone(), make())  # unknown readers again: kept for every call
    assert all(shared.get(kind, off.clone(), make()) is after for _ in range(3))


class _Attention(torch.nn.Module):
    """Three projections of one input (a transformer's query, key and value), and one of another."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(24, 16)
        self.k = torch.nn.Linear(24, 8)
        self.v = torch.nn.Linear(24, 8)
        self.o = torch.nn.Linear(32, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1))


def _attention_program() -> tuple[torch.export.ExportedProgram, list[tuple[torch.Tensor]]]:
    """:class:`_Attention` exported, and its two calibration batches."""
    torch.manual_seed(0)
    model = _Attention().eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(40, 24, generator=g),) for _ in range(2)]
    return torch.export.export(model, batches[0]), batches


def test_projections_of_one_input_share_one_factor_and_choose_what_they_chose_alone() -> None:
    """GPTQ on three projections of one input factors that input's ``H`` once (and ``o``'s once),
    and every layer's codes are those it chose with no factor shared."""
    program, batches = _attention_program()
    made: list[int] = []
    chosen: dict[bool, dict[str, torch.Tensor]] = {True: {}, False: {}}
    factor, choose, readers = (
        gptq_module.gptq_factor,
        gptq_module.GPTQ.choose_weight,
        gptq_module.GPTQ._readers,
    )

    def counted(hessian: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        made.append(hessian.shape[-1])
        return factor(hessian, *args, **kwargs)

    for sharing in (True, False):

        def recorded(self: Any, site: Any, *args: Any, sharing: bool = sharing) -> Any:
            choice = choose(self, site, *args)
            chosen[sharing][site.name] = None if choice is None else choice.codes
            return choice

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gptq_module, "gptq_factor", counted)
            patch.setattr(gptq_module.GPTQ, "choose_weight", recorded)
            if not sharing:
                patch.setattr(gptq_module.GPTQ, "_readers", lambda self, own: 0)
            made.clear()
            quantplug.quantize(
                program,
                backend="reference",
                calibration=batches,
                algorithms=quantplug.Algorithms(["gptq"], guard=False),
            )
        assert sorted(made) == ([24, 32] if sharing else [24, 24, 24, 32])
    assert readers is gptq_module.GPTQ._readers
    assert chosen[True].keys() == chosen[False].keys() and len(chosen[True]) == 4
    for name, codes in chosen[True].items():
        other = chosen[False][name]
        assert (codes is None) == (other is None)
        assert codes is None or (other is not None and torch.equal(codes, other))


def test_seq_mse_keeps_a_copy_of_h_only_for_the_layers_that_read_it() -> None:
    """SeqMSE tells its factors how many layers read each ``H`` (:meth:`HessianFactors.reading`):
    the projections of one input factor it once and its copy is dropped after the last of them,
    a layer no other reads (``o``) has its ``H`` neither copied nor kept; every layer's encoding
    is the one chosen with the readers unknown (its factors kept until another ``H`` came)."""
    program, batches = _attention_program()
    made: list[int] = []
    chosen: dict[bool, dict[str, Any]] = {True: {}, False: {}}
    kept: dict[bool, list[int | None]] = {True: [], False: []}
    factor, choose = seq_mse_module.hessian_factor, seq_mse_module.SeqMSE.choose_weight

    def counted(hessian: torch.Tensor, *args: Any) -> Any:
        made.append(hessian.shape[-1])
        return factor(hessian, *args)

    for counting in (True, False):

        def recorded(self: Any, site: Any, *args: Any, counting: bool = counting) -> Any:
            choice = choose(self, site, *args)
            chosen[counting][site.name] = None if choice is None else (choice.scale, choice.zero_point)
            copy = self._factors._hessian
            kept[counting].append(None if copy is None else copy.shape[-1])
            return choice

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(seq_mse_module, "hessian_factor", counted)
            patch.setattr(seq_mse_module.SeqMSE, "choose_weight", recorded)
            if not counting:
                patch.setattr(seq_mse_module.SeqMSE, "_readers", lambda self, site, collected: None)
            made.clear()
            quantplug.quantize(
                program,
                backend="reference",
                calibration=batches,
                algorithms=quantplug.Algorithms(["seq_mse"], guard=False),
            )
        assert sorted(made) == [24, 32]
    assert kept[True] == [24, 24, None, None] and kept[False] == [24, 24, 24, 32]
    assert chosen[True].keys() == chosen[False].keys() and len(chosen[True]) == 4
    for name, choice in chosen[True].items():
        other = chosen[False][name]
        assert (choice is None) == (other is None)
        if choice is not None and other is not None:
            for a, b in zip(choice, other, strict=True):
                assert (a is None and b is None) or (a is not None and b is not None and same_bits(a, b))


@FAST
@given(
    st.integers(0, 2**31),
    st.integers(1, 40),
    st.sampled_from([8, 16, 32]),
    st.sampled_from(["tensor", "channel", "block"]),
    st.sampled_from([1, 7, 64, 1 << 18]),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_grid_codes_in_one_buffer_are_the_whole_expression(
    seed: int, out: int, inputs: int, granularity: str, buffer: int, dtype: torch.dtype
) -> None:
    """:meth:`WeightGrid.quantize` a few rows at a time in one reused buffer: each code what
    ``clamp(round(w / s) + z)`` on the whole weight gives (buffers of one row to all of them)."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out, inputs, generator=g) * torch.logspace(-3, 2, inputs)).to(dtype)
    shape = {"tensor": (1,), "channel": (out,), "block": (out, inputs // 8)}[granularity]
    grid = spec_module.WeightGrid(
        quant_min=-8,
        quant_max=7,
        dtype=torch.int8,
        qscheme=torch.per_channel_affine,
        granularity=granularity,
        scale=torch.rand(shape, generator=g) * 0.1 + 1e-3,
        zero_point=torch.randint(-3, 3, shape, generator=g),
        symmetric=False,
        ch_axis=0 if granularity == "channel" else None,
        block_size=(1, 8) if granularity == "block" else None,
    )
    s = grid.expand(grid.scale, weight.shape).to(torch.float32)
    z = grid.expand(grid.zero_point, weight.shape).to(torch.float32)
    expected = (torch.round(weight.to(torch.float32) / s) + z).clamp(grid.quant_min, grid.quant_max)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spec_module, "_BUFFER", buffer)
        assert torch.equal(grid.quantize(weight, dtype=torch.int8), expected.to(torch.int8))


@FAST
@given(st.integers(0, 2**31), st.integers(1, 300), st.integers(1, 300), st.sampled_from([4, 4096, 1 << 22]))
def test_codes_of_a_transposed_matrix_in_tiles_are_its_rounded_values(
    seed: int, out: int, inputs: int, elements: int
) -> None:
    """:meth:`SiteMatrix.codes` of GPTQ's transposed working memory, in tiles of any size: the
    matrix rounded and converted, as whole slices of rows gave it."""
    g = torch.Generator().manual_seed(seed)
    memory = torch.randint(-8, 8, (inputs, out), generator=g).double() + 1e-9 * _matrix(seed, inputs, out)
    grid = IntegerGrid(-8, 7)
    zeros = torch.zeros(out, 1, dtype=torch.float64)
    matrix = SiteMatrix(torch.zeros(out, inputs), zeros + 1, zeros, grid, (1, inputs), (out, inputs))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matrix_module, "SLICE_ELEMENTS", elements)
        assert torch.equal(matrix.codes(memory.T), memory.T.round().to(torch.int8))
