"""quantplug's own Q/DQ ops, for what ``quantized_decomposed`` lacks: per-block (LPBQ) grids.

Registered with ``torch.library`` (with fake kernels), so programs using them export, save and
load like any other; the math lives in ``observers.per_block``.
"""

from __future__ import annotations

import torch

from _quantplug.observers import per_block


@torch.library.custom_op("quantplug::quantize_per_block", mutates_args=())
def _quantize_per_block(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    block_size: list[int],
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    return per_block.quantize_per_block(x, scale, zero_point, tuple(block_size), quant_min, quant_max, dtype)


@_quantize_per_block.register_fake
def _(x, scale, zero_point, block_size, quant_min, quant_max, dtype):  # type: ignore[no-untyped-def]
    return torch.empty_like(x, dtype=dtype)


@torch.library.custom_op("quantplug::dequantize_per_block", mutates_args=())
def _dequantize_per_block(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    block_size: list[int],
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    return per_block.dequantize_per_block(q, scale, zero_point, tuple(block_size))


@_dequantize_per_block.register_fake
def _(q, scale, zero_point, block_size, quant_min, quant_max, dtype):  # type: ignore[no-untyped-def]
    return torch.empty_like(q, dtype=torch.float32)


quantize_per_block = torch.ops.quantplug.quantize_per_block.default
dequantize_per_block = torch.ops.quantplug.dequantize_per_block.default
