"""Weights as matrices, and the integer grid they are quantized on, for the weight-choice algorithms.

AdaRound, SeqMSE and GPTQ all reason about a layer as ``y = W x`` with ``W`` an ``[O, I]`` matrix
(a conv's kernel flattened to ``[O, C*kh*kw]``, matching ``F.unfold``'s patch order) and judge a
quantized ``Ŵ`` by the layer's output error on calibration data:

    E = sum over samples of ||(W - Ŵ) x||^2 = sum over rows o of d_o^T H d_o,   d = W - Ŵ,

where ``H = sum x x^T`` is accumulated batch by batch (:class:`HessianAccumulator`). So no
algorithm here keeps calibration samples: ``H`` is ``I x I`` whatever the data set's size.

A grouped convolution (depthwise: one group per channel) is ``G`` such layers side by side: the
``O / G`` rows of group ``g`` multiply only that group's input patches, so its ``H`` is a stack
``[G, I, I]``, row block ``g`` weighed by ``H[g]`` (:func:`rows_times`). Rows never interact in
these losses, so each block's choice is exactly that of a layer of its own.

Scales and zero points arrive expanded to the matrix (one value per weight), so the same code
serves per-tensor, per-channel and per-block (groupwise, LPBQ) grids; :func:`column_groups` is the
one place that says which columns share a scale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy
import torch

from _quantplug.errors import AlgorithmError, AnnotationError


@dataclass(frozen=True)
class IntegerGrid:
    """The integer codes a weight may take: ``quant_min..quant_max`` (the backend's, never ours)."""

    quant_min: int
    quant_max: int

    def __post_init__(self) -> None:
        if self.quant_min >= self.quant_max:
            raise AnnotationError(
                f"a weight grid needs quant_min < quant_max, got [{self.quant_min}, {self.quant_max}]"
            )

    @property
    def levels(self) -> int:
        return self.quant_max - self.quant_min + 1

    @property
    def code_dtype(self) -> torch.dtype:
        return code_dtype(self.quant_min, self.quant_max)


def code_dtype(quant_min: int, quant_max: int) -> torch.dtype:
    """The narrowest signed integer dtype holding every code of ``[quant_min, quant_max]``.

    Codes are held in it while algorithms choose them: int64 codes of a large weight are twice
    its float32 size (an 8192 x 8192 layer's 512 MiB), an int8 grid's codes an eighth of that.
    Signed, so that differences of codes and zero points do not wrap around as unsigned ones do.
    """
    for dtype in (torch.int8, torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= quant_min and quant_max <= info.max:
            return dtype
    return torch.int64


def quantize_codes(
    w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, grid: IntegerGrid
) -> torch.Tensor:
    """Round-to-nearest codes ``clamp(round(w / scale) + zero_point)`` as float (exact integers)."""
    return torch.clamp(torch.round(w / scale) + zero_point, grid.quant_min, grid.quant_max)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    return (codes - zero_point) * scale


def fake_quantize(
    w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, grid: IntegerGrid
) -> torch.Tensor:
    return dequantize_codes(quantize_codes(w, scale, zero_point, grid), scale, zero_point)


def rows_times(rows: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``rows @ matrix`` where ``matrix`` is one ``[J, K]`` for every row, or a stack ``[G, J, K]``:
    then the rows are ``G`` equal consecutive blocks, block ``g`` multiplied by ``matrix[g]`` (a
    grouped convolution's row blocks and their Hessians)."""
    if matrix.dim() == 2:
        return rows @ matrix
    groups = matrix.shape[0]
    if rows.shape[0] % groups:
        raise AlgorithmError(f"{rows.shape[0]} rows do not split into {groups} equal row blocks")
    return (rows.reshape(groups, -1, rows.shape[1]) @ matrix).reshape(rows.shape[0], matrix.shape[2])


def hessian_factor(hessian: torch.Tensor, relative_floor: float = 1e-7) -> torch.Tensor:
    """``L`` ``[I, k]`` (float64) with ``L L^T = H``, up to eigenvalues below ``relative_floor * max``;
    for a stack ``[G, I, I]``, the stack of each one's factor, zero columns padding them to one ``k``.

    Calibration sets smaller than a layer's input width give a low-rank ``H``; dropping its null
    space makes every product with ``L`` ``k / I`` as costly as one with ``H``, with the same loss
    on the calibration data (``d^T H d = ||d L||^2``).

    Inputs that never carry a value (dead channels: a zero on the diagonal) are zero rows and
    columns of a positive semi-definite ``H`` and are left out before decomposing: the many equal
    zero eigenvalues they make can stop LAPACK's eigensolver from converging (``LinAlgError`` on
    SqueezeNet's and ResNet-18's convolutions). Should it still fail, the SVD of the symmetric
    ``H`` gives the same factor.
    """
    if hessian.dim() == 3:
        factors = [hessian_factor(h, relative_floor) for h in hessian]
        width = max(f.shape[1] for f in factors)
        return torch.stack([torch.nn.functional.pad(f, (0, width - f.shape[1])) for f in factors])
    h = hessian.detach().to(torch.float64)
    live = torch.diagonal(h) > 0
    sub = h[live][:, live]
    sub = (sub + sub.T) / 2
    try:
        values, vectors = torch.linalg.eigh(sub)
    except torch.linalg.LinAlgError:
        vectors, values, _ = torch.linalg.svd(sub)
    keep = values > relative_floor * float(values.max().clamp(min=0)) if values.numel() else values > 0
    factor = torch.zeros(h.shape[0], max(int(keep.sum()), 1), dtype=torch.float64)
    if bool(keep.any()):
        factor[live] = vectors[:, keep] * values[keep].sqrt()
    return factor


#: probe columns that check a low-rank factor's range (:func:`low_rank_factor`)
RANGE_PROBES = 8
#: how far outside a factor's range ``H`` may reach, relative to ``H`` on the same probes
RANGE_TOLERANCE = 1e-10


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (``torch.equal`` takes ``-0.0`` for ``0.0`` and no
    NaN for itself: a factor made of one is not, bit for bit, the other's)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))


_Made = TypeVar("_Made")


class HessianFactors:
    """What an algorithm made of a layer's ``H`` (its factors), kept for the next layers that read
    an equal ``H``: a transformer's query, key and value projections (its MLP's gate and up
    projections) read one input, and each factored the same ``H`` again: 3 of the 7 layers of a
    Llama block (SeqMSE's search factors, GPTQ's Cholesky factor).

    Exact: a result is reused only for an ``H`` with the same bits (:func:`same_bits`) as the one
    it was made from, a copy of which is kept (the caller's may be lent to the factor and
    overwritten), and of the same ``kind`` (what was made, with which options). Not kept: an
    ``H`` over :data:`MAX_BYTES` (its copy would be a second ``[I, I]`` in memory, where its
    products, not its factors, are the cost), nor one no later layer reads (``readers``). The
    copy is dropped after the last of the readers said, or when another layer's ``H`` replaces it
    (readers unknown: at most :data:`MAX_BYTES` held while the algorithm is, after convert).
    """

    #: the largest ``H`` whose results are kept (an ``[I, I]`` float64 of 4096 inputs)
    MAX_BYTES = 128 << 20

    def __init__(self) -> None:
        self._hessian: torch.Tensor | None = None
        #: kind -> (what was made, reads of it still to come; None: unknown)
        self._made: dict[Hashable, tuple[Any, int | None]] = {}
        #: ``readers`` of the calls that give none (:meth:`reading`)
        self._readers: int | None = None

    @contextmanager
    def reading(self, readers: int | None) -> Iterator[None]:
        """Within it, :meth:`get` called without ``readers`` takes these: an algorithm that asks
        for its factors deep inside its search (SeqMSE: two or three kinds per layer) says once,
        per layer, how many layers read its ``H``. With a count, the ``H`` of a layer no other
        reads is not copied nor compared (a 110M Llama's 2048-input down projections: 33 MB
        each), and a shared one's copy is dropped after its last reader."""
        before, self._readers = self._readers, readers
        try:
            yield
        finally:
            self._readers = before

    def get(
        self,
        kind: Hashable,
        hessian: torch.Tensor,
        make: Callable[[torch.Tensor], _Made],
        readers: int | None = None,
    ) -> _Made:
        """``make(hessian)``, or what ``make`` of that ``kind`` gave for an equal ``H`` earlier.
        ``readers``: how many layers read the sums ``hessian`` was made from, this one included,
        each asking once for this ``kind`` (None: unknown; kept until another ``H`` replaces it)."""
        if readers is None:
            readers = self._readers
        known = self._hessian
        if known is None or not same_bits(known, hessian):
            self._hessian, self._made = None, {}
            if hessian.numel() * hessian.element_size() > self.MAX_BYTES:
                return make(hessian)
        entry = self._made.get(kind)
        if entry is not None:
            found: _Made = entry[0]
            left = entry[1]
            if left is not None and left <= 1:  # its last reader: not held any longer
                del self._made[kind]
                if not self._made:
                    self._hessian = None
            elif left is not None:
                self._made[kind] = (found, left - 1)
            return found
        if readers is not None and readers <= 1:
            return make(hessian)
        if self._hessian is None:  # copied before ``make``, which may take ``hessian``'s memory
            self._hessian = hessian.clone()
        made = make(hessian)
        self._made[kind] = (made, None if readers is None else readers - 1)
        return made


#: the most bytes of one call's :func:`seeded_probes` kept for the next calls (an LLM's
#: 2048-input layers' ranks 64-256 take 8 MB); the last 4 kinds asked are kept
PROBE_BYTES = 16 << 20


@functools.lru_cache(maxsize=4)
def _drawn_probes(rows: int, widths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, w, generator=generator, dtype=torch.float64) for w in widths)


def seeded_probes(rows: int, widths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, ...]:
    """Normal ``[rows, w]`` float64 matrices for each ``w`` of ``widths``, drawn in that order
    from one generator seeded with ``seed``: the same values on every call, drawn once for the
    layers that ask the same (an LLM's 10-80 layers of one width; a 110M Llama drew 0.17 s of
    them). Read only: shared by the calls. Over :data:`PROBE_BYTES`, drawn afresh each call."""
    if rows * sum(widths) * 8 > PROBE_BYTES:
        return _drawn_probes.__wrapped__(rows, widths, seed)
    return _drawn_probes(rows, widths, seed)


def low_rank_factor(hessian: torch.Tensor, max_rank: int, seed: int = 0) -> torch.Tensor | None:
    """:func:`hessian_factor` at ``I^2 k`` cost instead of ``I^3``, for an ``H`` of rank ``k`` at
    most ``max_rank``; None when its rank is higher.

    A layer calibrated on ``N`` rows has ``rank(H) <= N``: torchvision's r3d_18 has 13824-input
    convolutions that see 64 rows, whose eigendecomposition takes minutes and whose SeqMSE
    losses cost an ``[O, I] x [I, I]`` product per candidate. ``H`` times ``k`` random columns
    spans its range (a randomized range finder, Halko, Martinsson and Tropp 2011; exact for a
    matrix of rank ``k`` up to rounding); ``H`` restricted to that range is ``k x k``. Ranks
    ``64, 128, ...`` are tried up to ``max_rank``; a few more random columns of ``H`` must lie in
    the range found (:data:`RANGE_TOLERANCE`), else the rank is higher. The random columns come
    from ``seed``: the same factor on every run.
    """
    h = hessian.detach().to(torch.float64)
    inputs = h.shape[0]
    ranks = [64 << n for n in range(max(0, max_rank // 64).bit_length())]
    if inputs * sum(r + RANGE_PROBES for r in ranks) * 8 > PROBE_BYTES:  # drawn as the loop needs
        generator = torch.Generator().manual_seed(seed)
        drawn: Sequence[torch.Tensor] | None = None
    else:  # each rank's from the same seeded generator: the loop's, all drawn first
        drawn = seeded_probes(inputs, tuple(r + RANGE_PROBES for r in ranks), seed)
    for index, rank in enumerate(ranks):
        if drawn is None:
            probes = torch.randn(inputs, rank + RANGE_PROBES, generator=generator, dtype=torch.float64)
        else:
            probes = drawn[index]
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
    return None


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """Per-row output error ``d_o^T H d_o`` of a weight error ``delta`` ``[O, I]`` (``H``: one
    ``[I, I]``, or a stack of ``[I, I]`` for the row blocks of a grouped layer, :func:`rows_times`)."""
    return (rows_times(delta, hessian) * delta).sum(dim=1)


def to_matrix(weight: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """``weight`` as ``[O, I]``: output channels (``axis``) as rows, everything else flattened."""
    if weight.dim() == 0:
        return weight.reshape(1, 1)
    axis = axis % weight.dim()
    return weight.movedim(axis, 0).reshape(weight.shape[axis], -1)


def from_matrix(matrix: torch.Tensor, shape: Sequence[int], axis: int = 0) -> torch.Tensor:
    """Inverse of :func:`to_matrix` for a weight of ``shape``."""
    dims = tuple(int(d) for d in shape)
    if not dims:
        return matrix.reshape(())
    axis = axis % len(dims)
    moved = (dims[axis], *dims[:axis], *dims[axis + 1 :])
    return matrix.reshape(moved).movedim(0, axis)


def column_groups(
    shape: Sequence[int], axis: int | None, block_size: Sequence[int] | None
) -> tuple[int, int] | None:
    """``(rows per scale, columns per scale)`` of the matrix of a weight, or None if not contiguous.

    Per-tensor: one scale for everything. Per-channel along ``axis``: one per row. Per-block with
    ``block_size`` (one entry per dim, ``-1`` for a whole dim; the output axis is dim 0): a block
    is contiguous in the flattened row when it covers whole trailing dims after its first partial
    one, e.g. ``(1, 32)`` on a linear weight or ``(1, 16, kh, kw)`` on a conv (LPBQ's layout).
    Other block shapes give None and the algorithms leave such weights to the backend's default.
    """
    dims = tuple(int(d) for d in shape)
    if not dims:
        return (1, 1)
    out = 0 if axis is None else axis % len(dims)
    rows = dims[out]
    cols = 1
    for i, d in enumerate(dims):
        if i != out:
            cols *= d
    if block_size is None:
        return (rows, cols) if axis is None else (1, cols)
    if axis is not None and axis % len(dims) != 0:
        return None
    block = tuple(d if b == -1 or b > d else int(b) for b, d in zip(block_size, dims))
    if len(block) != len(dims) or block[0] != 1 or any(b <= 0 or d % b for b, d in zip(block, dims)):
        return None
    group = 1
    partial = False  # once a dim is split, every later dim must be whole
    for b, d in zip(block[1:], dims[1:]):
        if partial and b != d:
            return None
        partial = partial or b != d
        group *= b
    return (1, group)


class HessianAccumulator:
    """Streaming ``H = sum x x^T`` over a layer's input rows (float64: sums of many products).

    ``add`` takes the rows a batch contributes (``[N, I]``, linear inputs flattened over leading
    dims or a conv's unfolded patches), so memory stays ``I x I`` whatever the data set's size.
    With ``groups`` (a grouped convolution) it takes ``[G, N, I]``, each group's patches at the
    same ``N`` positions, and sums a stack ``[G, I, I]``.
    """

    def __init__(self, columns: int, groups: int | None = None) -> None:
        self.columns = int(columns)
        self.groups = groups
        stack = () if groups is None else (int(groups),)
        self.sum = torch.zeros(*stack, self.columns, self.columns, dtype=torch.float64)
        self.rows = 0
        #: ``sum_k sum_{i != j} x_ki^2 x_kj^2``: how much ``H``'s off-diagonal terms vary from row
        #: to row, which is what :func:`shrunk_toward_diagonal` needs (one number per ``H``)
        self.fourth = torch.zeros(stack, dtype=torch.float64)

    def add(self, rows: torch.Tensor) -> None:
        x = rows.detach().reshape(self.groups or 1, -1, self.columns).to(torch.float64)
        finite = torch.isfinite(x).all(dim=2).all(dim=0)  # a position broken in any group goes
        if not bool(finite.all()):  # a masked/broken row says nothing about this layer's inputs
            x = x[:, finite]
        if self.groups is None:
            self.sum.addmm_(x[0].T, x[0])
        else:
            self.sum.baddbmm_(x.transpose(1, 2), x)
        squares = x * x
        fourth = (squares.sum(dim=2).square() - squares.square().sum(dim=2)).sum(dim=1)
        self.fourth += fourth if self.groups is not None else fourth[0]
        self.rows += int(x.shape[1])

    def mean(self) -> torch.Tensor:
        """``H / N`` as float64 (what the algorithms' losses are normalised by)."""
        return self.sum / max(self.rows, 1)


def shrunk_toward_diagonal(
    mean: torch.Tensor, fourth: float | torch.Tensor, rows: int
) -> tuple[torch.Tensor, float]:
    """The mean ``x x^T`` shrunk toward its own diagonal, and the shrinkage intensity in [0, 1]
    (a stack ``[G, I, I]``: each shrunk with its own ``fourth``; the largest intensity).

    ``(1 - d) * S + d * diag(S)`` with Ledoit and Wolf's estimate of the intensity that makes it
    the closest (in expected Frobenius norm) to the mean over all data, as Schaefer and Strimmer
    (2005) give it for a diagonal target: the sampling variance of ``S``'s off-diagonal terms over
    their squares, ``d = sum_{i!=j} Var(s_ij) / sum_{i!=j} s_ij^2``, with ``Var(s_ij)`` estimated
    from the rows as ``(mean_k x_ki^2 x_kj^2 - s_ij^2) / N``. ``fourth`` is ``sum_k sum_{i!=j}
    x_ki^2 x_kj^2`` (:attr:`HessianAccumulator.fourth`) and ``rows`` is ``N``.

    Why: fewer rows than inputs leave ``S`` singular, and GPTQ's error feedback then moves error
    into directions no calibration row measured, free on the calibration data and not on other
    data. The diagonal keeps each input's own energy (outlier channels stay heavy) and drops only
    the correlations the rows are too few to estimate; with many rows ``d`` tends to 0.
    """
    if rows < 2:
        return mean, 0.0
    if mean.dim() == 3:  # a grouped layer: each group's H on its own evidence
        groups = [
            shrunk_toward_diagonal(m, float(f), rows)
            for m, f in zip(mean, torch.as_tensor(fourth).reshape(-1))
        ]
        return torch.stack([h for h, _ in groups]), max(d for _, d in groups)
    shrunk = mean.clone()
    intensity = shrink_toward_diagonal_(shrunk, fourth, rows)
    return (mean, 0.0) if intensity is None else (shrunk, intensity)


def shrink_toward_diagonal_(
    mean: torch.Tensor, fourth: float | torch.Tensor, rows: int, intensity: float | None = None
) -> float | None:
    """:func:`shrunk_toward_diagonal` of one ``[I, I]`` in place; its intensity, or None where
    ``mean`` is left as it was (fewer than two rows, or already diagonal). ``intensity``, from an
    earlier call on the same ``mean``, is applied without being estimated again.

    Bit for bit the values :func:`shrunk_toward_diagonal` returns, with one ``[I, I]`` temporary
    instead of three (none with ``intensity``): a 8192-input layer's ``H`` is 512 MiB a copy, and
    its result is made while its sums are held (:meth:`~.weight_layers.LayerHessian.result`)."""
    if rows < 2:
        return None
    diagonal = mean.diagonal().clone()
    mean.diagonal().zero_()  # now the off-diagonal part
    if intensity is None:
        squared = float(mean.square().sum())
        if squared <= 0.0:
            mean.diagonal().copy_(diagonal)
            return None  # already diagonal
        variance = (float(fourth) / rows - squared) / rows
        intensity = min(max(variance / squared, 0.0), 1.0)
    for part in row_slices(mean):  # off - off * d, a slice of rows at a time
        part.sub_(part * intensity)
    mean.diagonal().copy_(diagonal)  # the diagonal loses nothing (its off-diagonal part is 0)
    return intensity


#: elements of one temporary a slice of rows may take (:func:`row_slices`): 32 MiB of float64
SLICE_ELEMENTS = 1 << 22


def row_slices(matrix: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views of consecutive rows of ``matrix`` of about :data:`SLICE_ELEMENTS` elements each:
    elementwise work on an ``[I, I]`` or ``[O, I]`` matrix with a temporary of one slice, not of
    the matrix."""
    rows = max(1, SLICE_ELEMENTS // max(1, matrix[0].numel())) if matrix.shape[0] else 1
    for start in range(0, matrix.shape[0], rows):
        yield matrix[start : start + rows]


#: columns of one tile of :func:`matrix_tiles`
TILE_COLUMNS = 256


def matrix_tiles(rows: int, columns: int) -> Iterator[tuple[slice, slice]]:
    """Tiles of an ``rows`` x ``columns`` matrix (row and column slices): at most
    :data:`TILE_COLUMNS` columns and a 64th of :data:`SLICE_ELEMENTS` elements each (64K: 512
    KiB of float64). Elementwise work on a transposed view reads a tile across the grain within
    the cache, into a temporary the allocator reuses."""
    width = max(1, min(columns, TILE_COLUMNS))
    height = max(1, SLICE_ELEMENTS // 64 // width)
    for start in range(0, rows, height):
        for first in range(0, columns, width):
            yield slice(start, start + height), slice(first, first + width)


def transpose_(matrix: torch.Tensor) -> torch.Tensor:
    """A square contiguous ``matrix`` transposed in its own memory (returned; read through
    ``matrix.T`` it holds the values it held before, column-major).

    Square tiles of :data:`TILE` swapped with their mirror images, through numpy where the dtype
    has a numpy twin: a tile's temporary stays in cache and in the allocator's reused memory,
    where a slab of rows as wide as the matrix (the torch path below) was a fresh 32 MiB
    mapping on a 2048-input layer, 8192 page faults a call (18.5 ms against 5.6 ms)."""
    size = matrix.shape[0]
    array = numpy_view(matrix)
    if array is not None:
        for start in range(0, size, TILE):
            stop = min(start + TILE, size)
            array[start:stop, start:stop] = array[start:stop, start:stop].T.copy()
            for other in range(stop, size, TILE):
                end = min(other + TILE, size)
                tile = array[start:stop, other:end].copy()
                array[start:stop, other:end] = array[other:end, start:stop].T
                array[other:end, start:stop] = tile.T
        return matrix
    rows = max(1, SLICE_ELEMENTS // max(1, size))
    for start in range(0, size, rows):
        stop = min(start + rows, size)
        matrix[start:stop, start:stop] = matrix[start:stop, start:stop].T.clone()
        right = matrix[start:stop, stop:].clone()
        matrix[start:stop, stop:] = matrix[stop:, start:stop].T
        matrix[stop:, start:stop] = right.T
    return matrix


#: side of the square tiles :func:`transpose_` swaps (32 KiB of float64 a tile)
TILE = 64
#: elements of a temporary of the numpy paths of :func:`permute_columns_` and :func:`reverse_`
#: (1 MiB of float64): reused by the allocator, never a fresh mapping to fault in
GATHER_ELEMENTS = 1 << 17


def numpy_view(matrix: torch.Tensor) -> numpy.ndarray | None:
    """``matrix``'s memory as a numpy array (the same memory: writes reach the tensor), or None
    where moving its values through numpy is not the same as through torch (a dtype without a
    numpy twin, a tensor that records gradients or is not on the CPU, a tensor subclass)."""
    if (
        type(matrix) not in (torch.Tensor, torch.nn.Parameter)
        or matrix.dtype not in NUMPY_GATHER
        or matrix.requires_grad
        or matrix.device.type != "cpu"
        or matrix.is_conj()
        or matrix.is_neg()
    ):
        return None
    return matrix.numpy()


def permute_columns_(matrix: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``matrix[:, order]`` written into ``matrix`` itself, a slice of rows at a time.

    The gather is numpy's where the dtype has a numpy twin (the same values: it moves them):
    torch's advanced indexing took 3-5x as long on a 768-wide matrix, and GPTQ's act-order
    permutes every layer's ``H`` and weight. It gathers into one temporary of at most
    :data:`GATHER_ELEMENTS`, reused slice after slice."""
    array = numpy_view(matrix)
    if array is None:
        for part in row_slices(matrix):
            part.copy_(part[:, order])
        return matrix
    index = order.detach().cpu().numpy()
    rows = max(1, GATHER_ELEMENTS // max(1, matrix.shape[1]))
    held = numpy.empty((min(rows, matrix.shape[0]), matrix.shape[1]), dtype=array.dtype)
    for start in range(0, matrix.shape[0], rows):
        slab = array[start : start + rows]
        gathered = held[: slab.shape[0]]
        numpy.take(slab, index, axis=1, out=gathered, mode="clip")  # clip: no buffered copy (all in range)
        slab[...] = gathered
    return matrix


#: dtypes :func:`permute_columns_` gathers through numpy
NUMPY_GATHER = frozenset({torch.float64, torch.float32})


def reverse_(matrix: torch.Tensor) -> torch.Tensor:
    """A contiguous ``matrix``'s rows and columns both reversed in its own memory (returned): row
    ``r`` and row ``R - 1 - r`` swapped and each reversed, a slab of rows at a time (temporaries of
    two slabs). Reversing rows by flips moves contiguous rows, where a permutation of columns
    (:func:`permute_columns_`) gathers element by element: 10-20x as long on a 768-wide matrix.
    Through numpy (where the dtype has a numpy twin) the slab is :data:`GATHER_ELEMENTS` and its
    one temporary reused memory: torch's flips of half the matrix were fresh mappings (2048
    inputs: 15.6 ms, 2.3 ms so)."""
    size = matrix.shape[0]
    half = size // 2
    array = numpy_view(matrix)
    if array is not None:
        rows = max(1, GATHER_ELEMENTS // max(1, matrix.shape[1]))
        for start in range(0, half, rows):
            stop = min(start + rows, half)
            upper = array[start:stop, ::-1][::-1].copy()
            array[start:stop] = array[size - stop : size - start, ::-1][::-1]
            array[size - stop : size - start] = upper
        if size % 2:
            array[half] = array[half, ::-1].copy()
        return matrix
    rows = max(1, SLICE_ELEMENTS // max(1, matrix.shape[1]))
    for start in range(0, half, rows):
        stop = min(start + rows, half)
        top = matrix[start:stop].flip(0, 1)
        matrix[start:stop] = matrix[size - stop : size - start].flip(0, 1)
        matrix[size - stop : size - start] = top
    if size % 2:
        matrix[half] = matrix[half].flip(0)
    return matrix


def dampened(hessian: torch.Tensor, relative: float) -> torch.Tensor:
    """``H + relative * mean(diag H) * I``, and dead inputs (zero diagonal) made harmless.

    A column no calibration sample ever touched has a zero row and column in ``H``: its weights
    cannot change the output on the data, so it gets a unit diagonal (any choice is equally good)
    and the matrix stays positive definite for the Cholesky factorisations.
    """
    if hessian.dim() == 3:
        return torch.stack([dampened(h, relative) for h in hessian])
    return dampen_(hessian.clone(), relative)


def dampen_(hessian: torch.Tensor, relative: float) -> torch.Tensor:
    """:func:`dampened` of one ``[I, I]`` in place (returned)."""
    diag = torch.diagonal(hessian)
    dead = diag <= 0
    diag[dead] = 1.0
    damp = float(relative) * float(diag.mean())
    diag += damp
    return hessian


#: below this many multiply-adds per product, loops of small products run on one thread
SMALL_PRODUCT = 1 << 24


@contextmanager
def small_products(macs: int) -> Iterator[None]:
    """One intra-op thread while a loop runs many products of ``macs`` multiply-adds each.

    Small products gain nothing from threads, and on a busy machine every parallel region waits
    for a descheduled worker (a scheduler time slice, ~10 ms, per matrix product: 100x slower
    than the product itself). The thread count is restored afterwards; results do not depend on
    it beyond float summation order.
    """
    if macs >= SMALL_PRODUCT:
        yield
        return
    with single_thread():
        yield


@contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread within the block (the count restored after): for loops of small
    operations, each of which would otherwise open a parallel region (:func:`small_products`)."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
