"""SeqMSE: weight-scale search minimising each layer's output error on calibration data.

As in AIMET's ``apply_seq_mse`` (Qualcomm's LLM recipes): for every scale group (an output
channel, or a block of one for per-block/LPBQ weights) try ranges that are fractions of the
group's own range and keep the one whose quantized weights give the smallest error on the layer's
*output* (not on the weights): ``d^T H d`` with ``H = sum x x^T`` of the layer's inputs. Clipping
large weights trades their error for a finer grid on all the others, which min-max never does.

Where this differs from AIMET 2.42 (``aimet_torch/seq_mse.py``), measured over 24 model/config
cells of ``bench/algorithms_weights.py`` (``bench/results/seq_mse_study.md``):

* the fractions: AIMET tries ``k / 20`` for k = 1..20; here the same kind of steps, finer
  (``candidates = 100``: steps of 0.01) and *beyond* the range (``max_fraction = 1.5``). A range
  wider than min-max is a coarser grid, and yet it can be the better one where a few inputs carry
  most of the layer's output energy (LLM activations' outlier channels): the scale then places
  those inputs' weights on grid points. +2.5 dB on average over AIMET's 20 fractions; on AIMET's
  own decoder +0.6 dB, ahead of AIMET's result on its finer ``[-8, 7]`` grid;
* layer inputs: float by default (AIMET: ``symqt``, the inputs of the model with the earlier
  weights quantized); ``sequential=True`` gives AIMET's (with activations fake-quantized as well).
  It measured +0.02 dB on average either way, as AIMET's own ``symfp``/``symqt``/``asym`` on its
  decoder (within 0.01 dB);
* the loss: the output MSE, AIMET's default (its ``sqnr`` picks the same candidate per channel
  and per block: the signal is fixed there); ``l1`` would need the samples, not ``H``;
* layers: every linear and convolution at any bit width (AIMET: 4-bit Linear and Conv2d only).

The scale of a candidate is not computed here: ``encode`` maps a clipped weight to the encoding
the backend itself would give it (its observer: symmetric or not, its range and eps, LPBQ's 4-bit
scale quantization...), so whatever is chosen is an encoding the backend could have produced.
Per-block losses use the block's own slice of ``H`` (AIMET's block-wise approximation); the final
mix of choices is re-encoded and kept only if it beats the backend's default on the full loss.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from _quantplug.algorithms.spec import (
    Algorithm,
    WeightChoice,
    WeightGrid,
    WeightSite,
    option,
    options_as_fields,
)
from _quantplug.algorithms.weight_layers import (
    MAX_HESSIAN_INPUTS,
    Encoder,
    LayerHessian,
    collects_hessian,
    hessian_of,
    sequential_option,
    site_encoder,
    site_matrix,
)
from _quantplug.algorithms.weight_matrix import (
    HessianFactors,
    IntegerGrid,
    fake_quantize,
    hessian_factor,
    low_rank_factor,
    output_error,
    seeded_probes,
    small_products,
)
from _quantplug.observers import kernels


@dataclass(frozen=True)
class SeqMseResult:
    scale: torch.Tensor  # [O, I], expanded
    zero_point: torch.Tensor  # [O, I], expanded
    #: chosen fraction of the range per scale group, ``[row groups, column groups]``
    fraction: torch.Tensor
    loss: float  # output error (sum of d^T H d) with the chosen encoding
    default_loss: float  # ... with the backend's default encoding (the full range)
    #: ... with the codes it was given (``seq_mse_encoding(codes=...)``; None: none given)
    codes_loss: float | None = None


def group_view(values: torch.Tensor, groups: tuple[int, int]) -> torch.Tensor:
    """``[O, I]`` as ``[O // rows, rows, I // cols, cols]`` (one scale per ``[:, :, g, :]`` slice)."""
    rows, cols = groups
    o, i = values.shape
    return values.reshape(o // rows, rows, i // cols, cols)


def expand_groups(per_group: torch.Tensor, groups: tuple[int, int]) -> torch.Tensor:
    """Per-group values ``[O // rows, I // cols]`` repeated over their groups, ``[O, I]``."""
    rows, cols = groups
    return per_group.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)


def group_losses(delta: torch.Tensor, hessian: torch.Tensor, groups: tuple[int, int]) -> torch.Tensor:
    """Output error of each scale group, using the group's diagonal block of ``H`` (of its row
    block's ``H`` where ``hessian`` is a stack ``[G, I, I]``: a grouped convolution)."""
    rows, cols = groups
    o, i = delta.shape
    g = i // cols
    if hessian.dim() == 3:
        stack = hessian.shape[0]
        blocks = hessian.reshape(stack, g, cols, g, cols).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)
        d = delta.reshape(stack, o // stack, g, cols)
        per_row = torch.einsum("rogb,rgbc,rogc->rog", d, blocks, d).reshape(o, g)
    else:
        blocks = hessian.reshape(g, cols, g, cols).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # [g, c, c]
        d = delta.reshape(o, g, cols)
        per_row = torch.einsum("ogb,gbc,ogc->og", d, blocks, d)
    return per_row.reshape(o // rows, rows, g).sum(dim=1)


def clip_to(
    weight: torch.Tensor, fraction: torch.Tensor, groups: tuple[int, int], symmetric: bool
) -> torch.Tensor:
    """``weight`` clipped, per scale group, to ``fraction`` of the group's range.

    The range includes zero (as the observers' does): symmetric groups clip to
    ``+-fraction * max|w|``, asymmetric ones to ``fraction * [min(w, 0), max(w, 0)]``.
    """
    view = group_view(weight, groups)
    if symmetric:
        bound = view.abs().amax(dim=(1, 3))
        hi = expand_groups(bound * fraction, groups)
        return torch.maximum(torch.minimum(weight, hi), -hi)
    lo = expand_groups(view.amin(dim=(1, 3)).clamp(max=0) * fraction, groups)
    hi = expand_groups(view.amax(dim=(1, 3)).clamp(min=0) * fraction, groups)
    return torch.maximum(torch.minimum(weight, hi), lo)


#: the most range fractions per unit of range a search may try (``candidates``, GPTQ's
#: ``scale_search``): steps of 0.001 of the range, finer than any 16-bit weight grid's use; the
#: cost grows with the count (100000 took minutes on one 40x48 layer)
MAX_CANDIDATES = 1000


def candidate_fractions(candidates: int, max_fraction: float = 1.0) -> list[float]:
    """The range fractions tried: 1 first (ties keep the backend's default), then every
    ``k / candidates`` in ``(0, max_fraction]`` from the largest down."""
    count = max(1, int(candidates))
    top = max(count, math.floor(max_fraction * count + 1e-9))
    return [1.0] + [k / count for k in range(top, 0, -1) if k != count]


def candidate_weight(
    weight: torch.Tensor, fraction: torch.Tensor, groups: tuple[int, int], symmetric: bool
) -> torch.Tensor:
    """A weight whose range, per scale group, is ``fraction`` of its own: clipped where the
    fraction is below 1 (:func:`clip_to`), scaled up where it is above (so the backend's observer
    gives that group a coarser grid; the weight itself is never quantized from this tensor)."""
    wide = expand_groups(fraction.expand(weight.shape[0] // groups[0], weight.shape[1] // groups[1]), groups)
    return torch.where(wide > 1, weight * wide, clip_to(weight, fraction, groups, symmetric))


#: multiply-adds of a layer's direct losses (evaluations x ``[O, I] x [I, I]``) above which a
#: low-rank ``H`` is factored at ``I^2 k`` first (:func:`~.weight_matrix.low_rank_factor`):
#: torchvision's r3d_18, 13824 inputs seen on 64 rows, spent half an hour in those products
LOW_RANK_WORK = 10**12
#: the same for one scale per row group, whose direct losses are whole ``[O, I] x [I, I]``
#: products: a 110M Llama's MLP down projection (768 x 2048, seen on 192 rows) spent 2e10 in its
#: screened search's exact losses, three times what factoring and the factor's products cost.
#: Every layer of the bench's and the tests' models is below it (their exhaustive searches cost
#: under :data:`EXHAUSTIVE_WORK`)
ROWS_LOW_RANK_WORK = 10**10


def factor_group_losses(delta: torch.Tensor, factor: torch.Tensor, groups: tuple[int, int]) -> torch.Tensor:
    """:func:`group_losses` with ``H = L L^T`` given as ``L`` ``[I, k]``: a scale group's diagonal
    block of ``H`` is ``L_j L_j^T`` (``L_j`` its columns' rows of ``L``)."""
    rows, cols = groups
    o, i = delta.shape
    g = i // cols
    per_row = torch.einsum("ogb,gbk->ogk", delta.reshape(o, g, cols), factor.reshape(g, cols, -1))
    return per_row.pow(2).sum(dim=2).reshape(o // rows, rows, g).sum(dim=1)


def group_loss_function(
    hessian: torch.Tensor,
    groups: tuple[int, int],
    shape: torch.Size,
    evaluations: int,
    factors: HessianFactors | None = None,
    dtype: torch.dtype = torch.float64,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`group_losses` for ``evaluations`` weight errors of ``shape``, at the least cost.

    With one scale per row group (per channel, per tensor) each evaluation is an ``[O, I] x
    [I, I]`` product; where those outweigh decomposing ``H`` once (about ``10 I^3``) and ``H`` is
    low-rank (fewer calibration rows than inputs: a ResNet's late convolutions, 4608 inputs and a
    few hundred rows), ``||D L||^2`` with ``H = L L^T`` (:func:`hessian_factor`) gives the same
    losses at ``k / I`` of the cost. Otherwise, where the products would be long (over
    :data:`LOW_RANK_WORK`, :data:`ROWS_LOW_RANK_WORK` per row group) and ``H``'s rank is at most
    ``I / 8``, the same at ``I^2 k`` to factor. ``factors``: those of an equal ``H`` made before.

    ``dtype``: that of the products (the errors, ``H`` or its factor are cast to it; the factors
    are made in float64 either way); the group losses are returned in float64.
    """
    factors = HessianFactors() if factors is None else factors
    rows, cols = groups
    out, inputs = int(shape[0]), int(shape[1])

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype)

    errors: list[torch.Tensor] = []  # one buffer for the errors cast, reused by every evaluation

    def cast_error(delta: torch.Tensor) -> torch.Tensor:
        # a fresh [O, I] per evaluation was pages to fault in each time (an lm_head's: 100 MB)
        if delta.dtype == dtype or delta.shape != (out, inputs):
            return cast(delta)
        if not errors:
            errors.append(torch.empty(out, inputs, dtype=dtype))
        return errors[0].copy_(delta)

    if hessian.dim() == 2 and cols == inputs and evaluations * out > 10 * inputs:
        factor = factors.get("full", hessian, hessian_factor)
        if factor.shape[1] < inputs // 2:
            full = cast(factor)
            return lambda delta: (
                (cast_error(delta) @ full)
                .square_()
                .sum(dim=1)
                .to(torch.float64)
                .reshape(out // rows, rows, 1)
                .sum(dim=1)
            )
    elif hessian.dim() == 2 and evaluations * out * inputs * inputs > (
        ROWS_LOW_RANK_WORK if cols == inputs else LOW_RANK_WORK
    ):
        low = factors.get("low rank", hessian, lambda h: low_rank_factor(h, inputs // 8))
        if low is not None:
            low_cast = cast(low)
            return lambda delta: factor_group_losses(cast_error(delta), low_cast, groups).to(torch.float64)
    h_cast = cast(hessian)
    return lambda delta: group_losses(cast_error(delta), h_cast, groups).to(torch.float64)


#: multiply-adds of an exhaustive search (every candidate judged on the layer's output error:
#: ``evaluations x [O, I] x [I, width]``) above which a layer's candidates are screened first
#: (:func:`screened_encoding`). Every layer of the bench's and the tests' models is below it, so
#: their choices are the exhaustive search's; a 20M-parameter Llama's MLP (768 x 256, per
#: tensor) is 7x above it, and its lm_head (32000 x 256) 1000x: the exhaustive search ran past
#: 3,000 s of convert there
EXHAUSTIVE_WORK = 2**30
#: candidates per scale group that screening hands to the exact output error (with the
#: backend's default, always judged)
SCREENED = 3


def search_work(shape: tuple[int, int], groups: tuple[int, int], evaluations: int) -> int:
    """Multiply-adds of judging ``evaluations`` candidates on the exact output error: an ``[O, I]``
    error times ``H`` (per block: its block's own ``[c, c]`` slice)."""
    out, inputs = int(shape[0]), int(shape[1])
    width = inputs if groups[1] == inputs else groups[1]
    return evaluations * out * inputs * width


def group_values(expanded: torch.Tensor, groups: tuple[int, int]) -> torch.Tensor:
    """One value per scale group, ``[O // rows, I // cols]``, of a tensor constant on each group
    (an encoding expanded to ``[O, I]``)."""
    return group_view(expanded, groups)[:, 0, :, 0]


#: values of a candidate error (:meth:`GroupCandidates.error`) above which it is made in slices
#: of row groups, each through all five passes while it is in cache: an LLM's lm_head's (24M
#: values, 100-200 MB) made whole went five times through memory, twice as long (a 110M Llama's
#: ~40 errors of its lm_head: 0.4 s); below it the weight stays in cache between the passes
WHOLE_ERROR = 1 << 22
#: values per slice of such an error (1 MB of float32: within a core's L2)
ERROR_SLICE = 1 << 18


class GroupCandidates:
    """Candidate weights and their quantization errors for per-group fractions, broadcast over
    the group view ``[O // rows, rows, I // cols, cols]`` instead of expanded: the same values as
    :func:`candidate_weight` and ``W - fake_quantize(W)``, in a third of the passes over the
    weight (a screened search makes ~35 of them per layer; an LLM's lm_head is 8-200M values).

    Both are made in one scratch buffer the size of the weight, which each call overwrites (a
    search uses each result before asking for the next): a fresh tensor per result was a fresh
    mapping of pages to fault in, twice per candidate (an lm_head's is 200 MB).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        groups: tuple[int, int],
        symmetric: bool,
        dtype: torch.dtype | None = None,
        source: torch.Tensor | None = None,
    ) -> None:
        self.weight = weight
        self.groups = groups
        self.symmetric = symmetric
        view = group_view(weight, groups)
        #: ``source``: the weight in the float dtype it was made ``weight`` from (exactly: a
        #: float32 weight made float64), read where its values answer (:meth:`in_dtype`)
        self._source: torch.Tensor | None = None
        self._source_extremes: tuple[torch.Tensor, torch.Tensor] | None = None
        if (
            source is not None
            and weight.dtype == torch.float64
            and source.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and source.shape == weight.shape
            and source.is_contiguous()
        ):
            self._source = group_view(source, groups)
        # the ranges in the weight's own dtype: a float32 candidate's clipping bounds are then
        # the float64 ones rounded, and its clipped values those of the float64 candidate rounded
        if symmetric and self._source is not None:
            # max |w| per group is max(max w, -min w) (negation and conversion exact, NaN kept;
            # abs: a zero's sign +), both read on the source: no [O, I] float64 |W| made (a
            # 110M Llama's: 0.6 s of page faults, mostly its lm_head's), and its extremes are
            # those the candidates in its dtype read (:meth:`in_dtype`)
            low, high = self._source.amin(dim=(1, 3)), self._source.amax(dim=(1, 3))
            self.hi = torch.maximum(high, low.neg()).abs_().to(weight.dtype)
            self.lo = -self.hi
            self._source_extremes = (low, high)
        elif symmetric:
            self.hi = view.abs().amax(dim=(1, 3))
            self.lo = -self.hi
        else:
            self.lo = view.amin(dim=(1, 3)).clamp(max=0)
            self.hi = view.amax(dim=(1, 3)).clamp(min=0)
        self.view = view if dtype is None else view.to(dtype)
        self._scratch: torch.Tensor | None = None
        self._extremes: tuple[torch.Tensor, torch.Tensor] | None = None

    def in_dtype(self, dtype: torch.dtype) -> GroupCandidates:
        """The same candidates in ``dtype`` (its own scratch buffer), on these ranges: as if made
        from the weight with ``dtype``, without a pass more over it to find them."""
        other = GroupCandidates.__new__(GroupCandidates)
        other.weight, other.groups, other.symmetric = self.weight, self.groups, self.symmetric
        other.lo, other.hi = self.lo, self.hi
        other._scratch, other._source, other._source_extremes = None, None, None
        if self._source is not None and self._source.dtype == dtype:
            # the weight's own values in that dtype, which the float64 ones hold exactly: the
            # same values as converting them back, without a copy (a 110M Llama: 0.14 s)
            other.view = self._source
            other._extremes = self._source_extremes
            return other
        other.view = self.view.to(dtype)
        # a rounding to nearest is monotone: the extremes of the values rounded are the extremes
        # rounded (no pass over the weight to find them)
        known = self._extremes
        other._extremes = None if known is None else (known[0].to(dtype), known[1].to(dtype))
        return other

    def _group_extremes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight's min and max per group, in the candidates' dtype (found once)."""
        if self._extremes is None:
            self._extremes = (self.view.amin(dim=(1, 3)), self.view.amax(dim=(1, 3)))
        return self._extremes

    def extremes_at(self, fraction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The min and max per group of :meth:`weight_at`'s values, without making them.

        The same float operations on each group's extremes as :meth:`weight_at` does on its
        values, each monotone non-decreasing (a product by a positive fraction rounded to
        nearest; a clamp): the extremes of the results are the results on the extremes, bit for
        bit (which of two equal extremes, ``-0.0`` or ``0.0``, is reported may differ: no
        observer's encoding reads the sign of a zero extreme)."""
        dtype = self.view.dtype
        low, high = self._group_extremes()
        f = fraction.to(dtype)
        if bool((fraction > 1).all()):
            return low * f, high * f
        lo, hi = self.lo * fraction, self.hi * fraction
        if bool((fraction > 1).any()):
            wide = fraction > 1
            widen = f.clamp(min=1)
            low, high = low * widen, high * widen
            lo, hi = lo.masked_fill(wide, -math.inf), hi.masked_fill(wide, math.inf)
        lo, hi = lo.to(dtype), hi.to(dtype)
        return torch.clamp(low, lo, hi), torch.clamp(high, lo, hi)

    def _buffer(self) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(self.view.shape, dtype=self.view.dtype)
        return self._scratch

    def weight_at(self, fraction: torch.Tensor) -> torch.Tensor:
        """:func:`candidate_weight` for ``fraction`` ``[O // rows, I // cols]`` (in the scratch
        buffer: valid until the next call; in the candidates' dtype)."""
        dtype = self.view.dtype
        f = fraction.to(dtype)[:, None, :, None]
        buffer = self._buffer()
        shape = (self.weight.shape[0], self.weight.shape[1])
        if bool((fraction > 1).all()):
            return torch.mul(self.view, f, out=buffer).reshape(shape)
        lo, hi = self.lo * fraction, self.hi * fraction
        source = self.view
        if bool((fraction > 1).any()):
            # groups scaled up are multiplied by their fraction and clipped to +-inf (no value,
            # nor the sign of a zero, changes); the others multiplied by 1 (exact) and clipped
            wide = fraction > 1
            source = torch.mul(self.view, f.clamp(min=1), out=buffer)
            lo, hi = lo.masked_fill(wide, -math.inf), hi.masked_fill(wide, math.inf)
        # one pass (bounds lo <= 0 <= hi: the same values as min then max)
        clipped = torch.clamp(
            source, lo.to(dtype)[:, None, :, None], hi.to(dtype)[:, None, :, None], out=buffer
        )
        return clipped.reshape(shape)

    def error(self, scale: torch.Tensor, zero_point: torch.Tensor, grid: IntegerGrid) -> torch.Tensor:
        """``W - fake_quantize(W)`` ``[O, I]`` on one scale and zero point per group (in the
        scratch buffer: valid until the next call).

        Symmetric codes in a layout of one scale per row (per channel, per block, per row group)
        are made in one pass by the native kernels (:func:`~_quantplug.observers.kernels.quantization_errors`:
        torch's five operations, each value once); the others by torch, a large weight in slices
        of row groups (:data:`WHOLE_ERROR`). A screened search makes ~40 per layer: on a 110M
        Llama the five passes were 2 s of its 15, the kernel a third of that."""
        dtype = self.view.dtype
        plain = self.symmetric and not bool(zero_point.any())
        view, buffer = self.view, self._buffer()
        shape = (self.weight.shape[0], self.weight.shape[1])
        if plain and (self.groups[0] == 1 or self.groups[1] == shape[1]):
            # one scale per row of [O // rows * I // cols, rows * cols] (a channel's block, or a
            # row group's rows): the same operations as below, in one pass (native kernels)
            per_row = scale.to(dtype).contiguous().reshape(-1)
            width = self.groups[0] * self.groups[1]
            if kernels.quantization_errors(
                view.reshape(-1, width), per_row, grid.quant_min, grid.quant_max, buffer.reshape(-1, width)
            ):
                return buffer.reshape(shape)
        s, z = scale.to(dtype)[:, None, :, None], zero_point.to(dtype)[:, None, :, None]
        step = len(view)
        if view.numel() > WHOLE_ERROR:  # row-group slices of about ERROR_SLICE values
            step = max(1, ERROR_SLICE // max(1, view[0].numel()))
        for start in range(0, len(view), step):
            part = slice(start, start + step)
            sp = s if s.shape[0] == 1 else s[part]
            codes = torch.div(view[part], sp, out=buffer[part]).round_()
            if plain:
                codes.clamp_(grid.quant_min, grid.quant_max).mul_(sp)
            else:
                zp = z if z.shape[0] == 1 else z[part]
                codes.add_(zp).clamp_(grid.quant_min, grid.quant_max).sub_(zp).mul_(sp)
            torch.sub(view[part], codes, out=codes)
        return buffer.reshape(shape)


#: leading eigen-directions of ``H`` the screening loss keeps exactly (the rest by its diagonal)
SCREENING_RANK = 32


def leading_factor(hessian: torch.Tensor, rank: int, seed: int = 0) -> torch.Tensor:
    """``L`` ``[I, r]`` with ``L L^T`` the best rank-``r`` approximation of ``H`` (its leading
    eigenpairs), by a randomized subspace iteration (Halko, Martinsson and Tropp 2011) at ``I^2 r``
    per step: an LLM's wide layers (2048-8192 inputs) are too wide for a full eigendecomposition
    per layer. The probes come from ``seed``: the same factor on every run."""
    inputs = hessian.shape[0]
    r = min(rank, inputs)
    (probes,) = seeded_probes(inputs, (r + 8,), seed)
    basis = torch.linalg.qr(hessian @ probes).Q
    for _ in range(2):  # two power steps: the leading directions of an LLM's H stand out
        basis = torch.linalg.qr(hessian @ basis).Q
    values, vectors = torch.linalg.eigh(basis.T @ hessian @ basis)
    values, vectors = values[-r:].clamp(min=0), vectors[:, -r:]
    return (basis @ vectors) * values.sqrt()


def screening_losses(
    delta: torch.Tensor, factor: torch.Tensor | None, residual: torch.Tensor, groups: tuple[int, int]
) -> torch.Tensor:
    """Per scale group, the output error on ``H ~ L L^T + diag(residual)``: its leading directions
    exactly (within each group's columns, as :func:`group_losses` takes a block's own slice of
    ``H``), the rest by the diagonal. ``delta`` is overwritten."""
    if factor is None:
        return diagonal_losses(delta, residual, groups)
    rows, cols = groups
    out, inputs = delta.shape
    g = inputs // cols
    projected = torch.einsum("ogc,gcr->ogr", delta.reshape(out, g, cols), factor.reshape(g, cols, -1))
    leading = projected.square_().sum(dim=2).reshape(out // rows, rows, g).sum(dim=1)
    return leading + diagonal_losses(delta, residual, groups)


def diagonal_losses(delta: torch.Tensor, diagonal: torch.Tensor, groups: tuple[int, int]) -> torch.Tensor:
    """Per scale group, ``sum_i H_ii d_i^2``: the output error without the inputs' correlations
    (``diagonal`` ``[I]``, or ``[G, I]`` for a stack of Hessians over ``G`` row blocks). Costs as
    much as the error itself, where the exact loss costs ``I`` (or the block's width) times more.
    ``delta`` is overwritten."""
    out, inputs = delta.shape
    squared = delta.square_()
    if diagonal.dim() == 1 and groups[1] == inputs:  # rows: one product, no [O, I] pass more
        rows = groups[0]
        return (squared @ diagonal).reshape(out // rows, rows).sum(dim=1, keepdim=True)
    if diagonal.dim() == 2:
        stack = diagonal.shape[0]
        per_input = torch.einsum("gri,gi->gri", squared.reshape(stack, -1, inputs), diagonal).reshape(
            out, inputs
        )
    else:
        per_input = squared.mul_(diagonal)
    return group_view(per_input, groups).sum(dim=(1, 3))


@dataclass(frozen=True)
class GroupSearch:
    """A search's result per scale group, ``[O // rows, I // cols]`` each: the chosen fraction,
    its exact group loss and encoding, and the backend default's group loss and encoding (the
    encodings as :class:`GroupCandidates` read them: one value per group)."""

    fraction: torch.Tensor
    loss: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    default_loss: torch.Tensor
    #: the default's encoding as ``encode`` gave it, expanded to ``[O, I]``
    default: tuple[torch.Tensor, torch.Tensor]
    #: the group losses of ``codes_delta`` where it is the default's error (None: it is not)
    codes_loss: torch.Tensor | None = None


def encode_at(
    encode: Encoder, made: GroupCandidates, fraction: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``encode(made.weight_at(fraction))``: from the candidate's extremes per group where the
    encoder knows the encoding from those alone (:meth:`SiteEncoder.of_extremes`: a min/max
    observer per channel), without making the candidate and reading it (three passes over the
    weight per candidate, a search's candidates being a few dozen per layer); the same values."""
    of_extremes = getattr(encode, "of_extremes", None)
    if of_extremes is not None:
        found = of_extremes(*made.extremes_at(fraction))
        if found is not None:
            return found  # type: ignore[no-any-return]
    return encode(made.weight_at(fraction))


def slot_encoding(
    encode: Encoder, made: GroupCandidates, numerator: torch.Tensor, count: int
) -> tuple[torch.Tensor, ...]:
    """The backend's encoding of the candidate at fractions ``numerator / count`` per group: its
    scale and zero point per group, then expanded to ``[O, I]`` as ``encode`` gave them (float64)."""
    expanded = [t.to(torch.float64) for t in encode_at(encode, made, numerator.to(torch.float64) / count)]
    return (*(group_values(t, made.groups) for t in expanded), *expanded)


def insert_sorted(
    losses: torch.Tensor, keys: torch.Tensor, loss: torch.Tensor, key: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``len(losses)`` of ``losses`` with ``loss`` appended, in a stable ascending sort
    along dim 0 (NaN last, as ``torch.sort`` puts it), and ``keys`` with ``key`` in the same
    order, for ``losses`` so sorted already: ``loss`` goes after every one not above it (NaN:
    after all). The same as ``argsort(cat(...), stable=True)`` and two gathers, in a few
    elementwise passes: a sort per screening candidate was 0.3 s of a 110M Llama's search."""
    at = torch.where(loss.isnan(), len(losses), (losses <= loss).sum(dim=0))
    slot = torch.arange(len(losses)).reshape(-1, *([1] * loss.dim()))
    before, here = slot < at, slot == at

    def merged(kept: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        shifted = torch.cat([kept[:1], kept[:-1]])  # slot j after the new one: kept's j - 1
        return torch.where(before, kept, torch.where(here, new, shifted))

    return merged(losses, loss), merged(keys, key)


def screened_numerators(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    encode: Encoder,
    grid: IntegerGrid,
    groups: tuple[int, int],
    symmetric: bool,
    count: int,
    top: int,
    factors: HessianFactors | None = None,
    made: GroupCandidates | None = None,
) -> torch.Tensor:
    """:func:`screened_encoding`'s screening: the :data:`SCREENED` best fraction numerators per
    group, best first, ``[SCREENED, O // rows, I // cols]`` (-1: fewer were tried), in float32."""
    factors = HessianFactors() if factors is None else factors
    step = max(1, round(math.sqrt(top)))
    shape = (weight.shape[0] // groups[0], weight.shape[1] // groups[1])
    # narrow blocks (LPBQ's, groupwise): each block's own slice of H costs no more than the
    # leading directions would; rows (per channel, per tensor): H's leading directions and diagonal
    narrow = groups[1] < weight.shape[1] and groups[1] <= 2 * SCREENING_RANK
    factor = (
        None
        if hessian.dim() == 3 or narrow
        else factors.get("leading", hessian, lambda h: leading_factor(h, SCREENING_RANK))
    )
    residual = torch.diagonal(hessian, dim1=-2, dim2=-1)
    if factor is not None:
        residual = (residual - factor.square().sum(dim=1)).clamp(min=0)
        factor = factor.to(torch.float32)
    residual = residual.to(torch.float32)
    narrow_hessian = hessian.to(torch.float32) if narrow else hessian
    kept = torch.full((SCREENED, *shape), -1, dtype=torch.int64)  # fraction numerators, best first
    kept_loss = torch.full((SCREENED, *shape), float("inf"), dtype=torch.float32)
    candidate = (
        GroupCandidates(weight, groups, symmetric, dtype=torch.float32)
        if made is None
        else made.in_dtype(torch.float32)
    )

    def consider(k: torch.Tensor) -> None:
        nonlocal kept, kept_loss
        scale, zero_point, _, _ = slot_encoding(encode, candidate, k, count)
        delta = candidate.error(scale, zero_point, grid)
        loss = (
            group_losses(delta, narrow_hessian, groups)
            if narrow
            else screening_losses(delta, factor, residual, groups)
        )
        loss = torch.where((kept == k).any(dim=0), float("inf"), loss)  # judged already
        kept_loss, kept = insert_sorted(kept_loss, kept, loss, k)  # ties keep the earlier

    for numerator in [count, *(k for k in range(top, 0, -step) if k != count)]:
        consider(torch.full(shape, numerator, dtype=torch.int64))
    centre = kept[0].clone()
    for offset in (j for i in range(1, step) for j in (i, -i)):
        consider((centre + offset).clamp(1, top))
    return kept


def screened_encoding(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    encode: Encoder,
    grid: IntegerGrid,
    groups: tuple[int, int],
    *,
    symmetric: bool,
    candidates: int,
    max_fraction: float,
    losses_of: Callable[[torch.Tensor], torch.Tensor],
    codes_delta: torch.Tensor | None = None,
    factors: HessianFactors | None = None,
    made: GroupCandidates | None = None,
) -> GroupSearch:
    """Per scale group, the range fraction with the least output error among a screened few:
    :func:`seq_mse_encoding`'s search for layers where judging every candidate exactly would cost
    over :data:`EXHAUSTIVE_WORK` (an LLM's layers: an ``[O, I] x [I, I]`` product per candidate).

    Every candidate is first scored, per group, on ``H``'s leading directions and its diagonal
    (:func:`screening_losses`; a narrow block on its own slice of ``H``), coarse to fine: every
    ``step``-th fraction of :func:`candidate_fractions` (``step`` about the square root of their
    count), then each group's best one's neighbours at the search's own resolution. The
    :data:`SCREENED` best per group, and the backend's default, are then judged on the exact
    output error, all groups at once (one product with ``H`` per slot: ``losses_of``, whose
    products :func:`seq_mse_encoding` makes float32; in float64 they were a third of a 110M
    Llama's search, and at float32 its program came out the same, bit for bit). So the search
    costs ``~2 sqrt(n)`` quantizations and ``SCREENED + 1`` exact losses instead of ``n`` exact
    losses. The screening runs in float32 (its candidate weights are the float64 ones rounded,
    which is what the observer reads anyway; its errors those of the backend's float32
    quantization): it only ranks, and the exact losses decide; in float64 its passes over the
    weight and products with the leading directions were most of an LLM's convert.
    ``codes_delta``, the error of the codes the weight has so far, is compared with the
    default's: where they are the same values, they have the same losses, judged once.
    ``factors``: those of an equal ``H`` made before (:class:`HessianFactors`); ``made``: the
    weight's :class:`GroupCandidates` (float64), if the caller has them.
    """
    count = max(1, int(candidates))
    top = max(count, math.floor(max_fraction * count + 1e-9))
    shape = (weight.shape[0] // groups[0], weight.shape[1] // groups[1])
    exact = GroupCandidates(weight, groups, symmetric) if made is None else made
    kept = screened_numerators(weight, hessian, encode, grid, groups, symmetric, count, top, factors, exact)

    best = torch.full(shape, count, dtype=torch.int64)  # the default first: ties keep it
    default_scale, default_zero_point, *default = slot_encoding(encode, exact, best, count)
    default_delta = exact.error(default_scale, default_zero_point, grid)
    same = codes_delta is not None and torch.equal(default_delta, codes_delta)
    default_loss = losses_of(default_delta)
    best_loss, best_scale, best_zero_point = default_loss, default_scale, default_zero_point
    for slot in (torch.where(k < 0, count, k) for k in kept):
        scale, zero_point, _, _ = slot_encoding(encode, exact, slot, count)
        loss = losses_of(exact.error(scale, zero_point, grid))
        better = loss < best_loss
        best_loss, best = torch.where(better, loss, best_loss), torch.where(better, slot, best)
        best_scale = torch.where(better, scale, best_scale)
        best_zero_point = torch.where(better, zero_point, best_zero_point)
    return GroupSearch(
        best.to(torch.float64) / count,
        best_loss,
        best_scale,
        best_zero_point,
        default_loss,
        (default[0], default[1]),
        default_loss if same else None,
    )


def exhaustive_fractions(
    w: torch.Tensor,
    encode: Encoder,
    grid: IntegerGrid,
    groups: tuple[int, int],
    symmetric: bool,
    fractions: list[float],
    losses_of: Callable[[torch.Tensor], torch.Tensor],
    made: GroupCandidates | None = None,
) -> torch.Tensor:
    """Per scale group, the fraction of ``fractions`` (all groups at one fraction per
    evaluation) with the least group loss; ties keep the earlier (fraction 1 is first).
    ``made``: ``w``'s :class:`GroupCandidates`, if the caller has them."""
    shape = (w.shape[0] // groups[0], w.shape[1] // groups[1])
    best_loss = torch.full(shape, float("inf"), dtype=torch.float64)
    best_fraction = torch.ones(shape, dtype=torch.float64)
    # candidate_weight's values, in one buffer
    candidate = GroupCandidates(w, groups, symmetric) if made is None else made
    with small_products(w.numel() * groups[1]):
        for f in fractions:
            fraction = torch.full_like(best_fraction, f)
            scale, zero_point = (
                group_values(t.to(torch.float64), groups) for t in encode_at(encode, candidate, fraction)
            )
            losses = losses_of(candidate.error(scale, zero_point, grid))
            better = losses < best_loss
            best_loss = torch.where(better, losses, best_loss)
            best_fraction = torch.where(better, fraction, best_fraction)
    return best_fraction


def seq_mse_encoding(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    encode: Encoder,
    grid: IntegerGrid,
    groups: tuple[int, int],
    *,
    symmetric: bool,
    candidates: int = 100,
    max_fraction: float = 1.5,
    codes: torch.Tensor | None = None,
    current: tuple[torch.Tensor, torch.Tensor] | None = None,
    factors: HessianFactors | None = None,
    made: GroupCandidates | None = None,
) -> SeqMseResult:
    """The per-group range (and so the encoding) with the least output error.

    Args:
        weight: ``[O, I]`` float weights.
        hessian: ``sum x x^T`` (or its mean) of the layer's inputs, ``[I, I]``, or one per
            block of ``O / G`` rows, ``[G, I, I]`` (a grouped convolution).
        encode: the backend's encoding of a weight (:func:`candidate_weight`), expanded to ``[O, I]``.
        grid: the backend's integer range.
        groups: ``(rows, cols)`` sharing one scale (:func:`~.weight_matrix.column_groups`).
        symmetric: whether the grid is symmetric (clipping keeps it centred on zero).
        candidates: range fractions tried per unit of range, ``k / candidates``.
        max_fraction: the largest fraction tried (:func:`candidate_fractions`).
        codes: the weight's codes so far (``[O, I]``, on the encoding ``current``: scale and zero
            point broadcastable to ``[O, I]``), judged on the same loss as the search's choice
            (:attr:`SeqMseResult.codes_loss`, where the choice is not the default): an earlier
            algorithm's codes may beat any clipping.
        factors: :class:`HessianFactors` kept from earlier layers (that of the same input reuse
            them); None: made for this call only.
        made: the :class:`GroupCandidates` of ``weight`` in float64 (its values, these
            ``groups`` and ``symmetric``), where the caller keeps them to make the chosen
            candidate after (their ranges are a pass over the weight); their scratch buffer is
            freed on return. None: made here.
    """
    factors = HessianFactors() if factors is None else factors
    w = weight.detach().to(torch.float64)
    h = hessian.detach().to(torch.float64)
    fractions = candidate_fractions(candidates, max_fraction)
    screen = search_work((w.shape[0], w.shape[1]), groups, len(fractions)) > EXHAUSTIVE_WORK
    rows = groups[1] == w.shape[1]
    codes_delta = None
    if codes is not None and current is not None:
        # w - (codes - z) * s in one buffer (an lm_head's is 200 MB)
        codes_delta = codes.to(torch.float64, copy=True).sub_(current[1]).mul_(current[0])
        codes_delta = torch.sub(w, codes_delta, out=codes_delta)
    with small_products(w.numel()):  # H's factor: LAPACK's threads wait on a busy machine
        losses_of = group_loss_function(
            h,
            groups,
            w.shape,
            SCREENED + 3 if screen else len(fractions),
            factors,
            torch.float32 if screen else torch.float64,
        )
    # candidate_weight's values, without expanding
    made = GroupCandidates(w, groups, symmetric) if made is None else made
    search: GroupSearch | None = None
    if screen:
        with small_products(w.numel()):
            search = screened_encoding(
                w,
                h,
                encode,
                grid,
                groups,
                symmetric=symmetric,
                candidates=candidates,
                max_fraction=max_fraction,
                losses_of=losses_of,
                codes_delta=codes_delta,
                factors=factors,
                made=made,
            )
        best_fraction = search.fraction
    else:
        best_fraction = exhaustive_fractions(w, encode, grid, groups, symmetric, fractions, losses_of, made)

    def error(delta: torch.Tensor) -> float:
        # per row group the group losses are the exact output error; per block they take the
        # block's own slice of H, so the mix is judged on the full H
        return float((losses_of(delta) if rows else output_error(delta, h)).sum())

    def total(scale: torch.Tensor, zero_point: torch.Tensor) -> float:
        return error(w - fake_quantize(w, scale, zero_point, grid))

    codes_loss = None
    if search is not None and rows:  # the screened search judged the default on this same loss
        default, default_loss = search.default, float(search.default_loss.sum())
        if search.codes_loss is not None:
            codes_loss = float(search.codes_loss.sum())
    else:
        default_scale, default_zero_point = encode_at(encode, made, torch.ones_like(best_fraction))
        default = (default_scale.to(torch.float64), default_zero_point.to(torch.float64))
        default_delta = w - fake_quantize(w, *default, grid)
        default_loss = error(default_delta)
        if codes_delta is not None and torch.equal(default_delta, codes_delta):
            codes_loss = default_loss  # the codes are the default's: the same loss
        del default_delta
    scale, zero_point = (t.to(torch.float64) for t in encode_at(encode, made, best_fraction))
    made._scratch = None  # an [O, I] float64 (the caller's made remakes it if it asks)
    if (
        search is not None
        and rows
        and torch.equal(group_values(scale, groups), search.scale)
        and torch.equal(group_values(zero_point, groups), search.zero_point)
    ):
        # every group got the encoding its slot had (a per-channel observer): the mix's error is
        # the sum of the losses the search measured on exactly these rows
        loss = float(search.loss.sum())
    else:
        loss = total(scale, zero_point)
    if not loss < default_loss:  # the re-encoded mix (e.g. LPBQ's shared channel scale) lost
        scale, zero_point = default
        best_fraction = torch.ones_like(best_fraction)
        loss = default_loss
    if codes_loss is None and codes_delta is not None and bool((best_fraction != 1).any()):
        codes_loss = error(codes_delta)
    return SeqMseResult(scale, zero_point, best_fraction, loss, default_loss, codes_loss)


@options_as_fields
class SeqMSE(Algorithm):
    """SeqMSE at convert: a new encoding per linear/convolution weight, codes rounded to nearest.

    Weights without collected layer inputs (an LSTM's, a transposed convolution's, a layer the
    calibration data never reached) have no output error to measure; with ``data_free`` they get
    the clipping that minimises the weights' own squared error instead (``H = I``), which still
    beats min-max at 4 bits. A weight whose
    encoding is shared with other weights keeps it (a shared encoding stays shared).
    """

    name = "seq_mse"
    description = "SeqMSE: per-channel / per-block weight-scale search minimising each layer's output error"
    paper = (
        "AIMET's sequential MSE (Qualcomm AI Research, LLM recipes); Nagel et al. 2021, "
        "A White Paper on Neural Network Quantization (sec. 3.4)"
    )
    candidates: int = option(
        100, "range fractions tried per unit of range (k/n; AIMET: 20)", minimum=1, maximum=MAX_CANDIDATES
    )
    max_fraction: float = option(
        1.5,
        "largest range fraction tried (above 1: coarser than min-max; AIMET: 1)",
        minimum=1.0,
        maximum=16.0,
    )
    data_free: bool = option(True, "weights without a re-runnable layer: minimise the weights' own error")
    sequential: bool = sequential_option()

    def __post_init__(self) -> None:
        #: the last layer's factors of ``H``, reused by the next one if it reads the same input
        self._factors = HessianFactors()
        #: the collectors it made, by weight: how many layers read one's sums (:meth:`_readers`);
        #: weakly, so that this instance does not hold their ``[I, I]`` sums past their program's
        self._hessians: weakref.WeakValueDictionary[str, LayerHessian] = weakref.WeakValueDictionary()

    def __getstate__(self) -> dict[str, Any]:
        # caches: not sent, nor copied (weak references do not pickle)
        return {**self.__dict__, "_factors": HessianFactors(), "_hessians": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._hessians = weakref.WeakValueDictionary()

    def _readers(self, site: WeightSite, collected: Any) -> int | None:
        """How many of this instance's layers read the sums ``site``'s collector reads (its own
        included), for :meth:`HessianFactors.reading`; None (unknown: its factors are kept until
        another ``H`` replaces them, as before counts) where the collector is not known, or
        ``collected`` is not what it made (another calibration's)."""
        own = self._hessians.get(site.name)
        if own is None or not own.made(collected):
            return None
        return own.readers(self._hessians.values())

    def collector(self, site: WeightSite) -> LayerHessian | None:
        if not collects_hessian(site, self.name):
            return None
        self._hessians[site.name] = collector = LayerHessian(site, grouped=True)
        return collector

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        if site.shared_with:
            return None
        # compact: the weight as it is (made float64 once, below) and a per-channel encoding as
        # [O, 1], which is all codes_delta broadcasts: two [O, I] float64 copies less per layer
        matrix = site_matrix(site, grid, compact=True)
        if matrix is None:
            return None
        hessian = hessian_of(collected, matrix)
        readers = None if hessian is None else self._readers(site, collected)
        if hessian is None:
            if not self.data_free or matrix.weight.shape[1] > MAX_HESSIAN_INPUTS:
                # too wide for a Hessian: skipped as collects_hessian warned, identity included
                # (a 65,536-input layer's would be 32 GiB of float64)
                return None
            hessian = torch.eye(matrix.weight.shape[1], dtype=torch.float64)

        weight = matrix.weight.to(torch.float64)
        # the candidates' ranges found once, for the search and for the chosen candidate
        made = GroupCandidates(weight, matrix.groups, grid.symmetric, source=matrix.weight)
        with self._factors.reading(readers):
            result = seq_mse_encoding(
                weight,
                hessian,
                site_encoder(matrix, grid),
                matrix.grid,
                matrix.groups,
                symmetric=grid.symmetric,
                candidates=self.candidates,
                max_fraction=self.max_fraction,
                codes=matrix.matrix_of(codes),
                current=(matrix.scale, matrix.zero_point),
                factors=self._factors,
                made=made,
            )
        if bool((result.fraction == 1).all()):
            return None
        assert result.codes_loss is not None  # codes were given
        if not result.loss < result.codes_loss:
            return None  # the codes it was given (e.g. GPTQ's, AdaRound's) beat nearest on any clipping
        chosen = made.weight_at(result.fraction)
        scale, zero_point = grid.observe(matrix.weight_of(chosen))
        scale = scale.reshape(grid.scale.shape)
        if grid.symmetric:
            return WeightChoice(scale=scale)
        return WeightChoice(scale=scale, zero_point=zero_point.reshape(grid.zero_point.shape))
