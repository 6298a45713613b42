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
    Encoder,
    LayerHessian,
    collects_hessian,
    hessian_of,
    sequential_option,
    site_encoder,
    site_matrix,
)
from _quantplug.algorithms.weight_matrix import (
    IntegerGrid,
    fake_quantize,
    hessian_factor,
    low_rank_factor,
    output_error,
    small_products,
)


@dataclass(frozen=True)
class SeqMseResult:
    scale: torch.Tensor  # [O, I], expanded
    zero_point: torch.Tensor  # [O, I], expanded
    #: chosen fraction of the range per scale group, ``[row groups, column groups]``
    fraction: torch.Tensor
    loss: float  # output error (sum of d^T H d) with the chosen encoding
    default_loss: float  # ... with the backend's default encoding (the full range)


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


def factor_group_losses(delta: torch.Tensor, factor: torch.Tensor, groups: tuple[int, int]) -> torch.Tensor:
    """:func:`group_losses` with ``H = L L^T`` given as ``L`` ``[I, k]``: a scale group's diagonal
    block of ``H`` is ``L_j L_j^T`` (``L_j`` its columns' rows of ``L``)."""
    rows, cols = groups
    o, i = delta.shape
    g = i // cols
    per_row = torch.einsum("ogb,gbk->ogk", delta.reshape(o, g, cols), factor.reshape(g, cols, -1))
    return per_row.pow(2).sum(dim=2).reshape(o // rows, rows, g).sum(dim=1)


def group_loss_function(
    hessian: torch.Tensor, groups: tuple[int, int], shape: torch.Size, evaluations: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`group_losses` for ``evaluations`` weight errors of ``shape``, at the least cost.

    With one scale per row group (per channel, per tensor) each evaluation is an ``[O, I] x
    [I, I]`` product; where those outweigh decomposing ``H`` once (about ``10 I^3``) and ``H`` is
    low-rank (fewer calibration rows than inputs: a ResNet's late convolutions, 4608 inputs and a
    few hundred rows), ``||D L||^2`` with ``H = L L^T`` (:func:`hessian_factor`) gives the same
    losses at ``k / I`` of the cost. Otherwise, where the products would be long (over
    :data:`LOW_RANK_WORK`) and ``H``'s rank is at most ``I / 8``, the same at ``I^2 k`` to factor.
    """
    rows, cols = groups
    out, inputs = int(shape[0]), int(shape[1])
    if hessian.dim() == 2 and cols == inputs and evaluations * out > 10 * inputs:
        factor = hessian_factor(hessian)
        if factor.shape[1] < inputs // 2:
            return lambda delta: (delta @ factor).pow(2).sum(dim=1).reshape(out // rows, rows, 1).sum(dim=1)
    elif hessian.dim() == 2 and evaluations * out * inputs * inputs > LOW_RANK_WORK:
        low = low_rank_factor(hessian, inputs // 8)
        if low is not None:
            return lambda delta: factor_group_losses(delta, low, groups)
    return lambda delta: group_losses(delta, hessian, groups)


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
    """
    w = weight.detach().to(torch.float64)
    h = hessian.detach().to(torch.float64)
    n_row_groups, n_col_groups = w.shape[0] // groups[0], w.shape[1] // groups[1]
    best_loss = torch.full((n_row_groups, n_col_groups), float("inf"), dtype=torch.float64)
    best_fraction = torch.ones(n_row_groups, n_col_groups, dtype=torch.float64)
    default: tuple[torch.Tensor, torch.Tensor] | None = None
    fractions = candidate_fractions(candidates, max_fraction)
    losses_of = group_loss_function(h, groups, w.shape, len(fractions))
    with small_products(w.numel() * groups[1]):
        for f in fractions:
            fraction = torch.full_like(best_fraction, f)
            scale, zero_point = (
                t.to(torch.float64) for t in encode(candidate_weight(w, fraction, groups, symmetric))
            )
            if default is None:
                default = (scale, zero_point)
            losses = losses_of(w - fake_quantize(w, scale, zero_point, grid))
            better = losses < best_loss
            best_loss = torch.where(better, losses, best_loss)
            best_fraction = torch.where(better, fraction, best_fraction)
    assert default is not None
    default_loss = float(output_error(w - fake_quantize(w, *default, grid), h).sum())
    scale, zero_point = (
        t.to(torch.float64) for t in encode(candidate_weight(w, best_fraction, groups, symmetric))
    )
    loss = float(output_error(w - fake_quantize(w, scale, zero_point, grid), h).sum())
    if not loss < default_loss:  # the re-encoded mix (e.g. LPBQ's shared channel scale) lost
        scale, zero_point = default
        best_fraction = torch.ones_like(best_fraction)
        loss = default_loss
    return SeqMseResult(scale, zero_point, best_fraction, loss, default_loss)


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

    def collector(self, site: WeightSite) -> LayerHessian | None:
        return LayerHessian(site, grouped=True) if collects_hessian(site, self.name) else None

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        if site.shared_with:
            return None
        matrix = site_matrix(site, grid)
        if matrix is None:
            return None
        hessian = hessian_of(collected, matrix)
        if hessian is None:
            if not self.data_free:
                return None
            hessian = torch.eye(matrix.weight.shape[1], dtype=torch.float64)

        result = seq_mse_encoding(
            matrix.weight,
            hessian,
            site_encoder(matrix, grid),
            matrix.grid,
            matrix.groups,
            symmetric=grid.symmetric,
            candidates=self.candidates,
            max_fraction=self.max_fraction,
        )
        if bool((result.fraction == 1).all()):
            return None
        if not result.loss < matrix.error(matrix.matrix_of(codes.to(torch.float64)), hessian):
            return None  # the codes it was given (e.g. GPTQ's, AdaRound's) beat nearest on any clipping
        scale, zero_point = grid.observe(
            matrix.weight_of(candidate_weight(matrix.weight, result.fraction, matrix.groups, grid.symmetric))
        )
        scale = scale.reshape(grid.scale.shape)
        if grid.symmetric:
            return WeightChoice(scale=scale)
        return WeightChoice(scale=scale, zero_point=zero_point.reshape(grid.zero_point.shape))
