"""NaN and inf in the layer inputs the algorithms collect from follow ``prepare(..., nonfinite=...)``
(_quantplug.algorithms.finite_inputs): weight-only presets have no activation observer to notice
them, so the collectors' taps must."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantplug
from _quantplug.algorithms.finite_inputs import finite_samples
from _quantplug.algorithms.registry import create_algorithm
from _quantplug.errors import NonFiniteError

#: the algorithms that collect layer inputs, and one in sequential mode (fed at convert)
COLLECTING = [
    ("gptq", {}),
    ("adaround", {"iterations": 50}),
    ("seq_mse", {"candidates": 10}),
    ("bias_correction", {}),
    ("gptq", {"sequential": True}),
]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()


def clean_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(24, 16, generator=g) for _ in range(4)]


def quantize(batches: list[torch.Tensor], algorithm: str, options: dict, nonfinite: str) -> nn.Module:
    model = mlp()
    program = torch.export.export(model, (clean_batches()[0],))
    configured = create_algorithm(algorithm, options)
    prepared = quantplug.prepare(
        program,
        quantplug.get_quantizer("reference", preset="weight_only_int4"),
        algorithms=quantplug.Algorithms([configured], calibration=[(b,) for b in batches]),
        nonfinite=nonfinite,
    )
    with torch.no_grad():
        for b in batches:
            prepared(b)
    return quantplug.convert(prepared)


def with_bad_rows(value: float) -> list[torch.Tensor]:
    batches = clean_batches()
    batches[1] = batches[1].clone()
    batches[1][3, 5] = value
    batches[2] = batches[2].clone()
    batches[2][7, 0] = value
    return batches


@pytest.mark.parametrize(("algorithm", "options"), COLLECTING, ids=lambda x: str(x))
@pytest.mark.parametrize("policy", ["error", "strict"])
def test_a_weight_only_preset_refuses_nan_reaching_an_algorithm(
    algorithm: str, options: dict, policy: str
) -> None:
    with pytest.raises(NonFiniteError) as raised:
        quantize(with_bad_rows(float("nan")), algorithm, options, policy)
    message = str(raised.value)
    assert "0.weight" in message and algorithm in message and "nonfinite='ignore'" in message
    assert raised.value.nan == 1 and raised.value.where == "0.weight"


@pytest.mark.parametrize(("algorithm", "options"), COLLECTING, ids=lambda x: str(x))
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_ignore_gives_what_the_data_without_those_samples_gives(
    algorithm: str, options: dict, value: float, caplog: pytest.LogCaptureFixture
) -> None:
    bad = with_bad_rows(value)
    keep = [torch.isfinite(b).all(dim=1) for b in bad]
    with caplog.at_level(logging.WARNING, logger="quantplug.algorithms"):
        ignored = quantize(bad, algorithm, options, "ignore")
    cleaned = quantize([b[k] for b, k in zip(bad, keep)], algorithm, options, "error")
    x = clean_batches()[0]
    with torch.no_grad():
        out = ignored(x)
        assert torch.isfinite(out).all()
        assert torch.equal(out, cleaned(x))
    warned = [r.getMessage() for r in caplog.records if "left out of the statistics" in r.getMessage()]
    assert len(warned) == 1 and "0.weight (2)" in warned[0]


def test_a_sample_holding_one_bad_value_is_left_out_whole() -> None:
    x = torch.randn(3, 4, 5)
    x[1, 2, 3] = float("-inf")
    kept, dropped = finite_samples(x, "ignore", "w", ["gptq"])
    assert dropped == 1 and kept is not None and torch.equal(kept, x[[0, 2]])
    assert finite_samples(torch.full((4,), float("nan")), "ignore", "w", ["gptq"]) == (None, 1)
    assert finite_samples(torch.full((2, 3), float("nan")), "ignore", "w", ["gptq"]) == (None, 2)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 6), st.integers(1, 5), st.lists(st.tuples(st.integers(0, 29), st.booleans()), max_size=8)
)
def test_finite_samples_keeps_exactly_the_finite_samples_in_order(
    samples: int, width: int, bad: list[tuple[int, bool]]
) -> None:
    x = torch.arange(samples * width, dtype=torch.float32).reshape(samples, width)
    for position, is_nan in bad:
        x.view(-1)[position % x.numel()] = float("nan") if is_nan else float("inf")
    finite = [i for i in range(samples) if bool(torch.isfinite(x[i]).all())]
    if len(finite) == samples:
        assert finite_samples(x, "error", "w", ["a"]) == (x, 0)
    else:
        with pytest.raises(NonFiniteError):
            finite_samples(x, "error", "w", ["a"])
    kept, dropped = finite_samples(x, "ignore", "w", ["a"])
    assert dropped == samples - len(finite)
    assert (kept is None) == (not finite)
    if kept is not None:
        assert torch.equal(kept, x[finite])


def test_the_warning_names_a_batch_norm_folded_weight_as_the_user_wrote_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class ConvBN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.bn(self.conv(x)))

    torch.manual_seed(0)
    batch = torch.randn(4, 3, 8, 8)
    program = torch.export.export(ConvBN().eval(), (batch,))
    quantizer = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="16a4w")
    prepared = quantplug.prepare(program, quantizer, algorithms=["gptq"], nonfinite="ignore")
    batch[1, 0, 0, 0] = float("nan")
    prepared(batch)
    with caplog.at_level(logging.WARNING, logger="quantplug.algorithms"):
        quantplug.convert(prepared)
    assert "conv.weight (with its batch norm) (1)" in caplog.text
