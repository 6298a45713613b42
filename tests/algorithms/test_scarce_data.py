"""Algorithms facing what they cannot measure say so and keep what they were given (issue 42.11):
a layer too wide for a Hessian is skipped without one being built, identity included; bias
absorption does not trust statistics of a handful of rows."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.algorithms import weight_layers


class Wide(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_seq_mse_skips_a_layer_beyond_the_hessian_limit_without_building_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the limit lowered so that a 512-input layer stands for a 65,536-input one
    monkeypatch.setattr(weight_layers, "MAX_HESSIAN_INPUTS", 256)
    monkeypatch.setattr("_quantplug.algorithms.seq_mse.MAX_HESSIAN_INPUTS", 256)
    built: list[int] = []
    real_eye = torch.eye

    def eye(n: int, *args: object, **kwargs: object) -> torch.Tensor:
        built.append(n)
        return real_eye(n, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "eye", eye)
    torch.manual_seed(0)
    program = torch.export.export(Wide(512).eval(), (torch.randn(2, 512),))
    batches = [(torch.randn(2, 512),) for _ in range(4)]
    with caplog.at_level(logging.WARNING):
        quantized = quantplug.quantize(
            program, backend="qnn_htp", precision="16a4w", calibration=batches, algorithms=["seq_mse"]
        )
    assert quantized is not None
    assert "fc1.weight" in caplog.text or "linear" in caplog.text
    assert 512 not in built  # skipped as the warning says, no identity "Hessian" of its width


class Relus(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        with torch.no_grad():
            self.fc1.bias[:8] += 5.0  # high biases: what absorption is for

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def test_cle_absorbs_no_bias_from_a_single_row() -> None:
    torch.manual_seed(0)
    model = Relus().eval()
    program = torch.export.export(model, (torch.randn(1, 16),))
    one_row = [(torch.randn(1, 16),)]
    with pytest.warns(UserWarning, match=r"cle: not absorbing .* 1 calibration row"):
        with_cle = quantplug.quantize(
            program, backend="reference", preset="weight_only_int8", calibration=one_row, algorithms=["cle"]
        )
    plain = quantplug.quantize(program, backend="reference", preset="weight_only_int8", calibration=one_row)
    held_out = torch.randn(256, 16)
    with torch.no_grad():
        reference = model(held_out)
        errors = [float((m(held_out) - reference).pow(2).mean()) for m in (with_cle, plain)]
    assert errors[0] <= 4 * errors[1] + 1e-9  # equalization alone: no worse than a few times
