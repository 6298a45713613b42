"""GPTQ: weight rounding with second-order error compensation (Frantar et al., ICLR 2023,
"GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers").

Columns of ``W`` are quantized one at a time; after each, the not-yet-quantized columns absorb
its error through the inverse Hessian ``H^-1`` of the layer's output error (``H = sum x x^T``),
the Optimal Brain Surgeon update. Three details make it fast and stable, from the paper:

* the rows of ``H^-1`` that the updates need are the rows of the upper Cholesky factor of
  ``H^-1`` (scaled), so no inverse is recomputed after a column is removed (here the same update
  is read from a Cholesky factor of ``H`` itself, without inverting: :func:`update_factor`);
* *lazy batch updates*: the update is applied within a block of ``block`` columns immediately
  and to the rest of the matrix once per block (a matrix product instead of many rank-1 updates;
  here within a block too, in sub-blocks: :func:`_gptq_block`);
* *act-order*: columns with the largest ``H`` diagonal (the most active inputs) go first.

Scales and zero points are given (the backend's encoding, or SeqMSE's), one per weight after
expansion, so per-channel and per-group/block (LPBQ) grids are the same code path ("static
groups": the grid is fixed before the first column, which is what keeps act-order and block
grids compatible). The codes always lie in ``[quant_min, quant_max]``.

With ``scale_search`` (off by default), GPTQ also chooses each channel's range among clipping
fractions, judged by the error GPTQ itself leaves at each (:func:`gptq_scale_search`): not a
detail of the paper, whose reference code takes its grid from min-max or an MSE search on the
weights alone, which is what ``["seq_mse", "gptq"]`` reproduces with the layer's ``H``.

Neither is the ``shrinkage`` option (``"singular"`` by default): a layer calibrated on fewer
rows than it has inputs has a singular ``H`` (on fewer than twice as many, a nearly singular
one: :data:`~_quantplug.algorithms.weight_layers.NEAR_SINGULAR_ROWS`), and the updates then move
error into the directions the rows measured least, which costs nothing on the calibration data
and does on other data (the zoo's ConvNeXt classifier, 16 images for 64 inputs: -4.4 dB held out
against the default; a ViT's patch embedding, 256 rows for 192 inputs: -2.3 dB).
There ``H`` is shrunk toward its diagonal by Ledoit and Wolf's estimate of how little the rows
say about its off-diagonal terms (:func:`~_quantplug.algorithms.weight_matrix.shrunk_toward_diagonal`).
Layers with enough rows keep the paper's ``H``: shrinking them too cost the zoo's encoders about
1 dB (``"all"`` does it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from _quantplug.algorithms.seq_mse import (
    MAX_CANDIDATES,
    candidate_fractions,
    candidate_weight,
    seq_mse_encoding,
)
from _quantplug.algorithms.spec import (
    Algorithm,
    WeightChoice,
    WeightGrid,
    WeightSite,
    option,
    options_as_fields,
)
from _quantplug.algorithms.weight_layers import (
    SHRINKAGE_CHOICES,
    Encoder,
    LayerHessian,
    collects_hessian,
    matrix_and_hessian,
    sequential_option,
    site_encoder,
)
from _quantplug.algorithms.weight_matrix import (
    GATHER_ELEMENTS,
    HessianFactors,
    IntegerGrid,
    dampen_,
    numpy_view,
    output_error,
    permute_columns_,
    reverse_,
    row_slices,
    single_thread,
    small_products,
    transpose_,
)


@dataclass(frozen=True)
class GptqResult:
    """Integer codes ``[O, I]`` (float64 tensor of exact integers: the memory GPTQ worked the
    weight in) and the error they leave."""

    codes: torch.Tensor
    #: the output error ``sum over rows of d^T H d`` of the result under the dampened ``H``,
    #: accumulated column by column (each step's exact Optimal Brain Surgeon increment)
    loss: float
    #: the same error of the codes given to weigh beside (``gptq_codes(..., given=)``), or None
    given_loss: float | None = None
    #: per column, their weight error ``D`` squared and summed over rows, as
    #: :func:`column_squares` sums it (what :func:`undampened_error` reads of them), or None
    given_squares: torch.Tensor | None = None


def update_factor(
    hessian: torch.Tensor, damp: float, overwrite: bool = False, order: torch.Tensor | None = None
) -> torch.Tensor:
    """GPTQ's update factor ``F`` of ``H`` (in ``order``, if given), dampened first.

    With ``V`` the upper triangular matrix of ``H = V V^T`` (a Cholesky factorization with rows
    and columns reversed), ``F[j, k] = V[j, k] / V[k, k]`` above the diagonal and ``F[j, j] =
    V[j, j]``. The paper's factor is the upper Cholesky factor ``U`` of ``H^-1``, which is
    ``V^-1``: its update pushes each column's *scaled* error along a row of ``U``; the same
    update is each column's *own* error ``d_j = w_j - q_j`` along a row of ``F`` (the column
    ``k`` GPTQ rounds is ``w_k + sum_{j<k} d_j F[j, k]``: :func:`_gptq_block`). So one Cholesky
    factorization (``I^3 / 3``) does where ``U`` took a factorization, an inversion and another
    (``4 I^3 / 3``, 15 % of GPTQ's time on a 110M Llama). The codes are those of the paper's
    loop up to float rounding.

    Computed in one ``[I, I]`` buffer (LAPACK factors in place): ``hessian``'s own memory with
    ``overwrite`` (a contiguous float64 matrix the caller gives up), else a copy. The widest
    layers' are gigabytes: each step in its own buffer was three copies more.
    """
    h = hessian.to(torch.float64)
    mine = overwrite and h is hessian and h.is_contiguous()
    buffer = h if mine else h.clone(memory_format=torch.contiguous_format)
    size = buffer.shape[0]
    backwards = torch.arange(size - 1, -1, -1) if order is None else order.flip(0)
    # H in order, reversed, and transposed (column-major): rows permuted (whole rows move),
    # columns permuted (a gather), transposed. The same values as columns permuted, transposed
    # and columns permuted again, with one gather fewer (a 2048-input layer's took 13 ms)
    permute_rows_(buffer, backwards)
    permute_columns_(buffer, backwards)
    transpose_(buffer)
    factor = dampen_(buffer.T, damp)  # column-major, as LAPACK's results are
    torch.linalg.cholesky(factor, out=factor)
    # buffer is L^T (row-major) for the factor L of the reversed H; L reversed is V, and so
    # buffer reversed is V^T: V column-major, read through buffer.T
    reverse_(buffer)
    diagonal = buffer.diagonal().clone()
    start = 0
    for part in row_slices(buffer):  # V[j, k] / V[k, k]: row k of V^T divided by V[k, k]
        part.div_(diagonal[start : start + part.shape[0]].unsqueeze(1))
        start += part.shape[0]
    buffer.diagonal().copy_(diagonal)
    return buffer.T


def inverse_hessian_factor(
    hessian: torch.Tensor, damp: float, overwrite: bool = False, order: torch.Tensor | None = None
) -> torch.Tensor:
    """The paper's factor: upper Cholesky factor ``U`` of ``H^-1`` (``H^-1 = U^T U``), ``H`` (in
    ``order``, if given) dampened first; ``U = V^-1`` for the ``V`` of :func:`update_factor`.

    GPTQ no longer uses it (:func:`update_factor` gives the same updates from one factorization
    instead of three); 0.1.0 released it as ``quantplug.algorithms.gptq.inverse_hessian_factor``,
    and that path resolves until the deprecation table's removal release (``_quantplug.deprecated``).
    ``overwrite``: computed in ``hessian``'s own memory (a contiguous float64 matrix the caller
    gives up), else in a copy; column-major, as LAPACK's results are.
    """
    h = hessian.to(torch.float64)
    mine = overwrite and h is hessian and h.is_contiguous()
    buffer = h if mine else h.clone(memory_format=torch.contiguous_format)
    if order is not None:  # H in order, column-major: columns permuted, transposed, columns permuted
        permute_columns_(buffer, order)
    transpose_(buffer)
    if order is not None:
        permute_columns_(buffer, order)
    factor = dampen_(buffer.T, damp)
    torch.linalg.cholesky(factor, out=factor)
    torch.cholesky_inverse(factor, out=factor)
    return torch.linalg.cholesky(factor, upper=True, out=factor)


def column_order(hessian: torch.Tensor, act_order: bool) -> torch.Tensor | None:
    """The order columns are quantized in: act-order's (largest ``H`` diagonal first), or None
    (``[G, I]`` for a stack of Hessians: each row block's own order)."""
    if not act_order:
        return None
    return torch.argsort(torch.diagonal(hessian, dim1=-2, dim2=-1), dim=-1, descending=True, stable=True)


def _factor(
    hessian: torch.Tensor, damp: float, order: torch.Tensor | None, overwrite: bool = False
) -> torch.Tensor:
    """:func:`update_factor` of ``H`` in ``order`` (``overwrite``: in ``hessian``'s own memory, as
    :func:`update_factor`)."""
    if hessian.dim() == 3:  # a grouped layer: one factor per row block
        return torch.stack(
            [_factor(h, damp, None if order is None else order[g]) for g, h in enumerate(hessian)]
        )
    return update_factor(hessian, damp, overwrite, order)


@dataclass(frozen=True)
class GptqFactor:
    """What GPTQ's column loop reads of ``H`` (:func:`gptq_factor`): the column order (None: the
    weight's own) and :func:`update_factor` in it (``[G, I, I]`` and ``[G, I]`` for a stack)."""

    order: torch.Tensor | None
    factor: torch.Tensor


def gptq_factor(hessian: torch.Tensor, damp: float, act_order: bool, overwrite: bool = False) -> GptqFactor:
    """:class:`GptqFactor` of ``hessian`` (``overwrite``: made in its memory, as
    :func:`update_factor`; one ``[I, I]`` only)."""
    h = hessian.detach().to(torch.float64)
    order = column_order(h, act_order)
    return GptqFactor(order, _factor(h, damp, order, overwrite=overwrite and h.dim() == 2))


def _gptq_rows(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    factor: torch.Tensor,
    order: torch.Tensor | None,
    grid: IntegerGrid,
    block: int,
    out: int,
) -> tuple[torch.Tensor, float]:
    """:func:`_gptq_pass` on rows that are copies of an ``out``-row matrix stacked (candidate
    encodings); with a factor per row block (``[G, I, I]``: a grouped layer), each block's rows
    of every copy are one pass on that block's factor and order."""
    if factor.dim() == 2:
        return _gptq_pass(weight, scale, zero_point, factor, order, grid, block)
    groups, inputs = factor.shape[0], weight.shape[1]

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [copies, G, out / G, I]
        return t.expand_as(weight).reshape(-1, groups, out // groups, inputs)

    w, s, z = blocks(weight), blocks(scale), blocks(zero_point)
    codes = torch.empty_like(w)
    loss = 0.0
    for g in range(groups):
        found, part = _gptq_pass(
            w[:, g].reshape(-1, inputs),
            s[:, g].reshape(-1, inputs),
            z[:, g].reshape(-1, inputs),
            factor[g],
            None if order is None else order[g],
            grid,
            block,
        )
        codes[:, g] = found.reshape(codes[:, g].shape)
        loss += part
    return codes.reshape(weight.shape), loss


#: rows one slice of an ``[O, I]`` error matrix GPTQ weighs takes at least (:func:`factor_loss`,
#: :func:`undampened_error`): a product of fewer rows may take another kernel whose sums round
#: differently, and the errors must not depend on the slicing
UPDATE_SLICE_ROWS = 256
#: elements of one slice of such a matrix (8 MiB of float64)
UPDATE_SLICE_ELEMENTS = 1 << 20


def update_slices(rows: int, columns: int) -> list[slice]:
    """Row slices of a ``rows`` x ``columns`` matrix: the whole matrix when it is small, else
    slices of about :data:`UPDATE_SLICE_ELEMENTS` (never fewer than :data:`UPDATE_SLICE_ROWS`
    rows, the last one taking the rest). A whole 8192 x 8192 layer's float64 error and its
    product are 512 MiB each beside the weight; a slice's are 8 MiB."""
    step = max(UPDATE_SLICE_ROWS, UPDATE_SLICE_ELEMENTS // max(1, columns))
    if rows < 2 * step:
        return [slice(0, rows)]
    starts = list(range(0, rows - step, step))
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], rows])]


