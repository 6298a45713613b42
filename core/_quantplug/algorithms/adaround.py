"""AdaRound: learned up-or-down rounding per layer (Nagel et al., ICML 2020, "Up or Down?
Adaptive Rounding for Post-Training Quantization").

Each weight may round down (``floor(w / s)``) or up (one more); a continuous variable ``V`` per
weight chooses, through the rectified sigmoid ``h(V) = clip(sigmoid(V) (zeta - gamma) + gamma,
0, 1)``. ``V`` is trained with Adam to minimise the layer's output error plus a regulariser
``lambda * sum(1 - |2 h(V) - 1|^beta)`` that pushes every ``h`` to 0 or 1, with ``beta`` annealed
from 20 to 2 after a warm start (the paper's schedule, AIMET's defaults). The output error uses
``H = sum x x^T`` of the layer's float inputs, so a step costs one ``[O, I] x [I, I]`` product,
whatever the amount of calibration data.

Guarantees, by construction: every code is ``floor + 0`` or ``floor + 1`` (so within one step of
round-to-nearest) and is clamped to the backend's ``[quant_min, quant_max]``; a ``time_budget``
(seconds) stops training early and still gives a valid rounding (the current hard choice), and
the result is never worse on the calibration loss than round-to-nearest (it falls back to it).
"""

from __future__ import annotations

import math
import time
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
    LayerHessian,
    collects_hessian,
    improves,
    matrix_and_hessian,
    sequential_option,
)
from _quantplug.algorithms.weight_matrix import (
    IntegerGrid,
    hessian_factor,
    quantize_codes,
    rows_times,
    small_products,
)
from _quantplug.errors import OptionError

ZETA = 1.1
GAMMA = -0.1


@dataclass(frozen=True)
class AdaroundSchedule:
    """Training settings: AIMET's schedule (beta 20 -> 2 after a 20 % warm start, Adam).

    The two loss terms are made scale-free: the reconstruction error is divided by
    round-to-nearest's and the regulariser by the number of weights, so ``reg_weight`` means the
    same on every layer whatever its weights' and inputs' magnitudes (AIMET's raw sums need a
    ``reg_param`` tuned per model). 500 steps at ``1e-2`` reach what 10,000 at ``1e-3`` reach on
    the layers measured (bench/algorithms_weights.py).
    """

    iterations: int = 500
    reg_weight: float = 5.0
    beta_start: float = 20.0
    beta_end: float = 2.0
    warm_start: float = 0.2
    learning_rate: float = 1e-2
    #: seconds for this layer; None: no limit
    time_budget: float | None = None
    #: ridge added to ``H`` relative to its mean diagonal (GPTQ's dampening): inputs calibration
    #: never varied along (a low-rank ``H``) then favour round-to-nearest instead of whatever
    #: the regulariser drifts to, which held-out data would pay for
    damp: float = 0.01

    def beta(self, step: int) -> float:
        """The regulariser's exponent at ``step``: ``beta_start`` to ``beta_end`` by cosine decay."""
        warm = self.warm_start * self.iterations
        if step < warm:
            return self.beta_start
        progress = (step - warm) / max(self.iterations - warm, 1)
        return self.beta_end + 0.5 * (self.beta_start - self.beta_end) * (1 + math.cos(progress * math.pi))


@dataclass(frozen=True)
class AdaroundResult:
    codes: torch.Tensor
    iterations: int
    stopped_by_budget: bool
    #: output error of the result and of round-to-nearest (per sample, ``tr(D H D^T) / N``)
    loss: float
    nearest_loss: float


