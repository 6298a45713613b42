"""An algorithm must not make a model worse than the default: bias correction and SmoothQuant on the
models where they used to (random CNN with trained-like batch norms, random transformer encoder;
``bench/results/nncf_compare.md``), measured on held-out batches."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantplug
from _quantplug.algorithms.adaround import AdaRound
from _quantplug.algorithms.bias_correction import BiasCorrection
from _quantplug.algorithms.gptq import GPTQ
from _quantplug.algorithms.seq_mse import SeqMSE
from _quantplug.algorithms.smoothquant import SmoothQuant
from _quantplug.algorithms.spec import WeightGrid, WeightSite


class BatchNormCNN(nn.Module):
    """conv -> bn -> relu -> depthwise -> bn -> relu -> 1x1 -> bn -> relu -> mean -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.BatchNorm2d(32)
        self.c3, self.b3 = nn.Conv2d(32, 64, 1), nn.BatchNorm2d(64)
        self.fc = nn.Linear(64, 10)
        g = torch.Generator().manual_seed(3)
        for bn in (self.b1, self.b2, self.b3):  # channels of very different scales, as trained nets have
            n = bn.num_features
            bn.running_mean.copy_(torch.randn(n, generator=g) * 0.5)
            bn.running_var.copy_(torch.rand(n, generator=g) * 4 + 0.05)
            with torch.no_grad():
                bn.weight.copy_(torch.exp(torch.randn(n, generator=g)))
                bn.bias.copy_(torch.randn(n, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        x = F.relu(self.b3(self.c3(x)))
        return self.fc(x.mean((2, 3)))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


def held_out_sqnr(
    model: nn.Module, batches: list[torch.Tensor], algorithms: list[Any], guard: bool = True
) -> float:
    """int8 (per-channel weights, per-tensor activations) SQNR on 4 batches after calibrating on 8."""
    calibration, measure = [(b,) for b in batches[:8]], batches[8:]
    ep = torch.export.export(model, calibration[0])
    quantizer = quantplug.get_quantizer("reference", preset="int8")
    prepared = quantplug.prepare(
        ep, quantizer, algorithms=quantplug.Algorithms(algorithms, calibration=calibration, guard=guard)
    )
    with torch.no_grad():
        for b in calibration:
            prepared(*b)
        converted = quantplug.convert(prepared)
        ref = torch.cat([model(b) for b in measure])
        out = torch.cat([converted(b) for b in measure])
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def cnn_data() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = BatchNormCNN().eval()
    g = torch.Generator().manual_seed(1)
    return model, [torch.randn(4, 3, 16, 16, generator=g) for _ in range(12)]


def test_bias_correction_removes_the_quantized_models_mean_error_not_only_the_weights() -> None:
    """The weights' own mean error ``dW E[x]`` adds to what arrives from upstream on this CNN
    (-2.3 dB); correcting the measured mean error of the quantized model gains instead. Without
    the algorithm guard, so the algorithm's own choices are measured."""
    model, batches = cnn_data()
    default = held_out_sqnr(model, batches, [])
    assert held_out_sqnr(model, batches, [BiasCorrection()], guard=False) > default + 1.0
    weights_only = [BiasCorrection(sequential=False)]
    assert held_out_sqnr(model, batches, weights_only, guard=False) < default  # what it guards


def test_smoothquant_measures_its_alpha_on_rows_that_did_not_set_the_ranges() -> None:
    """On the encoder's head, alpha 0.9 looked best on the rows that set the ranges and lost
    1.3 dB on new data; the two-fold search keeps SmoothQuant at least as good as the default."""
    torch.manual_seed(0)
    model = Encoder().eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 16, 64, generator=g) for _ in range(12)]
    default = held_out_sqnr(model, batches, [])
    algorithm = SmoothQuant()
    assert held_out_sqnr(model, batches, [algorithm]) >= default - 0.1
    assert all(alpha < 0.5 for alpha in algorithm.chosen.values())


def brute_force_codes(
    weight: torch.Tensor, scale: torch.Tensor, hessian: torch.Tensor, low: int = -8, high: int = 7
) -> torch.Tensor:
    """The floor/ceil rounding of a one-row weight with the least output error (every combination)."""
    floor = torch.floor(weight / scale)
    best, best_loss = floor, float("inf")
    n = weight.shape[1]
    for mask in range(2**n):
        up = torch.tensor([(mask >> j) & 1 for j in range(n)], dtype=weight.dtype)
        codes = (floor + up).clamp(low, high)
        d = weight - codes * scale
        loss = float((d @ hessian @ d.t()).sum())
        if loss < best_loss:
            best, best_loss = codes, loss
    return best


