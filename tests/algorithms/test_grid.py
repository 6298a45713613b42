"""WeightGrid's pure parts: expand, quantize/dequantize within one step, custom rounding stays on the grid."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _quantplug.algorithms.spec import WeightGrid


def _grid(
    granularity: str, scale: torch.Tensor, block: tuple[int, ...] | None = None, bits: int = 4
) -> WeightGrid:
    qmax = 2 ** (bits - 1) - 1
    return WeightGrid(
        quant_min=-qmax,
        quant_max=qmax,
        dtype=torch.int8,
        qscheme=torch.per_channel_symmetric,
        granularity=granularity,
        scale=scale,
        zero_point=torch.zeros(scale.shape, dtype=torch.int64),
        symmetric=True,
        ch_axis=0 if granularity == "channel" else None,
        block_size=block,
    )


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.sampled_from([1, 2, 4]),
    st.integers(1, 3),
    st.sampled_from(["tensor", "channel", "block"]),
    st.sampled_from([4, 8]),
    st.integers(0, 2**16),
)
def test_round_to_nearest_is_within_half_a_step_inside_the_range(
    rows: int, block: int, blocks: int, granularity: str, bits: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, block * blocks, generator=g)
    qmax = 2 ** (bits - 1) - 1
    if granularity == "tensor":
        scale = weight.abs().amax().reshape(1) / qmax
        grid = _grid("tensor", scale, bits=bits)
    elif granularity == "channel":
        scale = weight.abs().amax(1) / qmax
        grid = _grid("channel", scale, bits=bits)
    else:
        scale = weight.abs().reshape(rows, blocks, block).amax(-1) / qmax
        grid = _grid("block", scale, (1, block), bits=bits)
    scale = scale.clamp(min=1e-8)
    grid = grid.with_encoding(scale)
    codes = grid.quantize(weight)
    assert codes.dtype == torch.int64 and int(codes.min()) >= -qmax and int(codes.max()) <= qmax
    step = grid.expand(scale, weight.shape)
    assert bool(((grid.dequantize(codes) - weight).abs() <= step / 2 + 1e-6).all())
    # rounding down or up instead: still on the grid, within one step
    for rounding in (torch.floor, torch.ceil):
        other = grid.quantize(weight, rounding=rounding)
        assert int(other.min()) >= -qmax and int(other.max()) <= qmax
        assert bool(((grid.dequantize(other) - weight).abs() <= step + 1e-6).all())


def test_expand_places_each_block_scale_over_its_block() -> None:
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    grid = _grid("block", scale, (1, 3))
    expanded = grid.expand(scale, (2, 6))
    assert torch.equal(expanded[0], torch.tensor([1.0, 1, 1, 2, 2, 2]))
    assert torch.equal(expanded[1], torch.tensor([3.0, 3, 3, 4, 4, 4]))
    channel = _grid("channel", torch.tensor([1.0, 2.0]))
    assert torch.equal(channel.expand(torch.tensor([1.0, 2.0]), (2, 3, 2))[:, 2, 1], torch.tensor([1.0, 2.0]))
