"""CLE (+ high-bias absorption) and SmoothQuant: the float function is kept, quantization improves."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import _quantplug.algorithms.spec
import _quantplug.graph.attrs
import quantplug
from _quantplug.algorithms.cle import CrossLayerEqualization, equalization_scales
from _quantplug.algorithms.smoothquant import SmoothQuant, smoothing_scales
from _quantplug.graph.working_copy import working_copy
from tests.algorithms.test_interface import Mlp


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach(), out.detach()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def quantized_sqnr(
    model: nn.Module, x: torch.Tensor, algorithms: list[Any], batch: int = 8, **options: Any
) -> float:
    ep = torch.export.export(model, (x[:batch],))
    batches = [(x[i : i + batch],) for i in range(0, len(x), batch)]
    prepared = quantplug.prepare(
        ep,
        quantplug.get_quantizer(options.pop("backend", "reference"), **options),
        algorithms=quantplug.Algorithms(algorithms, calibration=batches),
    )
    for b in batches:
        prepared(*b)
    return sqnr(model(x), quantplug.convert(prepared)(x))


class ConvNet(nn.Module):
    """conv -> relu -> depthwise conv -> relu -> 1x1 conv -> relu -> mean -> linear: two equalizable pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.c3 = nn.Conv2d(16, 8, 1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.c1(x))
        x = torch.relu(self.c2(x))
        x = torch.relu(self.c3(x))
        return self.fc(x.mean((2, 3)))


def unbalanced_convnet(seed: int = 0) -> ConvNet:
    """Channel ranges spread over three decades in c1, compensated in c2 (what CLE undoes)."""
    torch.manual_seed(seed)
    model = ConvNet().eval()
    with torch.no_grad():
        spread = torch.logspace(-1.5, 1.5, 16)
        model.c1.weight *= spread[:, None, None, None]
        model.c1.bias *= spread
        model.c2.weight /= spread[:, None, None, None]
    return model


def transformed(
    model: nn.Module, x: torch.Tensor, algorithm: Any, calibration: bool = True
) -> torch.fx.GraphModule:
    gm = working_copy(torch.export.export(model, (x,)))
    context = _quantplug.algorithms.spec.TransformContext(algorithm.name, [(x,)] if calibration else None)
    result = algorithm.transform_program(gm, context)
    gm = result if result is not None else gm
    gm.recompile()
    return gm


def run(gm: torch.fx.GraphModule, x: torch.Tensor) -> torch.Tensor:
    out = gm(x)
    return out[0] if isinstance(out, (tuple, list)) else out


# -- CLE ------------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1e4), min_size=1, max_size=16), st.data())
def test_equalization_scales_make_both_ranges_their_geometric_mean(r1: list[float], data: Any) -> None:
    r2 = data.draw(st.lists(st.floats(0, 1e4), min_size=len(r1), max_size=len(r1)))
    a, b = torch.tensor(r1, dtype=torch.float64), torch.tensor(r2, dtype=torch.float64)
    s = equalization_scales(a, b)
    assert bool((s > 0).all()) and bool(torch.isfinite(s).all())
    both = (a > 0) & (b > 0) & (a / b <= 1e12) & (b / a <= 1e12)
    assert torch.allclose((a / s)[both], (b * s)[both], rtol=1e-9)
    assert torch.allclose((a / s)[both], (a * b).sqrt()[both], rtol=1e-9)
    assert bool((s[~both] == 1).all())
    assert bool((s >= 1e-6).all()) and bool((s <= 1e6).all())


@pytest.mark.parametrize("seed", [0, 1])
def test_cle_keeps_the_float_function_and_equalizes(seed: int) -> None:
    model = unbalanced_convnet(seed)
    x = torch.randn(4, 3, 8, 8)
    algorithm = CrossLayerEqualization(absorb_high_bias=False)
    gm = transformed(model, x, algorithm)
    assert len(algorithm.pairs) == 2  # c1-c2 (depthwise second), c2-c3; the mean stops the chain
    assert torch.allclose(run(gm, x), model(x), rtol=1e-4, atol=1e-5)
    w1 = gm.c1.weight.abs().reshape(16, -1).amax(-1)
    w2 = gm.c2.weight.abs().reshape(16, -1).amax(-1)
    ratio = (w1 / w2).log().std().detach()  # before: the ranges' ratio spans three decades
    before = (
        (model.c1.weight.abs().reshape(16, -1).amax(-1) / model.c2.weight.abs().reshape(16, -1).amax(-1))
        .log()
        .std()
        .detach()
    )
    assert float(ratio) < 0.1 * float(before)
    assert torch.equal(unbalanced_convnet(seed).c1.weight, model.c1.weight)  # the caller's model is untouched


def test_cle_raises_sqnr_at_per_tensor_weights() -> None:
    model = unbalanced_convnet()
    x = torch.randn(32, 3, 8, 8)
    plain = quantized_sqnr(model, x, [], preset="int8_per_tensor")
    equalized = quantized_sqnr(model, x, ["cle"], preset="int8_per_tensor")
    assert equalized > plain + 10


