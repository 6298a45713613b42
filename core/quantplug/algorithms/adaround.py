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

import torch

from quantplug.algorithms.weight_matrix import IntegerGrid, dampened, quantize_codes

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


def rounding_regularizer(h: torch.Tensor, beta: float) -> torch.Tensor:
    return (1 - (2 * h - 1).abs().pow(beta)).sum()


def adaround_codes(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    grid: IntegerGrid,
    schedule: AdaroundSchedule | None = None,
    *,
    damp: float = 1e-6,
    seed: int = 0,
) -> AdaroundResult:
    """Learned rounding of ``weight`` ``[O, I]`` on ``scale``/``zero_point`` (expanded to ``[O, I]``).

    ``hessian`` is the mean ``x x^T`` of the layer's inputs (``[I, I]``); it is factored once
    (``H = L L^T``) so the loss is ``||D L||^2``. Deterministic for a given ``seed`` (Adam and
    the initialisation involve no randomness; the seed only fixes torch's state for safety).
    """
    sched = schedule or AdaroundSchedule()
    w = weight.detach().to(torch.float32)
    s = scale.detach().to(torch.float32).expand_as(w)
    z = zero_point.detach().to(torch.float32).expand_as(w)
    scaled = w / s
    floor = torch.floor(scaled)
    lo, hi = grid.quant_min - z, grid.quant_max - z  # floor + h must stay in range
    factor = torch.linalg.cholesky(dampened(hessian.detach().to(torch.float64), damp)).to(torch.float32)

    def loss_of(rounded: torch.Tensor) -> torch.Tensor:
        delta = (w - rounded * s) @ factor
        return (delta * delta).sum(dim=1).sum()

    nearest_codes = quantize_codes(w, s, z, grid)
    with torch.no_grad():
        nearest_loss = float(loss_of(nearest_codes - z))
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        v = initial_v(scaled - floor).requires_grad_(True)
        optimizer = torch.optim.Adam([v], lr=sched.learning_rate)
        recon_norm = 1.0 / max(nearest_loss, 1e-30)
        reg_norm = 1.0 / max(w.numel(), 1)
        started = time.perf_counter()
        stopped = False
        step = 0
        while step < sched.iterations:
            if sched.time_budget is not None and time.perf_counter() - started > sched.time_budget:
                stopped = True
                break
            optimizer.zero_grad(set_to_none=True)
            h = rectified_sigmoid(v)
            soft = torch.clamp(floor + h, lo, hi)
            recon = loss_of(soft) * recon_norm
            beta = sched.beta(step)
            reg = (
                rounding_regularizer(h, beta) * reg_norm
                if step >= sched.warm_start * sched.iterations
                else 0.0
            )
            total = recon + sched.reg_weight * reg
            total.backward()  # type: ignore[union-attr]
            optimizer.step()
            step += 1
    finally:
        torch.random.set_rng_state(generator_state)
    with torch.no_grad():
        up = (rectified_sigmoid(v) >= 0.5).to(torch.float32)
        codes = torch.clamp(floor + up + z, grid.quant_min, grid.quant_max)
        loss = float(loss_of(codes - z))
    if not loss <= nearest_loss:  # never worse than rounding to nearest on the calibration data
        codes, loss = nearest_codes, nearest_loss
    return AdaroundResult(codes, step, stopped, loss, nearest_loss)