def rectified_sigmoid(v: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def initial_v(fraction: torch.Tensor) -> torch.Tensor:
    """``V`` with ``h(V) = fraction`` (the rounding starts as the float weight itself)."""
    f = fraction.clamp(1e-4, 1 - 1e-4)
    return -torch.log((ZETA - GAMMA) / (f - GAMMA) - 1)


def adaround_codes(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    grid: IntegerGrid,
    schedule: AdaroundSchedule | None = None,
) -> AdaroundResult:
    """Learned rounding of ``weight`` ``[O, I]`` on ``scale``/``zero_point`` (expanded to ``[O, I]``).

    ``hessian`` is the mean ``x x^T`` of the layer's inputs (``[I, I]``, or ``[G, I, I]`` for the
    row blocks of a grouped convolution, :func:`~.weight_matrix.rows_times`); it is factored once
    (``H = L L^T``, :func:`~.weight_matrix.hessian_factor`) so the loss is
    ``||D L||^2 + ridge ||D||^2``. Nothing is random. The gradient is written out (the loss is a
    quadratic form) rather than taken by autograd: the same steps at about half the cost.
    """
    sched = schedule or AdaroundSchedule()
    # The steps run in float32 on a problem of unit size: the weights in units of their largest
    # step and H over its mean diagonal (the minimiser does not change). Unscaled, inputs of 1e30
    # make H 1e60 and overflow float32; losses are given back in the caller's units.
    step_size = _finite_positive(float(scale.detach().abs().max()))
    energy = float(torch.diagonal(hessian, dim1=-2, dim2=-1).to(torch.float64).mean().clamp(min=0))
    units = step_size**2 * _finite_positive(energy)
    w = weight.detach().to(torch.float32) / step_size
    s = scale.detach().to(torch.float32).div(step_size).expand_as(w)
    z = zero_point.detach().to(torch.float32).expand_as(w)
    scaled = w / s
    floor = torch.floor(scaled)
    lo, hi = grid.quant_min - z, grid.quant_max - z  # floor + h must stay in range
    factor = hessian_factor(hessian.to(torch.float64) / _finite_positive(energy)).to(torch.float32)
    # H + damp * mean(diag H) * I, the damped part kept apart so steps stay low-rank
    ridge = float(sched.damp) if energy > 0 else 0.0

    def loss_of(rounded: torch.Tensor) -> torch.Tensor:
        error = (w - rounded * s).to(torch.float64)
        delta = rows_times(error, factor.to(torch.float64))
        return (delta * delta).sum() + ridge * (error * error).sum()

    nearest_codes = quantize_codes(w, s, z, grid)
    with torch.no_grad():
        nearest_loss = float(loss_of(nearest_codes - z))
    v = initial_v(scaled - floor)
    adam = _Adam(v, sched.learning_rate)
    recon_norm = 1.0 / max(nearest_loss, 1e-30)
    reg_scale = sched.reg_weight / max(w.numel(), 1)
    factor_t = factor.transpose(-2, -1).contiguous()
    started = time.perf_counter()
    stopped = False
    step = 0
    with torch.no_grad(), small_products(w.numel() * factor.shape[-1]):
        while step < sched.iterations:
            if sched.time_budget is not None and time.perf_counter() - started > sched.time_budget:
                stopped = True
                break
            # forward: h = clip(sigmoid(V) (zeta - gamma) + gamma, 0, 1), soft = clamp(floor + h)
            sig = torch.sigmoid(v)
            raw = sig * (ZETA - GAMMA) + GAMMA
            h = raw.clamp(0.0, 1.0)
            soft = floor + h
            inside = (soft >= lo) & (soft <= hi) & (raw > 0) & (raw < 1)
            error = w - soft.clamp(lo, hi) * s
            # d recon / d h = -2 s * (error (L L^T + ridge I)), normalised by round-to-nearest's loss
            grad = rows_times(rows_times(error, factor), factor_t)
            grad.add_(error, alpha=ridge).mul_(s).mul_(-2 * recon_norm)
            if step >= sched.warm_start * sched.iterations:  # d/dh of 1 - |2h - 1|^beta
                beta = sched.beta(step)
                t = 2 * h - 1
                grad -= (2 * reg_scale * beta) * t.abs().pow(beta - 1) * t.sign()
            grad.mul_(inside).mul_(sig * (1 - sig) * (ZETA - GAMMA))
            adam.step(grad)
            step += 1
    with torch.no_grad():
        up = (rectified_sigmoid(v) >= 0.5).to(torch.float32)
        codes = torch.clamp(floor + up + z, grid.quant_min, grid.quant_max)
        loss = float(loss_of(codes - z))
    if not loss <= nearest_loss:  # never worse than rounding to nearest on the calibration data
        codes, loss = nearest_codes, nearest_loss
    return AdaroundResult(codes, step, stopped, loss * units, nearest_loss * units)


def _finite_positive(value: float) -> float:
    """``value`` where it is a usable unit (finite, above zero), else 1."""
    return value if 0 < value < math.inf else 1.0


class _Adam:
    """Adam (Kingma & Ba 2015) on one tensor, updated in place (torch.optim.Adam's defaults)."""

    def __init__(self, param: torch.Tensor, lr: float, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        self.param = param
        self.lr = lr
        self.b1, self.b2 = betas
        self.m = torch.zeros_like(param)
        self.v = torch.zeros_like(param)
        self.t = 0

    def step(self, grad: torch.Tensor) -> None:
        self.t += 1
        self.m.mul_(self.b1).add_(grad, alpha=1 - self.b1)
        self.v.mul_(self.b2).addcmul_(grad, grad, value=1 - self.b2)
        denom = (self.v / (1 - self.b2**self.t)).sqrt_().add_(1e-8)
        self.param.addcdiv_(self.m, denom, value=-self.lr / (1 - self.b1**self.t))


@options_as_fields
class AdaRound(Algorithm):
    """AdaRound at convert: learned up/down rounding of every linear/convolution weight.

    Only codes change (each within one step of nearest), on the backend's encoding or the one an
    earlier algorithm chose, so every grid rule of the backend holds by construction.
    ``time_budget`` (seconds, 0: none) is shared by the whole model: each layer gets what is left
    divided by the layers still to do, and a layer out of time keeps its best rounding so far.
    Note that a binding budget makes the result depend on the machine's speed; ``iterations``
    alone never does.
    """

    name = "adaround"
    description = "AdaRound: learned per-layer rounding (up or down) minimising each layer's output error"
    paper = "Nagel et al. 2020, Up or Down? Adaptive Rounding for Post-Training Quantization"
    iterations: int = option(500, "Adam steps per layer", minimum=0)
    reg_weight: float = option(5.0, "weight of the rounding regulariser (scale-free)", minimum=0.0)
    learning_rate: float = option(1e-2, "Adam's learning rate (> 0)", minimum=0.0)
    time_budget: float = option(0.0, "seconds for the whole model (0: no limit)", minimum=0.0)
    damp: float = option(0.01, "ridge on the Hessian, relative to its mean diagonal", minimum=0.0)
    sequential: bool = sequential_option()

    def __post_init__(self) -> None:
        if self.learning_rate == 0:
            raise OptionError("option 'learning_rate' of algorithm 'adaround' must be > 0, got 0.0")
        self._sites: set[str] = set()  # weights this instance trains (from its collectors)
        self._done: set[str] = set()  # ... already trained in the current convert
        self._deadline: float | None = None

    def collector(self, site: WeightSite) -> LayerHessian | None:
        if not collects_hessian(site, self.name):
            return None
        self._sites.add(site.name)
        return LayerHessian(site, grouped=True)

    def _layer_budget(self, site: WeightSite) -> float | None:
        if not self.time_budget:
            return None
        now = time.perf_counter()
        if site.name in self._done:  # a weight seen again: another convert, with its own budget
            self._done.clear()
            self._deadline = None
        if self._deadline is None:
            self._deadline = now + self.time_budget
        left = max(len(self._sites - self._done), 1)
        self._done.add(site.name)
        return max(self._deadline - now, 0.0) / left

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        found = matrix_and_hessian(site, grid, collected)
        if found is None:
            return None
        matrix, hessian = found
        schedule = AdaroundSchedule(
            iterations=self.iterations,
            reg_weight=self.reg_weight,
            learning_rate=self.learning_rate,
            time_budget=self._layer_budget(site),
            damp=self.damp,
        )
        result = adaround_codes(
            matrix.weight, hessian, matrix.scale, matrix.zero_point, matrix.grid, schedule
        )
        if not improves(matrix, hessian, result.codes, codes):
            return None  # the codes it was given (nearest, or an earlier choice) are better
        return WeightChoice(codes=matrix.codes(result.codes))
