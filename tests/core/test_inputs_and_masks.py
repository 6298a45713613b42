"""Calibration data is the caller's, and wide activations are data (issue 42.10).

A program that writes into its own input must not change the caller's calibration tensors, nor
make a second run (the guard's, ``compare``'s quantized side) see the first one's writes. Values
past the attention-mask threshold that continue the data's range are data, not masks."""

from __future__ import annotations

import math

import torch
from torch import nn

import quantplug
from quantplug.debug import compare


class WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        return self.linear(x)


def _program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(WritesItsInput().eval(), (torch.randn(4, 16),))


def test_quantize_leaves_the_callers_batches_as_given() -> None:
    batches = [(torch.randn(4, 16),) for _ in range(3)]
    before = [b[0].clone() for b in batches]
    quantplug.quantize(_program(), backend="reference", calibration=batches)
    assert all(torch.equal(b[0], k) for b, k in zip(batches, before, strict=True))


def test_compare_gives_each_side_the_callers_values() -> None:
    program = _program()
    batch = (torch.randn(4, 16),)
    before = batch[0].clone()
    quantized = quantplug.quantize(program, backend="reference", calibration=[batch])
    assert torch.equal(batch[0], before)
    report = compare(program, quantized, batch)
    assert torch.equal(batch[0], before)
    # one side reading x + 2 where the other reads x + 1 measured about 3.5 dB here
    assert report.output_sqnr_db is not None and report.output_sqnr_db > 30


class WideActivations(nn.Module):
    """Activations that legitimately reach -200,000 (a wide-range feature), no mask anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.scale(x) * 50_000.0) - 100_000.0


def test_activations_past_the_mask_threshold_are_data() -> None:
    torch.manual_seed(0)
    model = WideActivations().eval()
    program = torch.export.export(model, (torch.randn(64, 8),))
    calibration = [(torch.randn(64, 8) * 2,) for _ in range(4)]
    quantized = quantplug.quantize(program, backend="reference", calibration=calibration)
    held_out = (torch.randn(64, 8) * 2,)
    report = compare(program, quantized, held_out)
    assert report.output_sqnr_db is not None and report.output_sqnr_db > 25


class AdditiveMask(nn.Module):
    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.full((8, 8), -1e9), diagonal=1)
        return torch.softmax(scores * 2.0 + mask, dim=-1)


def test_a_real_mask_is_still_left_out_of_the_range() -> None:
    torch.manual_seed(0)
    program = torch.export.export(AdditiveMask().eval(), (torch.randn(2, 8, 8),))
    calibration = [(torch.randn(2, 8, 8),) for _ in range(4)]
    quantized = quantplug.quantize(program, backend="reference", calibration=calibration)
    report = compare(program, quantized, (torch.randn(2, 8, 8),))
    assert report.output_sqnr_db is not None and report.output_sqnr_db > 25
    assert not math.isnan(report.output_sqnr_db)