@dataclass(frozen=True)
class _BlockErrors:
    """A lazy batch's rounding errors ``[block, O]`` (a row per column: the weight's own value less
    its dequantized code) and the part of the loss its columns add."""

    matrix: torch.Tensor
    loss: float


#: columns of a lazy batch whose errors reach the next ones column by column (a product of at
#: most this many rows per column); the rest of the lazy batch takes them as one product per
#: sub-batch. Speed only: the same codes up to float rounding, as :data:`lazy_batch` is
INNER_BLOCK = 16


def _block_columns(
    matrix: torch.Tensor,
    order: torch.Tensor | None,
    start: int,
    stop: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Columns ``start:stop`` of the (permuted) working weight's layout read from ``matrix``
    (``[O, I]`` in the weight's own column order), one float64 row per column: ``[n, O]``
    (written into ``out``, contiguous ``[n, O]`` float64, if given).

    Through numpy where the dtype has a numpy twin (float32, float64: the values moved and
    widened exactly as torch does), a few rows of ``matrix`` at a time: their columns gathered
    and written transposed. Torch's gather, widening and transposed copy made three new
    ``[n, O]`` temporaries, fresh mappings of 16-33 MiB on a 32000-row lm_head, and a transposed
    widening copy of the whole weight took 0.2 s on it (0.1 s so, rows put in order with it)."""
    array = numpy_view(matrix)
    if array is None or (out is not None and numpy_view(out) is None):
        columns = matrix[:, start:stop] if order is None else matrix.index_select(1, order[start:stop])
        return columns.T.to(torch.float64).contiguous() if out is None else out.copy_(columns.T)
    result = torch.empty(stop - start, matrix.shape[0], dtype=torch.float64) if out is None else out
    target = numpy_view(result)
    assert target is not None
    index = None if order is None else order[start:stop].numpy()
    rows = max(1, GATHER_ELEMENTS // max(1, stop - start))
    for first in range(0, matrix.shape[0], rows):
        part = array[first : first + rows]
        picked = part[:, start:stop] if index is None else part.take(index, axis=1)
        target[:, first : first + part.shape[0]] = picked.T
    return result


def _block_encoding(
    param: torch.Tensor, order: torch.Tensor | None, start: int, stop: int
) -> list[torch.Tensor]:
    """The encoding of columns ``start:stop`` of the (permuted) working weight, one ``[O]`` (or
    broadcast ``[1]``) vector per column: ``param`` is ``[O, I]`` in the weight's own column order,
    or one value per row ``[O, 1]`` / for all ``[1, 1]`` (the same vector for every column)."""
    if param.shape[-1] == 1:
        return [param[:, 0]] * (stop - start)
    return list(_block_columns(param, order, start, stop).unbind(0))


def _gptq_block(
    wb: torch.Tensor,
    own: torch.Tensor,
    fb: torch.Tensor,
    scale: list[torch.Tensor],
    zero_point: list[torch.Tensor] | None,
    grid: IntegerGrid,
    work: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> _BlockErrors:
    """One lazy batch of the transposed working weight ``wb`` (``[n, O]``: a row per column of the
    weight, as the earlier batches left it) rounded column by column, each one's error pushed
    onto the rest of the batch; ``wb`` holds the codes after. ``own``: the weight's own values of
    these columns ``[n, O]`` (:func:`_block_columns`), ``fb``: :func:`update_factor` on the
    batch's columns; ``scale``/``zero_point``: each column's encoding (:func:`_block_encoding`;
    ``zero_point`` None: all zero, a symmetric grid).

    Column ``k`` is rounded as ``w_k + sum_{j<k} d_j F[j, k]``, ``d_j`` the error left in column
    ``j`` (its own value less its dequantized code). Every step is an ``O``-vector operation on a
    contiguous row, run on one thread: a parallel region on a busy machine waits for a
    descheduled worker per operation (one 768 x 768 layer, load 5 on two cores: 20.6 s on two
    threads, 4.1 s so). Inside the batch the errors travel in sub-blocks of :data:`INNER_BLOCK`
    columns: a column takes the errors of its sub-block's earlier columns as one matrix-vector
    product when it is reached, and the rest of the batch takes a sub-block's as one matrix
    product. A rank-1 update of the whole rest of the batch per column (the paper's loop) read
    and wrote ``block / 2`` rows of ``O`` per column: most of GPTQ's time.

    Returns the batch's errors ``[n, O]`` for the update of the rest of the matrix, and the part
    of the loss its columns add: ``sum_j ((w'_j - q_j) V[j, j])^2``, ``w'_j`` the column as
    rounded (the paper's scaled errors: their squares sum to ``tr(D H D^T)``).

    ``work``: three float64 buffers of at least ``wb``'s rows (the codes, errors and dequantized
    codes; their first rows are used), reused batch after batch by :func:`_gptq_pass`: three
    new ``[n, O]`` a batch were fresh mappings on a wide layer (33 MiB each on a 32000-row
    lm_head), every page faulted in again.
    """
    n = wb.shape[0]
    if work is None:
        codes, errors, dequantized = (torch.empty_like(wb) for _ in range(3))
    else:
        codes, errors, dequantized = (buffer[:n] for buffer in work)
    work_rows = (codes, errors, dequantized)
    round_column = _numpy_rounding(wb, own, scale, zero_point, grid, work_rows) or _torch_rounding(
        wb, own, scale, zero_point, grid, work_rows
    )
    # the views the products read, made in three calls rather than three per column (the same
    # views: errors[first:j].T is by_column[:, first:j], fb[first:j, j] is factor_of[j][first:j])
    rows, by_column, factor_of = wb.unbind(0), errors.T, fb.T.unbind(0)
    for first in range(0, n, INNER_BLOCK):
        last = min(first + INNER_BLOCK, n)
        for j in range(first, last):
            if j > first:  # the errors of the sub-block's earlier columns
                rows[j].addmv_(by_column[:, first:j], factor_of[j][first:j])
            round_column(j)
        if last < n:  # the rest of the batch absorbs the sub-block's errors
            wb[last:].addmm_(fb[first:last, last:].T, errors[first:last])
    scaled = wb.sub_(dequantized).mul_(fb.diagonal().unsqueeze(1))
    loss = float(scaled.square_().sum())
    wb.copy_(codes)
    return _BlockErrors(errors, loss)


#: rounds column ``j`` of a lazy batch as it stands: its codes, dequantized codes and error
ColumnRounding = Callable[[int], None]


def _numpy_rounding(
    wb: torch.Tensor,
    own: torch.Tensor,
    scale: list[torch.Tensor],
    zero_point: list[torch.Tensor] | None,
    grid: IntegerGrid,
    work: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> ColumnRounding | None:
    """:func:`_gptq_block`'s rounding of a column in numpy (None where a tensor has no numpy
    view). The same IEEE operations on the same vectors (division, round half to even, clamp as
    a max then a min, multiplication, subtraction: each rounded once, as torch's are; no fused
    multiply-add, which ``torch.addcmul`` would be), at a fifth of torch's call overhead: a
    column of a 768 x 768 layer is six operations on 768 floats, and the calls were most of its
    time (67k columns, 1 s, on a 110M Llama). The errors reach the next columns through torch's
    own product (``addmv_``: MKL's sums, as before)."""
    codes, errors, dequantized = work
    arrays = [numpy_view(t) for t in (wb, own, codes, errors, dequantized)]
    vectors: dict[int, numpy.ndarray] = {}  # each distinct encoding vector's view, once
    for t in [*scale, *(zero_point or [])]:
        if id(t) not in vectors:
            view = numpy_view(t)
            if view is None:
                return None
            vectors[id(t)] = view
    present = [a for a in arrays if a is not None]
    if len(present) < len(arrays):
        return None
    cols, own_values, found, error, deq = present
    s_of = [vectors[id(t)] for t in scale]
    z_of = None if zero_point is None else [vectors[id(t)] for t in zero_point]
    low, high = float(grid.quant_min), float(grid.quant_max)

    def round_column(j: int) -> None:
        q, s = found[j], s_of[j]
        numpy.divide(cols[j], s, out=q)
        numpy.rint(q, out=q)
        if z_of is None:
            numpy.minimum(numpy.maximum(q, low, out=q), high, out=q)
            numpy.multiply(q, s, out=deq[j])
        else:
            z = z_of[j]
            numpy.add(q, z, out=q)
            numpy.minimum(numpy.maximum(q, low, out=q), high, out=q)
            numpy.subtract(q, z, out=deq[j])
            numpy.multiply(deq[j], s, out=deq[j])
        numpy.subtract(own_values[j], deq[j], out=error[j])

    return round_column


def _torch_rounding(
    wb: torch.Tensor,
    own: torch.Tensor,
    scale: list[torch.Tensor],
    zero_point: list[torch.Tensor] | None,
    grid: IntegerGrid,
    work: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> ColumnRounding:
    """:func:`_gptq_block`'s rounding of a column in torch operations."""
    codes, errors, dequantized = work
    columns, found, error, deq = wb.unbind(0), codes.unbind(0), errors.unbind(0), dequantized.unbind(0)

    def round_column(j: int) -> None:
        q, s = found[j], scale[j]
        torch.div(columns[j], s, out=q).round_()
        if zero_point is None:
            q.clamp_(grid.quant_min, grid.quant_max)
            torch.mul(q, s, out=deq[j])
        else:
            z = zero_point[j]
            q.add_(z).clamp_(grid.quant_min, grid.quant_max)
            torch.sub(q, z, out=deq[j]).mul_(s)
        torch.sub(own[j], deq[j], out=error[j])

    return round_column


def permute_rows_(matrix: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``matrix[order]`` written into ``matrix`` itself, one cycle of the permutation at a time
    (a row's copy held): whole contiguous rows move, so memory stays one row beyond the matrix."""
    index = order.tolist()
    done = [False] * len(index)
    array = numpy_view(matrix)
    # the same moves through numpy where it views the matrix: a row assignment a fifth of torch's cost
    rows: Any = matrix if array is None else array
    for start in range(len(index)):
        if done[start] or index[start] == start:
            continue
        kept = rows[start].clone() if array is None else rows[start].copy()
        k = start
        while True:
            done[k] = True
            source = index[k]
            if source == start:
                rows[k] = kept
                break
            rows[k] = rows[source]
            k = source
    return matrix


def _gptq_pass(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    factor: torch.Tensor,
    order: torch.Tensor | None,
    grid: IntegerGrid,
    block: int,
) -> tuple[torch.Tensor, float]:
    """GPTQ's column loop (an ``[O, I]`` weight, any float dtype, never written; ``factor`` from
    :func:`_factor` in ``order``; ``scale``/``zero_point`` broadcastable to ``[O, I]``: ``[O, I]``,
    ``[O, 1]`` or ``[1, 1]``). Returns the codes ``[O, I]`` and the loss (summed a lazy batch at a
    time).

    Rows never interact: row ``o``'s codes depend on row ``o`` of the weight and the encoding
    only, so several candidate encodings of one weight can be rounded in one pass, stacked.

    One float64 buffer holds the working weight transposed (``[I, O]``, a row per column in the
    order they are rounded) and, lazy batch by lazy batch, its codes (exact integers); the codes
    come back as its transposed view, rows put back in the weight's column order in place. Each
    lazy batch is a view of contiguous rows, and the rest of the matrix absorbs a batch's errors
    in place (one matrix product, no temporary): the weight is transposed and permuted once, not
    a batch at a time. The encoding is read a lazy batch's columns at a time where it is used,
    never permuted or expanded whole.
    """
    rows, columns = weight.shape
    # in order: rows permuted as they are made (into memory of its own: never the weight's)
    wt = _block_columns(weight, order, 0, columns, out=torch.empty(columns, rows, dtype=torch.float64))
    loss = 0.0
    step = max(1, int(block))
    symmetric = not bool(zero_point.any())
    # a lazy batch's own values, codes, errors and dequantized codes: made once, reused
    own, *work = (torch.empty(min(step, columns), rows, dtype=torch.float64) for _ in range(4))
    with small_products(rows * columns * step):
        for start in range(0, columns, step):
            stop = min(start + step, columns)
            scales = _block_encoding(scale, order, start, stop)
            zeros = None if symmetric else _block_encoding(zero_point, order, start, stop)
            values = _block_columns(weight, order, start, stop, out=own[: stop - start])
            with single_thread():
                errors = _gptq_block(
                    wt[start:stop],
                    values,
                    factor[start:stop, start:stop],
                    scales,
                    zeros,
                    grid,
                    (work[0], work[1], work[2]),
                )
            loss += errors.loss
            if stop < columns:  # the rest absorbs the batch's errors
                wt[stop:].addmm_(factor[start:stop, stop:].T, errors.matrix)
    if order is not None:
        permute_rows_(wt, torch.argsort(order))
    return wt.T, loss


def gptq_codes(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    grid: IntegerGrid,
    *,
    block: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    overwrite_hessian: bool = False,
    given: torch.Tensor | None = None,
    factor: GptqFactor | None = None,
) -> GptqResult:
    """GPTQ's codes for ``weight`` ``[O, I]`` on the grid ``scale``/``zero_point`` (broadcastable
    to ``[O, I]``: one value per weight, per row ``[O, 1]`` or for all ``[1, 1]``).

    Args:
        weight: the float weight matrix (not modified; worked on transposed in a float64 buffer
            of GPTQ's own, made after the factor, so that the two never wait side by side).
        hessian: ``sum x x^T`` of the layer's inputs, ``[I, I]``; or ``[G, I, I]``, one per
            block of ``O / G`` rows (a grouped convolution's groups).
        scale, zero_point: the encoding.
        grid: the backend's integer range.
        block: columns per lazy batch (any value gives the same codes up to float rounding).
        damp: dampening, relative to the Hessian's mean diagonal (the paper's 1 %).
        act_order: quantize the most active input columns first.
        overwrite_hessian: ``hessian`` (float64) is the caller's to give up: the factor is made
            in its memory, one ``[I, I]`` less (the codes are the same either way).
        given: other codes ``[O, I]`` (the ones GPTQ's must beat) whose error under the dampened
            ``H`` is wanted too (:attr:`GptqResult.given_loss`; one ``[I, I]`` ``H`` only): weighed
            through the factor (:func:`factor_loss`), at about half the cost of a product with
            ``H``, and with no ``H`` needed after the factor took its memory.
        factor: :func:`gptq_factor` of ``hessian`` with these ``damp`` and ``act_order``, made
            before (:class:`~_quantplug.algorithms.weight_matrix.HessianFactors`); ``hessian``
            is then not read.

    Inputs no sample reached (zero rows of ``H``) are rounded to nearest: the data says nothing
    about them, and the weight may serve other inputs the Hessian did not see. ``H`` gives them a
    unit diagonal and no coupling, so no other column's error is pushed onto them.
    """
    made = gptq_factor(hessian, damp, act_order, overwrite_hessian) if factor is None else factor
    order, update = made.order, made.factor
    w = weight.detach()
    scale, zero_point = scale.detach().to(torch.float64), zero_point.detach().to(torch.float64)
    if update.dim() == 3:
        codes, loss = _gptq_rows(w, scale, zero_point, update, order, grid, block, w.shape[0])
    else:
        codes, loss = _gptq_pass(w, scale, zero_point, update, order, grid, block)
        if given is not None:  # D squared summed too: the undampened error's pass over D saved
            squares = torch.zeros(given.shape[1], dtype=torch.float64)
            weighed = factor_loss(weight, given, scale, zero_point, update, order, squares)
            return GptqResult(codes, loss, weighed, squares)
    return GptqResult(codes, loss)


#: column blocks of :func:`factor_loss`'s triangular product (the zeros below the factor's
#: diagonal skipped a block at a time: 8 blocks multiply 56 % of a full product)
TRIANGLE_BLOCKS = 8


def factor_loss(
    weight: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    factor: torch.Tensor,
    order: torch.Tensor | None,
    columns: torch.Tensor | None = None,
) -> float:
    """``tr(D H D^T)`` on the dampened ``H`` of :func:`update_factor`'s ``factor`` (in ``order``)
    for the codes ``[O, I]`` on the encoding given: ``D H D^T = ||D V||^2`` with ``H = V V^T``, and
    column ``k`` of ``D V`` is ``V[k, k] (d_k + sum_{j<k} d_j F[j, k])``. ``V`` is triangular, so
    the product skips the zeros below its diagonal (:data:`TRIANGLE_BLOCKS`): about half a
    product with ``H``. ``factor`` is given back as it came (its diagonal is unit meanwhile).

    ``columns`` (``[I]`` float64, zeros): :func:`column_squares` of the same codes added into it,
    from the same ``D`` (the same slices, values and sums: its pass over ``D`` was the fresh
    memory of two more copies of each slice)."""
    diagonal = factor.diagonal().clone()
    squares = diagonal.square()
    size = factor.shape[0]
    width = max(1, -(-size // TRIANGLE_BLOCKS))
    total = 0.0
    factor.diagonal().fill_(1.0)
    slices = update_slices(codes.shape[0], codes.shape[1])
    held, work = _slice_buffers(slices, codes.shape[1])
    try:
        for rows in slices:
            s = scale[rows] if scale.shape[0] > 1 else scale
            z = zero_point[rows] if zero_point.shape[0] > 1 else zero_point
            delta, dequantized = held[: rows.stop - rows.start], work[: rows.stop - rows.start]
            delta.copy_(weight[rows])
            delta.sub_(dequantized.copy_(codes[rows]).sub_(z).mul_(s))
            if columns is not None:  # column_squares' sums of this slice: the same D, reduced so
                columns += torch.square(delta, out=dequantized).sum(dim=0)
            if order is not None:
                permute_columns_(delta, order)
            for start in range(0, size, width):
                stop = min(start + width, size)
                part = delta[:, :stop] @ factor[:stop, start:stop]
                total += float(part.square_().mul_(squares[start:stop]).sum())
    finally:
        factor.diagonal().copy_(diagonal)
    return total


def undampened_error(
    loss: float,
    weight: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    diagonal: torch.Tensor,
    damp: float,
) -> float:
    """The output error ``tr(D H D^T)`` of GPTQ's codes on the undampened ``[I, I]`` ``H`` (whose
    ``diagonal`` is given), from the ``loss`` GPTQ reported, without a product with ``H``.

    GPTQ's loss is exactly ``tr(D H' D^T)`` on the dampened ``H' = H + lambda I + sum over dead
    inputs of e_i e_i^T`` (:func:`~.weight_matrix.dampen_`: a dead input's zero diagonal becomes 1,
    then every diagonal takes ``lambda``), because ``D = E U`` with ``E`` its scaled errors and
    ``U^T U = H'^-1`` (the paper's identity). So the error on ``H`` is the loss less ``lambda``
    times ``||D||^2`` and the dead inputs' ``D`` squared: an elementwise pass over ``D`` where
    weighing ``D`` by ``H`` was an ``[O, I] x [I, I]`` product (the lm_head of a 110M Llama:
    1.3 s a product). Equal to the product's value up to float rounding (relative 1e-15 on the
    110M Llama's layers), far inside any difference a choice is made on.
    """
    return undampened_from(loss, column_squares(weight, codes, scale, zero_point), diagonal, damp)


def column_squares(
    weight: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor
) -> torch.Tensor:
    """Per column, the weight error ``D`` of ``codes`` squared and summed over rows (float64
    ``[I]``), a few MiB of ``D`` at a time (:func:`update_slices`)."""
    squares = torch.zeros(codes.shape[1], dtype=torch.float64)
    slices = update_slices(codes.shape[0], codes.shape[1])
    held, work = _slice_buffers(slices, codes.shape[1])
    for rows in slices:
        s = scale[rows] if scale.shape[0] > 1 else scale
        z = zero_point[rows] if zero_point.shape[0] > 1 else zero_point
        delta, dequantized = held[: rows.stop - rows.start], work[: rows.stop - rows.start]
        delta.copy_(weight[rows])
        delta.sub_(dequantized.copy_(codes[rows]).sub_(z).mul_(s))
        squares += delta.square_().sum(dim=0)
    return squares


def _slice_buffers(slices: list[slice], columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float64 buffers of the largest of ``slices``' rows, reused slice after slice by
    :func:`factor_loss` and :func:`column_squares` (a slice's ``D`` and its codes dequantized):
    new ones per slice were fresh memory to fault in, 16 MiB a slice (114k page faults on a
    110M Llama). A slice is their leading rows: contiguous, where its own tensor started."""
    rows = max((part.stop - part.start for part in slices), default=0)
    return torch.empty(rows, columns, dtype=torch.float64), torch.empty(rows, columns, dtype=torch.float64)


def undampened_from(loss: float, squares: torch.Tensor, diagonal: torch.Tensor, damp: float) -> float:
    """:func:`undampened_error` from the codes' :func:`column_squares`."""
    diag = diagonal.to(torch.float64)
    dead = diag <= 0
    lam = float(damp) * float(torch.where(dead, torch.ones_like(diag), diag).mean())
    return float(loss) - lam * float(squares.sum()) - float(squares[dead].sum())


@dataclass(frozen=True)
class GptqSearchResult:
    """The encoding (expanded to ``[O, I]``) and codes the scale search chose, and its loss."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    codes: torch.Tensor
    #: per scale group, the range fraction chosen (1: the backend's own encoding of the weight)
    fraction: torch.Tensor
    #: the output error ``tr(D H D^T)`` on the undampened ``H``
    loss: float


#: bytes of stacked candidate rows one search pass may hold (weight, scale, zero point, codes)
SEARCH_BYTES = 64 * 2**20


def gptq_scale_search(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    encode: Encoder,
    grid: IntegerGrid,
    groups: tuple[int, int],
    *,
    symmetric: bool,
    candidates: int = 20,
    max_fraction: float = 1.5,
    block: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
) -> GptqSearchResult:
    """Each row group's range fraction chosen by the error GPTQ leaves at it, and GPTQ's codes.

    SeqMSE before GPTQ picks each scale by the error *nearest rounding* leaves; GPTQ then
    compensates most of that error, and a range that was best for nearest rounding is often not
    the best one to compensate on (a finer grid clips more, and clipping errors are what feedback
    cannot take back). Here the candidates are every fraction of
    :func:`~.seq_mse.candidate_fractions` for a whole row, and SeqMSE's own choice per scale group
    (per block: the block of an outlier input needs another range than the rest of its row, and
    blocks interact through GPTQ's feedback, so they cannot be searched one by one exactly). Each
    is rounded by GPTQ itself and each row group keeps the one whose output error ``d^T H d`` is
    least, on the undampened ``H`` (the data's error, not the regularised one GPTQ solves with).
    Rows never interact in GPTQ (:func:`_gptq_pass`), so a row group's choice is exact, and
    candidates are rounded stacked, many per pass. Encodings come from ``encode`` (the backend's
    observer on the clipped weight), so every candidate is one the backend could have produced.
    """
    w = weight.detach().to(torch.float64)
    h = hessian.detach().to(torch.float64)
    out, inputs = w.shape
    rows = groups[0]
    n_row_groups, n_col_groups = out // rows, inputs // groups[1]
    order = column_order(h, act_order)
    factor = _factor(h, damp, order)
    shape = (n_row_groups, n_col_groups)
    uniform = torch.ones(shape, dtype=torch.float64)
    # every fraction for the whole row, and SeqMSE's choice per scale group (a block of one row
    # can need another range than the others: an outlier input's block)
    per_group = seq_mse_encoding(
        w, h, encode, grid, groups, symmetric=symmetric, candidates=candidates, max_fraction=max_fraction
    ).fraction
    options = [uniform * f for f in candidate_fractions(candidates, max_fraction)] + [per_group]
    per_pass = max(1, SEARCH_BYTES // (5 * 8 * w.numel()))
    best_loss = torch.full((n_row_groups,), float("inf"), dtype=torch.float64)
    best = torch.zeros(n_row_groups, dtype=torch.int64)  # index into options, per row group
    for first in range(0, len(options), per_pass):
        chunk = options[first : first + per_pass]
        encodings = [encode(candidate_weight(w, fraction, groups, symmetric)) for fraction in chunk]
        scale = torch.cat([e[0].to(torch.float64) for e in encodings])
        zero_point = torch.cat([e[1].to(torch.float64) for e in encodings])
        stacked = w.repeat(len(chunk), 1)
        codes, _ = _gptq_rows(stacked, scale, zero_point, factor, order, grid, block, out)
        delta = stacked - (codes - zero_point) * scale
        # a stack of Hessians weighs each copy's row blocks: one copy at a time
        errors = (
            output_error(delta, h)
            if h.dim() == 2
            else torch.cat([output_error(d, h) for d in delta.split(out)])
        )
        losses = errors.reshape(len(chunk), n_row_groups, rows).sum(dim=2)
        for k in range(len(chunk)):  # ties keep the earlier option: fraction 1 (the default) first
            better = losses[k] < best_loss
            best_loss = torch.where(better, losses[k], best_loss)
            best = torch.where(better, torch.full_like(best, first + k), best)
    fraction = torch.stack(options)[best, torch.arange(n_row_groups)]
    scale, zero_point = encode(candidate_weight(w, fraction, groups, symmetric))
    scale, zero_point = scale.to(torch.float64), zero_point.to(torch.float64)
    codes, _ = _gptq_rows(w, scale, zero_point, factor, order, grid, block, out)
    loss = float(output_error(w - (codes - zero_point) * scale, h).sum())
    return GptqSearchResult(scale, zero_point, codes, fraction, loss)


@options_as_fields
class GPTQ(Algorithm):
    """GPTQ at convert: codes for every linear/convolution weight on the backend's grid.

    By default keeps the backend's encoding (or the one an earlier algorithm such as SeqMSE chose)
    and only picks integer codes, so per-block/LPBQ grids, symmetric grids and shared encodings
    stay exactly as the backend made them. With ``scale_search`` it may also choose each
    channel's range (through the backend's own observer, so the grid's rules still hold), on
    layers whose ``H`` summed at least as many rows as they have inputs, never on a shared
    encoding.
    """

    name = "gptq"
    description = "GPTQ: second-order (Hessian) error-compensating rounding of conv/linear weights"
    paper = (
        "Frantar et al. 2023, GPTQ: Accurate Post-Training Quantization for Generative Pre-trained "
        "Transformers"
    )
    act_order: bool = option(True, "quantize the most active input columns first")
    damp: float = option(0.01, "Hessian dampening, relative to its mean diagonal", minimum=0.0)
    lazy_batch: int = option(128, "columns per lazy batch update (speed only)", minimum=1)
    scale_search: int = option(
        0,
        "range fractions per unit of range tried for each channel's scale, judged by the error "
        "GPTQ leaves (0: keep the encoding given)",
        minimum=0,
        maximum=MAX_CANDIDATES,
    )
    max_fraction: float = option(
        1.5, "largest range fraction the scale search tries", minimum=1.0, maximum=16.0
    )
    shrinkage: str = option(
        "singular",
        "shrink H toward its diagonal (Ledoit-Wolf) on layers calibrated on fewer than two rows "
        "per input ('singular': H singular or nearly so), on every layer ('all') or nowhere ('off')",
        choices=SHRINKAGE_CHOICES,
    )
    sequential: bool = sequential_option()

    def __post_init__(self) -> None:
        self._hessians: dict[str, LayerHessian] = {}  # the collectors it made, by weight
        #: the last layer's factor of ``H``, reused by the next ones that read the same input
        self._factors = HessianFactors()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_factors": HessianFactors()}  # a cache: not sent, nor copied

    def _readers(self, own: LayerHessian | None) -> int:
        """How many of this instance's layers read ``own``'s sums (its own layer included; 0:
        none known): those whose factor of the same ``H`` may be the one made first."""
        if own is None:
            return 0
        return own.readers(self._hessians.values())

    def collector(self, site: WeightSite) -> LayerHessian | None:
        if not collects_hessian(site, self.name):
            return None
        self._hessians[site.name] = collector = LayerHessian(site, self.shrinkage, grouped=True)
        return collector

    def _searches(self, site: WeightSite, collected: Any) -> bool:
        """Whether ``site``'s scales are searched: asked for, not shared, and ``H`` summed over at
        least as many rows as the layer has inputs. A singular ``H`` knows nothing of the
        directions its rows leave out, and a scale chosen on it fits the calibration rows (on
        the zoo's CNNs calibrated on 16 images, searching there lost up to 3 dB held out).

        The row count is the collector's that produced ``collected``; where the one remembered
        for this weight is not it (this instance prepared another program since), nothing is
        searched rather than trusting another calibration's count."""
        hessian = self._hessians.get(site.name)
        if self.scale_search <= 0 or site.shared_with or hessian is None:
            return False  # a shared encoding stays shared: codes only
        if hessian.rows < hessian.columns or not isinstance(collected, torch.Tensor):
            return False
        own = hessian.result()
        return own is not None and torch.equal(own, collected)

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        found = matrix_and_hessian(site, grid, collected, compact=True)
        if found is None:
            return None
        matrix, hessian = found
        h = hessian.to(torch.float64)
        given_codes = matrix.matrix_of(codes)
        searches = self._searches(site, collected)
        # one H, not searched (H lent to the factor): the given codes weighed through GPTQ's
        # factor (factor_loss), not a product with H. The scale search compares exact products
        # with H (gptq_scale_search): its candidates and both codes are weighed so, ties exact
        given = None if h.dim() == 2 and not searches else matrix.error(given_codes, h)
        # the Hessian convert made for this call lends GPTQ its memory for the factor (its error
        # needs no H after: undampened_error); the weight is the model's own tensor (compact),
        # converted to float64 per slice where it is read
        own = self._hessians.get(site.name)
        lend = not searches and own is not None and h is hessian and hessian.dim() == 2 and own.made(hessian)
        diagonal = torch.diagonal(h, dim1=-2, dim2=-1).clone()  # before the factor takes h's memory
        # the factor of an equal H made for an earlier layer of the same input, or made now
        # (kept if later layers read that input); h lent to it only if made now
        made_now = []

        def make(hessian: torch.Tensor) -> GptqFactor:
            made_now.append(True)
            return gptq_factor(hessian, self.damp, self.act_order, overwrite=lend)

        readers = 1 if searches else self._readers(own)
        factor = self._factors.get(("gptq", self.damp, self.act_order), h, make, readers)
        lend = lend and bool(made_now)  # h's memory holds the factor only if made now
        result = gptq_codes(
            matrix.weight,
            h,
            matrix.scale,
            matrix.zero_point,
            matrix.grid,
            block=self.lazy_batch,
            damp=self.damp,
            act_order=self.act_order,
            overwrite_hessian=lend,
            given=given_codes if given is None else None,
            factor=factor,
        )
        choice = WeightChoice(codes=matrix.codes(result.codes))
        assert choice.codes is not None
        if given is None:  # from GPTQ's own losses: no product with H, which lent its memory

            def undampened(loss: float | None, of: torch.Tensor) -> float:
                assert loss is not None
                return undampened_error(
                    loss, matrix.weight, of, matrix.scale, matrix.zero_point, diagonal, self.damp
                )

            assert result.given_loss is not None and result.given_squares is not None
            given = undampened_from(result.given_loss, result.given_squares, diagonal, self.damp)
            # the same codes are the same error (two ways of weighing them differ in the last bit)
            same = torch.equal(choice.codes, codes.to(choice.codes.dtype))
            best = given if same else undampened(result.loss, matrix.matrix_of(choice.codes))
        else:
            best = matrix.error(matrix.matrix_of(choice.codes), h)
        del result  # the float64 working weight
        if lend:
            assert own is not None
            own.release(h)  # h holds the factor now: not what the collector made
        if searches:
            search = gptq_scale_search(
                matrix.weight,
                h,
                site_encoder(matrix, grid),
                matrix.grid,
                matrix.groups,
                symmetric=grid.symmetric,
                candidates=self.scale_search,
                max_fraction=self.max_fraction,
                block=self.lazy_batch,
                damp=self.damp,
                act_order=self.act_order,
            )
            if search.loss < best:
                best = search.loss
                weight = matrix.weight.to(torch.float64)
                clipped = candidate_weight(weight, search.fraction, matrix.groups, grid.symmetric)
                scale, zero_point = grid.observe(matrix.weight_of(clipped))
                choice = WeightChoice(
                    codes=matrix.codes(search.codes),
                    scale=scale.reshape(grid.scale.shape),
                    zero_point=None if grid.symmetric else zero_point.reshape(grid.zero_point.shape),
                )
        if not best <= given:
            return None  # the codes it was given (nearest, or an earlier choice) are better
        return choice
