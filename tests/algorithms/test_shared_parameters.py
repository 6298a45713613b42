"""The simulations of the quantized model share the program's parameters (issue 42, item 11(c)).

GPTQ on a model with a 1M-row embedding peaked 1.9 GB above the same conversion without it,
although it changes only a 64x64 layer: every weight site's rounded copy was made up front, the
guard's checkpoints kept further copies, and GPTQ built float64 views of the table to say "keep the
default". Now only the layers the algorithms change get new tensors; every other weight is rounded
at each read and not kept. Checked here by what the simulations hold (their weight selections,
and which table-sized tensors are alive while the guard holds its cached runs), never by the
process's memory, which depends on the machine.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.algorithms import spec, weight_choice
from _quantplug.algorithms.sequential import IncrementalOutputs, QuantizedSimulation
from _quantplug.algorithms.spec import WeightGrid

ROWS, WIDTH = 1024, 16


class Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(self.emb(ids))))  # type: ignore[no-any-return]


def _dense_tensors(shape: torch.Size) -> list[torch.Tensor]:
    """Every live plain tensor of ``shape`` (the fake tensors in node metadata hold no data)."""
    gc.collect()
    return [o for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter) and o.shape == shape]


def test_the_guard_and_the_sequential_pass_hold_only_the_changed_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, ROWS, (8, 16), generator=g),) for _ in range(4)]
    program = torch.export.export(Lookup().eval(), batches[0])
    selections: list[set[str]] = []  # the weights each guard trial and sequential pass was given
    alive: list[list[torch.Tensor]] = []  # table-sized tensors while the guard holds its cached runs

    def trial(self: IncrementalOutputs, weights: Any) -> Any:
        selections.append(set(weights))
        return original_trial(self, weights)

    def sequential(
        self: QuantizedSimulation, prepared: Any, activation: Any, weights: Any, *rest: Any
    ) -> None:
        selections.append(set(weights))
        original_init(self, prepared, activation, weights, *rest)

    def guarded(*args: Any) -> Any:
        kept = original_guarded(*args)
        alive.append(_dense_tensors(torch.Size((ROWS, WIDTH))))
        return kept

    original_trial, original_init = IncrementalOutputs.__call__, QuantizedSimulation.__init__
    original_guarded = weight_choice._guarded
    monkeypatch.setattr(IncrementalOutputs, "__call__", trial)
    monkeypatch.setattr(QuantizedSimulation, "__init__", sequential)
    monkeypatch.setattr(weight_choice, "_guarded", guarded)
    algorithms = quantplug.Algorithms([("gptq", {"sequential": True})], held_out="calibration")
    prepared = quantplug.prepare(program, quantplug.get_quantizer("reference"), algorithms=algorithms)
    for batch in batches:
        prepared(*batch)
    tables = {program.state_dict["emb.weight"].data_ptr(), prepared.get_parameter("emb.weight").data_ptr()}
    quantplug.convert(prepared)

    assert any(selections) and all(s <= {"fc.weight", "out.weight"} for s in selections), selections
    (tensors,) = alive
    assert tensors and all(t.data_ptr() in tables for t in tensors), "a copy of the table outlived a run"


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_rounding_in_place_and_in_slices_gives_the_same_values(
    granularity: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """:meth:`WeightGrid.rounded` and the sliced :meth:`WeightGrid.quantize` compute bit for bit
    what ``dequantize(quantize(w))`` computed before, on values inside and far outside the grid."""
    torch.manual_seed(0)
    weight = torch.randn(24, 32) * torch.logspace(-3, 2, 32)
    shape = {"tensor": (1,), "channel": (24,), "block": (24, 4)}[granularity]
    grid = WeightGrid(
        quant_min=-8,
        quant_max=7,
        dtype=torch.int8,
        qscheme=torch.per_channel_affine,
        granularity=granularity,
        scale=torch.rand(shape) * 0.1 + 1e-3,
        zero_point=torch.randint(-3, 3, shape),
        symmetric=False,
        ch_axis=0 if granularity == "channel" else None,
        block_size=(1, 8) if granularity == "block" else None,
    )
    s = grid.expand(grid.scale, weight.shape).to(torch.float32)
    z = grid.expand(grid.zero_point, weight.shape).to(torch.float32)
    codes = (torch.round(weight / s) + z).clamp(grid.quant_min, grid.quant_max).to(torch.int64)
    monkeypatch.setattr(spec, "_SLICE", 40)  # slices of one row
    assert torch.equal(grid.quantize(weight), codes)
    expected = (codes.to(torch.float32) - z) * s
    assert torch.equal(grid.rounded(weight), expected)
    assert torch.equal(
        grid.rounded(weight.to(torch.bfloat16)),
        grid.dequantize(grid.quantize(weight.to(torch.bfloat16))).to(torch.bfloat16),
    )