def one_row_problem(
    seed: int, *, outlier: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, WeightSite]:
    """(weight [1, 6], its correlated-input Hessian, its max-abs 4-bit scale, its site)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(1, 6, generator=g, dtype=torch.float64)
    if outlier:
        weight[0, 0] *= 4  # clipping it pays on the round-to-nearest loss
    x = torch.randn(12, 6, generator=g, dtype=torch.float64) @ torch.randn(
        6, 6, generator=g, dtype=torch.float64
    )
    site = WeightSite(
        "w", "linear", "aten.linear.default", weight.float(), None, 0, _call=lambda a, w: F.linear(a, w)
    )
    return weight, x.t() @ x / 12, weight.abs().amax(dim=1) / 7, site


def symmetric_4_bit_grid(scale: torch.Tensor, quant_min: int = -7) -> WeightGrid:
    """A per-channel ``[quant_min, 7]`` grid on ``scale`` whose observer is min-max (as SeqMSE and
    GPTQ's scale search ask the backend's)."""
    return WeightGrid(
        quant_min,
        7,
        torch.int8,
        torch.per_channel_symmetric,
        "channel",
        scale.float(),
        torch.zeros(1),
        True,
        ch_axis=0,
        _observe=lambda t: (t.abs().amax(dim=1) / 7, torch.zeros(t.shape[0])),
    )


def output_error(
    weight: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, hessian: torch.Tensor
) -> float:
    d = weight - codes.to(torch.float64) * scale
    return float((d @ hessian @ d.t()).sum())


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["gptq", "adaround"]))
def test_rounding_algorithms_never_undo_a_better_choice(seed: int, name: str) -> None:
    """Given the best codes there are (as an earlier algorithm may have found), GPTQ and AdaRound
    keep them or return codes exactly as good on their own objective, never worse."""
    weight, hessian, scale, site = one_row_problem(seed)
    grid = symmetric_4_bit_grid(scale, quant_min=-8)
    best = brute_force_codes(weight, scale[:, None], hessian)
    algorithm = GPTQ() if name == "gptq" else AdaRound(iterations=20)
    choice = algorithm.choose_weight(site, grid, best.to(torch.int64), hessian)
    if choice is None:
        return
    assert choice.codes is not None
    best_error = output_error(weight, best, scale[:, None], hessian)
    assert output_error(weight, choice.codes, scale[:, None], hessian) <= best_error * (1 + 1e-9)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.booleans())
def test_gptq_scale_search_never_replaces_better_codes_with_a_worse_encoding(
    seed: int, outlier: bool
) -> None:
    """Given the best codes of the default grid, GPTQ with its scale search returns them, codes
    as good, or an encoding whose codes leave less output error."""
    weight, hessian, scale, site = one_row_problem(seed, outlier=outlier)

    grid = symmetric_4_bit_grid(scale)
    algorithm = GPTQ(scale_search=10)
    collector = algorithm.collector(site)
    assert collector is not None
    collector.update(torch.linalg.cholesky(hessian * 6).t().float())  # 6 rows, mean x x^T ~ H
    hessian = collector.result()  # what convert hands choose_weight
    assert hessian is not None
    best = brute_force_codes(weight, scale[:, None], hessian, low=-7, high=7)
    choice = algorithm.choose_weight(site, grid, best.to(torch.int64), hessian)
    if choice is None:
        return
    assert choice.codes is not None
    chosen_scale = scale if choice.scale is None else choice.scale.to(torch.float64)
    best_error = output_error(weight, best, scale[:, None], hessian)
    assert output_error(weight, choice.codes, chosen_scale[:, None], hessian) <= best_error * (1 + 1e-9)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_seq_mse_never_replaces_better_codes_with_a_worse_encoding(seed: int) -> None:
    """Given the best codes of the default grid, SeqMSE only moves to an encoding whose nearest
    rounding has less output error than those codes."""
    weight, hessian, scale, site = one_row_problem(seed, outlier=True)
    grid = symmetric_4_bit_grid(scale)
    best = brute_force_codes(weight, scale[:, None], hessian).clamp(-7, 7)
    choice = SeqMSE().choose_weight(site, grid, best.to(torch.int64), hessian)
    if choice is None:
        return
    assert choice.scale is not None
    new_scale = choice.scale.to(torch.float64)[:, None]
    nearest = torch.clamp(torch.round(weight / new_scale), -7, 7)
    assert output_error(weight, nearest, new_scale, hessian) < output_error(
        weight, best, scale[:, None], hessian
    )
