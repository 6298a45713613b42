"""Derived int32 biases stay representable over degenerate weights (issue 16.4).

A derived bias scale is input scale x weight scale. With an all-zero weight (ViT's zero-initialised
head, zero-init residual branches, pruned layers), a zero weight channel, or denormal weights,
the weight scale falls to eps and the bias collapsed to about zero. Every precision of both
backends is checked on linear and conv layers of several sizes: channels whose weights are
degenerate must reproduce their bias, and every other channel keeps bias scale = input scale x
weight scale exactly.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantplug
from _quantplug.annotation.annotators import floor_bias_scale
from _quantplug.graph.attrs import attr_value

INT32_MAX = torch.iinfo(torch.int32).max

BACKENDS: list[tuple[str, dict[str, Any]]] = [
    *(
        ("qnn_htp", {"precision": p})
        for p in ("8a8w", "16a8w", "16a4w", "16a16w", "8a4w", "16a2w", "16a4w_block")
    ),
    ("qnn_htp", {"precision": "16a8w", "per_channel_conv": False}),
    ("qnn_htp", {"precision": "8a8w", "per_channel_linear": True}),
    *(("reference", {"preset": p}) for p in ("int8", "int8_per_tensor", "a16w8")),
]
#: which weight channels are degenerate: all of them, all but one, or all denormal
KINDS = ("all_zero", "one_channel", "denormal")
#: (linear in, linear out / conv out channels, conv input size)
SIZES = ((16, 8, 8), (96, 24, 12))


class TwoLayers(nn.Module):
    def __init__(self, k: int, c: int, kind: str, bias_scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(k, c)
        self.conv = nn.Conv2d(3, c, 3)
        g = torch.Generator().manual_seed(k + c)
        with torch.no_grad():
            for layer in (self.fc, self.conv):
                w = layer.weight
                w.copy_(torch.randn(w.shape, generator=g) * 0.1)
                layer.bias.copy_((torch.rand(c, generator=g) * 2 - 1) * bias_scale)
                if kind == "all_zero":
                    w.zero_()
                elif kind == "one_channel":
                    w[1:].zero_()
                else:
                    w.copy_(torch.randn(w.shape, generator=g) * 1e-40)  # float32 subnormals

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x), self.conv(y)


def _degenerate_channels(kind: str, c: int) -> list[int]:
    return list(range(1, c)) if kind == "one_channel" else list(range(c))


def _run(backend: str, options: dict[str, Any], model: nn.Module, args: tuple[torch.Tensor, ...]) -> Any:
    ep = torch.export.export(model, args)
    prepared = quantplug.prepare(ep, quantplug.get_quantizer(backend, **options))
    with torch.no_grad():
        prepared(*args)
    return quantplug.convert(prepared)


@pytest.mark.parametrize("bias_scale", [1.0, 1000.0])
@pytest.mark.parametrize("k,c,hw", SIZES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "backend,options", BACKENDS, ids=[f"{b}-{'-'.join(map(str, o.values()))}" for b, o in BACKENDS]
)
def test_degenerate_weights_keep_their_bias(
    backend: str, options: dict[str, Any], kind: str, k: int, c: int, hw: int, bias_scale: float
) -> None:
    torch.manual_seed(0)
    model = TwoLayers(k, c, kind, bias_scale).eval()
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(4, k, generator=g), torch.randn(1, 3, hw, hw, generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = _run(backend, options, model, args)
    with torch.no_grad():
        expected, got = model(*args), quantized(*args)
    for name, want, have in zip(("linear", "conv"), expected, got):
        channels = _degenerate_channels(kind, c)
        err = (want - have).abs().transpose(0, 1).reshape(c, -1).amax(1)[channels]
        tolerance = 0.02 * float(want.abs().max())  # about 2.5 output steps of an 8-bit grid
        assert float(err.max()) <= tolerance, (
            f"{name}: the degenerate channels lost their bias (max error {float(err.max()):.4g}, "
            f"bias up to {bias_scale})"
        )


def _scale_of(gm: torch.fx.GraphModule, dq: Any) -> torch.Tensor:
    """The scale of the dequantize feeding an op (per-tensor or per-channel)."""
    return torch.as_tensor(attr_value(gm, dq.args[1]), dtype=torch.float64).reshape(-1)


@pytest.mark.parametrize("backend,options", [("qnn_htp", {"precision": "16a8w"}), ("reference", {})])
@pytest.mark.parametrize("bias_scale", [1.0, 1000.0])
def test_only_degenerate_channels_are_floored(
    backend: str, options: dict[str, Any], bias_scale: float
) -> None:
    torch.manual_seed(0)
    model = TwoLayers(16, 8, "one_channel", bias_scale).eval()
    args = (torch.randn(4, 16), torch.randn(1, 3, 8, 8))
    quantized = _run(backend, options, model, args)
    biases = {"linear": model.fc.bias, "conv2d": model.conv.bias}
    checked = floored = 0
    for node in quantized.graph.nodes:
        if node.name not in biases:
            continue
        x, w, b = (_scale_of(quantized, a) for a in node.args[:3])
        product = x * w
        floor = biases[node.name].detach().double().abs() / (INT32_MAX / 2)
        expected = (
            torch.maximum(product, floor) if product.numel() > 1 else torch.maximum(product, floor.max())
        )
        torch.testing.assert_close(b, expected, rtol=1e-6, atol=0)
        if product.numel() > 1 and float(floor[0]) <= float(product[0]):
            assert float(b[0]) == pytest.approx(float(product[0]), rel=1e-6)  # live, fits: exact
        floored += int((b > product * (1 + 1e-6)).sum())
        checked += 1
    assert checked == 2
    # 16-bit activations: the dead channels' products are ~1e-13 and must be floored; the
    # reference backend's 2^-12 eps keeps a bias of 1000 representable without a floor
    assert floored >= (7 if backend == "qnn_htp" else 0)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_subnormal=True, width=32), min_size=1, max_size=16),
    st.lists(st.floats(2**-100, 1.0, width=32), min_size=1, max_size=16),
)
def test_floor_bias_scale_properties(bias: list[float], scales: list[float]) -> None:
    n = min(len(bias), len(scales))
    b = torch.tensor(bias[:n], dtype=torch.float32)
    scale = torch.tensor(scales[:n], dtype=torch.float32)
    floored = floor_bias_scale(scale, b)
    assert bool((floored >= scale).all())
    fits = b.abs() <= scale * (INT32_MAX / 2)
    assert torch.equal(floored[fits], scale[fits])  # nothing changes where the bias already fits
    # the bias codes, computed in float32 as quantize_per_channel does, stay on the int32 grid
    codes = torch.round(b * (1.0 / floored))
    assert bool((codes.abs() <= INT32_MAX).all())
    # and reproduce the bias to within half a step (the floor costs no precision worth having)
    assert bool(((codes * floored - b).abs() <= floored * 0.5 + b.abs() * 1e-6).all())
    per_tensor = floor_bias_scale(scale[:1], b)
    assert per_tensor.shape == (1,) and float(per_tensor) >= float(b.abs().max()) / INT32_MAX
