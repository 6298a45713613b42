"""Ops QNN runs on one encoding for inputs and output (Concat, Pack, ScatterElements): the encoding
covers every value that passes through, whichever input is first and whatever the op adds.

ExecuTorch gives Pack the first input's moving-average observer and ScatterElements the ``self``
input's: an input of wider range, or a sum the scatter accumulates, clips (6-10 dB SQNR on the
conformance kit's samples). These models are built so that exactly that clips.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.flow.inspect import encodings

pytest.importorskip("quantplug_qnn_htp")


class Stack(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.relu(x), 20 * torch.tanh(y)], dim=1)


class ScatterAdd(nn.Module):
    index: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("index", torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]]).repeat(4, 1))

    def forward(self, x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return torch.scatter_add(torch.relu(x), 1, self.index, torch.relu(src))


def sqnr(expected: torch.Tensor, got: torch.Tensor) -> float:
    noise = float((expected - got).pow(2).sum())
    return 10 * math.log10(float(expected.pow(2).sum()) / max(noise, 1e-30))


def _quantize(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], precision: str
) -> torch.fx.GraphModule:
    program = torch.export.export(model.eval(), batches[0])
    quantizer = quantplug.get_quantizer("qnn_htp", precision=precision)
    prepared = quantplug.prepare(program, quantizer)
    for batch in batches:
        prepared(*batch)
    return quantplug.convert(prepared)


def _batches(shape: tuple[int, ...], n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch, seen ``n`` times: qnn_htp's moving-average observers then hold its exact range, so
    only the sharing decides what clips."""
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    return [batch] * n


def _entries(converted: torch.fx.GraphModule, op: str) -> list[dict]:
    node = next(n.name for n in converted.graph.nodes if n.name.startswith(op))
    return [e for e in encodings(converted) if e["node"] == node or e["tensor"] == node]


@pytest.mark.parametrize("precision", ["8a8w", "16a8w"])
def test_stack_encoding_covers_every_input(precision: str) -> None:
    batches = _batches((4, 8))
    model = Stack()
    converted = _quantize(model, batches, precision)
    entries = _entries(converted, "stack")
    assert len({(e["scale"], e["zero_point"]) for e in entries}) == 1, entries  # one encoding
    (entry, *_) = entries
    top = (entry["quant_max"] - entry["zero_point"]) * entry["scale"]
    largest = max(float(model(*b).max()) for b in batches)
    # the wide second input is not clipped to the first one's range (zero-point rounding: one step)
    assert top >= largest - entry["scale"]
    for batch in batches:
        assert sqnr(model(*batch), converted(*batch)) > 35.0


@pytest.mark.parametrize("precision", ["8a8w", "16a8w"])
def test_scatter_add_encoding_covers_the_sums(precision: str) -> None:
    batches = _batches((4, 8))
    model = ScatterAdd()
    converted = _quantize(model, batches, precision)
    entries = _entries(converted, "scatter_add")
    assert len({(e["scale"], e["zero_point"]) for e in entries}) == 1, entries
    (entry, *_) = entries
    top = (entry["quant_max"] - entry["zero_point"]) * entry["scale"]
    largest = max(float(model(*b).max()) for b in batches)
    assert largest > 2 * max(float(torch.relu(b[0]).max()) for b in batches)  # the sums leave self's range
    assert top >= largest - entry["scale"]
    for batch in batches:
        assert sqnr(model(*batch), converted(*batch)) > 35.0


class Fire(nn.Module):
    """SqueezeNet's Fire module: two relu branches concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 6, 1)
        self.b = nn.Conv2d(4, 6, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], dim=1)


def test_cat_encoding_is_the_absolute_range_over_calibration() -> None:
    """The whole Concat group (both relu outputs and the cat) holds the largest value seen in any
    batch: a moving average would follow the later, smaller batches and clip the first. (ExecuTorch's
    ConcatObserver means the same, but assigns its range tensors to the input observers, whose
    in-place moving-average updates then write into them: a hybrid that depends on batch order.)"""
    torch.manual_seed(0)
    model = Fire().eval()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 4, 8, 8, generator=gen) * s,) for s in (8.0, 1.0, 1.0, 1.0)]
    program = torch.export.export(model, batches[0])
    prepared = quantplug.prepare(program, quantplug.get_quantizer("qnn_htp", precision="8a8w"))
    for batch in batches:
        prepared(*batch)
    converted = quantplug.convert(prepared)
    entries = _entries(converted, "cat")
    assert len({(e["scale"], e["zero_point"]) for e in entries}) == 1, entries
    (entry, *_) = entries
    largest = max(float(model(*b).max()) for b in batches)
    top = (entry["quant_max"] - entry["zero_point"]) * entry["scale"]
    assert top == pytest.approx(largest, rel=1e-5)
