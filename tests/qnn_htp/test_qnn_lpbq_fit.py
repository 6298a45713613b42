"""16a4w_block with default options works on any model: the LPBQ block is fitted per layer (16.3).

``block_size`` (default 64) is the largest block wanted; a layer whose input channels it does
not divide gets the largest block below it that does (96 -> 48, 352 -> 44), or per-channel 4-bit
weights where none from 16 up does (97). ``coverage()`` notes each such layer; only a block the
user fixes (``exact_block_size=True`` or a ``block_size_map`` entry) raises.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import quantplug

pytest.importorskip("quantplug_qnn_htp")

from _quantplug.flow.inspect import encodings
from quantplug_qnn_htp.configs import MIN_FITTED_BLOCK, fit_block

from .real_models import torchvision_model

#: input channels of real models' layers that 64 does not divide (SqueezeNet, MobileNets,
#: EfficientNet, ShuffleNet, ViT...), two it does, and a prime
WIDTHS = (96, 144, 192, 352, 576, 960, 97)


@given(st.integers(1, 5000), st.integers(1, 300))
def test_fit_block_is_the_largest_valid_block(in_channels: int, requested: int) -> None:
    choice = fit_block(in_channels, requested)
    smallest = min(MIN_FITTED_BLOCK, requested)
    candidates = [b for b in range(smallest, requested + 1) if in_channels % b == 0 and b < in_channels]
    if in_channels <= requested:
        assert choice.block is None and choice.note == ""
    elif candidates:
        assert choice.block == max(candidates)
        assert (choice.note == "") == (choice.block == requested)
        assert str(choice.block) in choice.note or not choice.note
    else:
        assert choice.block is None and "per-channel" in choice.note


class Widths(nn.Module):
    """One linear and one 1x1 conv per width, side by side."""

    def __init__(self, widths: tuple[int, ...] = WIDTHS) -> None:
        super().__init__()
        self.widths = widths
        self.fcs = nn.ModuleList(nn.Linear(w, 8) for w in widths)
        self.convs = nn.ModuleList(nn.Conv2d(w, 4, 1) for w in widths)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        outs = []
        start = 0
        for w, fc, conv in zip(self.widths, self.fcs, self.convs):
            outs.append(fc(x[:, start : start + w]))
            outs.append(conv(y[:, start : start + w]).mean((2, 3)))
            start += w
        return torch.cat(outs, dim=1)


def _data(widths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    total = sum(widths)
    return torch.randn(1, total, generator=g), torch.randn(1, total, 4, 4, generator=g)


def _block_sizes(gm: torch.fx.GraphModule) -> dict[str, int | None]:
    """Weight tensor -> its LPBQ block along the input channels (None: per-channel)."""
    out: dict[str, int | None] = {}
    for e in encodings(gm):
        if e["kind"] == "constant" and e["dtype"] != "int32":  # weights, not biases
            out[e["tensor"]] = int(e["block_size"][1]) if e["granularity"] == "block" else None
    return out


@pytest.mark.parametrize("block_size", [64, 32])
def test_default_lpbq_fits_every_layer(block_size: int, tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = Widths().eval()
    ep = torch.export.export(model, _data(WIDTHS, 0))
    options = {"precision": "16a4w_block", "soc_model": "SM8650"}
    if block_size != 64:
        options["block_size"] = block_size
    quantizer = quantplug.get_quantizer("qnn_htp", **options)
    coverage = quantizer.coverage(ep)
    prepared = quantplug.prepare(ep, quantizer)
    with torch.no_grad():
        for seed in (1, 2):
            prepared(*_data(WIDTHS, seed))
    quantized = quantplug.convert(prepared)
    blocks = _block_sizes(quantized)
    notes = {n.node: n.note for n in coverage.noted_nodes}
    for i, width in enumerate(WIDTHS):
        expected = fit_block(width, block_size)
        for weight in (f"fcs_{i}_weight_q0", f"convs_{i}_weight_q0"):
            assert blocks[weight] == expected.block, (width, weight)
        if expected.note:  # every departure from block_size is reported, per node
            assert sum(expected.note == note for note in notes.values()) == 2, (width, notes)
    assert len(notes) == 2 * sum(bool(fit_block(w, block_size).note) for w in WIDTHS)
    assert "note" in coverage.format() and "97 input channels" in coverage.format()
    # the result runs close to the float model, and QNN gets LPBQ encodings with those blocks
    x = _data(WIDTHS, 3)
    with torch.no_grad():
        ref, out = model(*x), quantized(*x)
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean())
    assert float(sqnr) > 15  # 4-bit weights
    artifact = quantplug.lower(quantized, quantizer)
    artifact.save(tmp_path)
    doc = json.loads((tmp_path / "model.encodings").read_text())
    lpbq = {e["name"]: e["block_size"] for e in doc["param_encodings"] if e.get("enc_type") == "LPBQ"}
    fitted = sorted(b for w in WIDTHS if (b := fit_block(w, block_size).block) is not None)
    assert sorted(lpbq.values()) == sorted(fitted * 2)


def test_exact_block_size_keeps_the_strict_error() -> None:
    model = Widths((96,)).eval()
    ep = torch.export.export(model, _data((96,), 0))
    q = quantplug.get_quantizer("qnn_htp", precision="16a4w_block", exact_block_size=True)
    with pytest.raises(quantplug.AnnotationError) as err:
        quantplug.prepare(ep, q)
    assert "96" in str(err.value) and "exact_block_size" in str(err.value)
    # a block_size_map entry is exact too; the other layers are still fitted
    q = quantplug.get_quantizer("qnn_htp", precision="16a4w_block", block_size_map="linear:48")
    assert [n.node for n in q.coverage(ep).noted_nodes] == ["conv2d"]


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("squeezenet1_0", {"num_classes": 10}),
        ("mobilenet_v3_small", {"num_classes": 10}),
        ("shufflenet_v2_x0_5", {"num_classes": 10}),
    ],
)
def test_real_models_prepare_and_lower_with_default_lpbq(name: str, kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = torchvision_model(name, **kwargs)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(1, 3, 64, 64, generator=g),) for _ in range(3)]
    ep = torch.export.export(model, batches[0])
    quantizer = quantplug.get_quantizer("qnn_htp", precision="16a4w_block", soc_model="SM8650")
    notes = quantizer.coverage(ep).noted_nodes
    assert notes  # these models have layers 64 does not divide
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = quantplug.prepare(ep, quantizer)
        with torch.no_grad():
            for b in batches:
                prepared(*b)
        quantized = quantplug.convert(prepared)
        artifact = quantplug.lower(quantized, quantizer)
    assert any(t["qnn_encoding"].endswith("BLOCKWISE_EXPANSION") for t in artifact.metadata["tensors"])
