"""GPTQ: weight rounding with second-order error compensation (Frantar et al., ICLR 2023,
"GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers").

Columns of ``W`` are quantized one at a time; after each, the not-yet-quantized columns absorb
its error through the inverse Hessian ``H^-1`` of the layer's output error (``H = sum x x^T``),
the Optimal Brain Surgeon update. Three details make it fast and stable, all from the paper:

* the rows of ``H^-1`` that the updates need are the rows of the upper Cholesky factor of
  ``H^-1`` (scaled), so no inverse is recomputed after a column is removed;
* *lazy batch updates*: the update is applied within a block of ``block`` columns immediately
  and to the rest of the matrix once per block (a matrix product instead of many rank-1 updates);
* *act-order*: columns with the largest ``H`` diagonal (the most active inputs) go first.

Scales and zero points are given (the backend's encoding, or SeqMSE's), one per weight after
expansion, so per-channel and per-group/block (LPBQ) grids are the same code path ("static
groups": the grid is fixed before the first column, which is what keeps act-order and block
grids compatible). The codes always lie in ``[quant_min, quant_max]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quantplug.algorithms.spec import (
    Algorithm,
    AlgorithmOption,
    WeightChoice,
    WeightGrid,
    WeightSite,
    option_values,
)
from quantplug.algorithms.weight_layers import (
    SEQUENTIAL,
    SEQUENTIAL_OPTION,
    LayerHessian,
    improves,
    layer_kind,
    matrix_and_hessian,
)
from quantplug.algorithms.weight_matrix import IntegerGrid, dampened, quantize_codes, small_products
from quantplug.errors import OptionError


@dataclass(frozen=True)
class GptqResult:
    """Integer codes ``[O, I]`` (float tensor of exact integers) and the error they leave."""

    codes: torch.Tensor
    #: the output error ``sum over rows of d^T H d`` of the result under the dampened ``H``,
    #: accumulated column by column (each step's exact Optimal Brain Surgeon increment)
    loss: float


def inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``H^-1`` (``H^-1 = U^T U``), ``H`` dampened first.

    Row ``i`` of ``U`` divided by ``U[i, i]`` is row ``i`` of the inverse of the Hessian
    restricted to columns ``i..``, the only rows the column-by-column update needs.
    """
    h = dampened(hessian.to(torch.float64), damp)
    lower = torch.linalg.cholesky(h)
    inverse = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(inverse, upper=True)


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
) -> GptqResult:
    """GPTQ's codes for ``weight`` ``[O, I]`` on the grid ``scale``/``zero_point`` (both ``[O, I]``).

    Args:
        weight: the float weight matrix (not modified).
        hessian: ``sum x x^T`` of the layer's inputs, ``[I, I]``.
        scale, zero_point: the encoding, expanded to one value per weight.
        grid: the backend's integer range.
        block: columns per lazy batch (any value gives the same codes up to float rounding).
        damp: dampening, relative to the Hessian's mean diagonal (the paper's 1 %).
        act_order: quantize the most active input columns first.

    Inputs no sample reached (zero rows of ``H``) are rounded to nearest: the data says nothing
    about them, and the weight may serve other inputs the Hessian did not see. ``H`` gives them a
    unit diagonal and no coupling, so no other column's error is pushed onto them.
    """
    w = weight.detach().to(torch.float64).clone()
    s = scale.detach().to(torch.float64).expand_as(w)
    z = zero_point.detach().to(torch.float64).expand_as(w)
    h = hessian.detach().to(torch.float64)
    columns = w.shape[1]
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None
    if order is not None:
        w, s, z, h = w[:, order], s[:, order], z[:, order], h[order][:, order]
    u = inverse_hessian_factor(h, damp)
    codes = torch.zeros_like(w)
    loss = 0.0
    step = max(1, int(block))
    with small_products(w.shape[0] * columns * step):
        for start in range(0, columns, step):
            stop = min(start + step, columns)
            wb = w[:, start:stop].clone()
            errors = torch.zeros_like(wb)
            ub = u[start:stop, start:stop]
            for j in range(stop - start):
                col = wb[:, j]
                q = quantize_codes(col, s[:, start + j], z[:, start + j], grid)
                codes[:, start + j] = q
                deq = (q - z[:, start + j]) * s[:, start + j]
                d = ub[j, j]
                err = (col - deq) / d
                loss += float((err * err).sum())
                wb[:, j:] -= err.unsqueeze(1) * ub[j, j:].unsqueeze(0)
                errors[:, j] = err
            w[:, stop:] -= errors @ u[start:stop, stop:]
    if order is not None:
        codes = codes[:, torch.argsort(order)]
    return GptqResult(codes.to(weight.dtype if weight.dtype.is_floating_point else torch.float32), loss)


class GPTQ(Algorithm):
    """GPTQ at convert: codes for every linear/convolution weight on the backend's grid.

    Keeps the backend's encoding (or the one an earlier algorithm such as SeqMSE chose) and only
    picks integer codes, so per-block/LPBQ grids, symmetric grids and shared encodings stay exactly
    as the backend made them.
    """

    name = "gptq"
    description = "GPTQ: second-order (Hessian) error-compensating rounding of conv/linear weights"
    paper = (
        "Frantar et al. 2023, GPTQ: Accurate Post-Training Quantization for Generative Pre-trained "
        "Transformers"
    )
    options = (
        AlgorithmOption("act_order", "bool", True, "quantize the most active input columns first"),
        AlgorithmOption("damp", "float", 0.01, "Hessian dampening, relative to its mean diagonal"),
        AlgorithmOption("lazy_batch", "int", 128, "columns per lazy batch update (speed only)"),
        SEQUENTIAL_OPTION,
    )

    def __init__(
        self, act_order: bool = True, damp: float = 0.01, lazy_batch: int = 128, sequential: bool = SEQUENTIAL
    ) -> None:
        values = option_values(
            self.name,
            self.options,
            {"act_order": act_order, "damp": damp, "lazy_batch": lazy_batch, "sequential": sequential},
        )
        self.sequential: bool = values["sequential"]
        self.act_order: bool = values["act_order"]
        self.damp: float = values["damp"]
        self.lazy_batch: int = values["lazy_batch"]
        if self.damp < 0 or self.lazy_batch < 1:
            raise OptionError(
                f"algorithm 'gptq' needs damp >= 0 and lazy_batch >= 1, got damp={self.damp}, "
                f"lazy_batch={self.lazy_batch}"
            )

    def collector(self, site: WeightSite) -> LayerHessian | None:
        return LayerHessian(site) if layer_kind(site) is not None else None

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        found = matrix_and_hessian(site, grid, collected)
        if found is None:
            return None
        matrix, hessian = found
        result = gptq_codes(
            matrix.weight,
            hessian,
            matrix.scale,
            matrix.zero_point,
            matrix.grid,
            block=self.lazy_batch,
            damp=self.damp,
            act_order=self.act_order,
        )
        if not improves(matrix, hessian, result.codes, codes):
            return None  # the codes it was given (nearest, or an earlier choice) are better
        return WeightChoice(codes=matrix.codes(result.codes))