def test_high_bias_absorption_moves_sure_activation_into_the_next_bias() -> None:
    torch.manual_seed(0)
    model = Mlp().eval()
    with torch.no_grad():
        model.fc1.weight *= 0.1
        model.fc1.bias[:8] += 5.0  # eight channels always well above zero
    x = torch.randn(256, 16)
    plain = transformed(model, x, CrossLayerEqualization(absorb_high_bias=False))
    absorbed = transformed(model, x, CrossLayerEqualization())
    shifted = plain.fc1.bias - absorbed.fc1.bias
    assert bool((shifted[:8] > 3.0).all()) and bool((shifted >= 0).all())
    # exact where the ReLU input stays above the absorbed amount (the 3-sigma rule): nearly everywhere
    assert sqnr(model(x), run(absorbed, x)) > 50
    without_data = transformed(model, x, CrossLayerEqualization(), calibration=False)
    assert torch.allclose(without_data.fc1.bias, plain.fc1.bias)


# -- SmoothQuant ----------------------------------------------------------------------------------


class Attention(nn.Module):
    """LayerNorm feeding query and key projections (one shared smoothing), RMSNorm-style scale feeding fc."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(64)
        self.q = nn.Linear(64, 64)
        self.k = nn.Linear(64, 64)
        self.gain = nn.Parameter(torch.ones(128))
        self.fc = nn.Linear(128, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        both = torch.cat([self.q(h), self.k(h)], -1)
        return self.fc(both * self.gain)


def outlier_attention() -> Attention:
    torch.manual_seed(0)
    model = Attention().eval()
    with torch.no_grad():
        model.ln.weight[:4] *= 30  # activation outlier channels, as in LLMs
        model.gain[:3] *= 20
    return model


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1e3, allow_subnormal=False), min_size=1, max_size=8), st.floats(0, 1), st.data())
def test_smoothing_scales_balance_ranges_by_alpha(acts: list[float], alpha: float, data: Any) -> None:
    weights = data.draw(st.lists(st.floats(1e-3, 1e3), min_size=len(acts), max_size=len(acts)))
    a, w = torch.tensor(acts, dtype=torch.float64), torch.tensor(weights, dtype=torch.float64)
    s = smoothing_scales(a, w, alpha)
    assert bool((s > 0).all())
    ok = (a > 0) & (s > 1e-5)
    # after smoothing: act range a/s = a^(1-alpha) w^(1-alpha), weight range w*s = a^alpha w^alpha
    assert torch.allclose((a / s)[ok], (a * w).pow(1 - alpha)[ok], rtol=1e-6)
    assert torch.allclose((w * s)[ok], (a * w).pow(alpha)[ok], rtol=1e-6)


def test_smoothquant_keeps_the_float_function_shares_one_scale_and_searches_alpha() -> None:
    model = outlier_attention()
    x = torch.randn(8, 8, 64)
    algorithm = SmoothQuant()
    gm = transformed(model, x, algorithm)
    assert torch.allclose(run(gm, x), model(x), rtol=1e-4, atol=1e-4)
    assert set(algorithm.chosen) == {"layer_norm", "mul"}  # the LayerNorm and the gain multiply absorbed 1/s
    assert all(0.0 <= a <= 1.0 for a in algorithm.chosen.values())
    column_scale = gm.q.weight[0] / model.q.weight[0]
    assert torch.allclose(gm.k.weight[0] / model.k.weight[0], column_scale, rtol=1e-5)  # q and k share s
    assert float(gm.ln.weight[:4].abs().max().detach()) < float(model.ln.weight[:4].abs().max().detach())


def test_smoothquant_raises_sqnr_where_activations_have_outliers() -> None:
    model = outlier_attention()
    x = torch.randn(16, 8, 64)
    plain = quantized_sqnr(model, x, [], batch=4, preset="int8_per_tensor")
    smoothed = quantized_sqnr(model, x, ["smoothquant"], batch=4, preset="int8_per_tensor")
    assert smoothed > plain + 2


def test_smoothquant_without_calibration_data_is_a_typed_error() -> None:
    model = outlier_attention()
    x = torch.randn(2, 8, 64)
    with pytest.raises(quantplug.CalibrationError, match="smoothquant"):
        quantplug.prepare(
            torch.export.export(model, (x,)), quantplug.get_quantizer("reference"), algorithms=["smoothquant"]
        )


def test_transform_context_reads_the_quantizers_bit_widths() -> None:
    htp = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="16a4w")
    assert _quantplug.algorithms.spec.TransformContext("x", None, htp).global_bits() == (16, 4)
    weight_only = quantplug.get_quantizer("reference", preset="weight_only_int4")
    assert _quantplug.algorithms.spec.TransformContext("x", None, weight_only).global_bits() == (None, 4)


def test_smoothquant_leaves_an_input_alone_when_no_alpha_helps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 32)).eval()
    with torch.no_grad():  # +-1 weights sit exactly on an 8-bit grid: any smoothing only adds error
        model[1].weight.copy_(torch.randn(32, 64).sign())
    x = torch.randn(64, 64)
    algorithm = SmoothQuant(act_bits=16, weight_bits=8)
    gm = transformed(model, x, algorithm)
    assert algorithm.chosen == {"layer_norm": -1.0}
    assert torch.equal(_quantplug.graph.attrs.fetch_attr(gm, "1.weight"), model[1].weight)
