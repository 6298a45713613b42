"""The Q/DQ nodes lowering builds compute what the program's Q/DQ ops compute, for any grid:
8/16-bit, signed or not, full or narrowed range, per tensor or per channel, activations and
constants (property-based; the ONNX model run by ONNX's reference evaluator, which implements
every type: ONNX Runtime has no 16-bit Clip kernel).

A narrowed range is kept in the encodings by default (pure Q/DQ: the ``QuantizeLinear``
saturates to its type, so beyond the narrowed ends the model computes what the program would on
the type's full range); with ``clip_narrowed_ranges=True`` an integer ``Clip`` makes the model
equal the program everywhere."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from _quantplug.graph.working_copy import working_copy
from _quantplug.lowering.onnx.export import export_qdq_onnx

from .test_exact_mapping import check_exact

pytest.importorskip("onnxscript")

qd = torch.ops.quantized_decomposed
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

GRIDS = [torch.uint8, torch.int8, torch.uint16, torch.int16]


class QDQ(nn.Module):
    """x -> quantize -> dequantize, plus a quantized constant (per channel or per tensor)."""

    def __init__(self, grid: dict[str, Any], weight: torch.Tensor, w_scale: torch.Tensor, axis: int) -> None:
        super().__init__()
        self.grid = grid
        self.axis = axis
        self.register_buffer("weight", weight)
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("w_zero", torch.zeros_like(w_scale, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.grid
        args = (g["scale"], g["zero_point"], g["qmin"], g["qmax"], g["dtype"])
        y = qd.dequantize_per_tensor(qd.quantize_per_tensor(x, *args), *args)
        w = qd.dequantize_per_channel(
            self.weight, self.w_scale, self.w_zero, self.axis, -127, 127, torch.int8
        )
        return y + w


@st.composite
def grids(draw: Any) -> dict[str, Any]:
    dtype = draw(st.sampled_from(GRIDS))
    info = torch.iinfo(dtype)
    lo = draw(st.integers(int(info.min), int(info.min) + 3))
    hi = draw(st.integers(int(info.max) - 3, int(info.max)))
    zero_point = draw(st.integers(lo, hi))
    scale = draw(
        st.floats(0.0001220703125, 1.0, allow_nan=False, allow_infinity=False, width=32)
    )  # >= 2**-13
    return {"dtype": dtype, "qmin": lo, "qmax": hi, "zero_point": zero_point, "scale": float(scale)}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    grid=grids(),
    channels=st.integers(1, 6),
    axis=st.integers(0, 1),
    seed=st.integers(0, 2**16),
    clip=st.booleans(),
)
def test_onnx_qdq_matches_the_program(
    grid: dict[str, Any], channels: int, axis: int, seed: int, clip: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape = (channels, 5) if axis == 0 else (5, channels)
    weight = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    w_scale = torch.rand(channels, generator=gen) + 0.01
    # inputs spanning the grid and beyond it (saturation, the narrowed ends)
    span = (grid["qmax"] - grid["qmin"]) * grid["scale"]
    x = (torch.rand(shape, generator=gen) * 1.5 - 0.75) * span
    program = working_copy(torch.export.export(QDQ(grid, weight, w_scale, axis), (x,)))
    result = export_qdq_onnx(program, clip_narrowed_ranges=clip)
    check_exact(program, result.model, result.encodings)
    clips = [n for n in result.model.graph.node if n.op_type == "Clip"]
    info = torch.iinfo(grid["dtype"])
    narrowed = (grid["qmin"], grid["qmax"]) != (info.min, info.max)
    assert len(clips) == (1 if clip and narrowed else 0)
    from onnx.reference import ReferenceEvaluator

    (got,) = ReferenceEvaluator(result.model).run(None, {result.input_names[0]: x.numpy()})
    if not clip:  # the program's arithmetic on the type's whole range
        grid = {**grid, "qmin": int(info.min), "qmax": int(info.max)}
        program = working_copy(torch.export.export(QDQ(grid, weight, w_scale, axis), (x,)))
    expected = program(x).numpy()
    # torch rounds x * (1 / scale), ONNX x / scale: at most one step apart, at ties
    step = np.float32(grid["scale"])
    assert float(np.abs(got - expected).max()) <= step * 1.001
    assert np.mean(got != expected) <= 0.05
