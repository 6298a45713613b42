"""Per-block (groupwise / LPBQ) weight observer and the block-grid quantize helpers it needs.

A block size has one entry per tensor dim; a weight of shape ``[O, I]`` with ``block_size=(1, 64)``
gets one scale per output channel and group of 64 inputs, i.e. a ``[O, I // 64]`` grid of qparams.
Keeping qparams in that compact grid shape (not expanded to the weight) is what backends store;
``expand_block_param`` is the single place that stretches them back over the tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from _quantplug.annotation.dtypes import storage_dtype
from _quantplug.errors import AnnotationError
from _quantplug.observers import nonfinite
from _quantplug.observers.base import ONE, ObserverBase
from _quantplug.observers.fake_quantize import fake_quantize as _fake_quantize
from _quantplug.observers.minmax import merge_extremes_


def resolve_block_size(block_size: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """Concrete block sizes for ``shape``: ``-1`` or an oversized entry means the whole dim.

    Raises ``AnnotationError`` naming both shapes when the ranks differ or a block does not tile
    its dim, because a silently ragged last block would quantize part of a weight on a grid that
    no backend can represent.
    """
    block = tuple(int(b) for b in block_size)
    dims = tuple(int(d) for d in shape)
    if len(block) != len(dims):
        raise AnnotationError(
            f"block_size {block} has {len(block)} dims but the tensor of shape {dims} has {len(dims)}; "
            "give one block entry per tensor dim (use 1 to keep a dim per-element, -1 for the whole dim)"
        )
    bad_entries = [i for i, b in enumerate(block) if b == 0 or b < -1]
    if bad_entries:
        raise AnnotationError(
            f"block_size {block} has invalid entries in dim(s) {bad_entries} for tensor shape {dims}; "
            "entries must be positive or -1 (whole dim)"
        )
    resolved = tuple(d if b == -1 or b > d else b for b, d in zip(block, dims))
    ragged = [i for i, (b, d) in enumerate(zip(resolved, dims)) if b > 0 and d % b != 0]
    if ragged:
        detail = ", ".join(f"dim {i}: size {dims[i]} % block {resolved[i]} != 0" for i in ragged)
        raise AnnotationError(
            f"block_size {block} does not divide tensor shape {dims} in dim(s) {ragged} ({detail}); "
            "pick block sizes that divide those dims"
        )
    return resolved


def block_grid_shape(block_size: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """Number of blocks per dim, i.e. the shape of the per-block scale and zero point."""
    resolved = resolve_block_size(block_size, shape)
    return tuple(d // b if b > 0 else 0 for b, d in zip(resolved, shape))


def _interleaved(grid: Sequence[int], block: Sequence[int]) -> list[int]:
    return [n for pair in zip(grid, block) for n in pair]


def expand_block_param(param: torch.Tensor, block_size: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """Repeat each block's parameter over its block, giving a tensor of ``shape``.

    Same result as ``repeat_interleave`` along every dim, done with one broadcast and one copy.
    A single-element ``param`` (per-tensor) simply broadcasts.
    """
    dims = tuple(int(d) for d in shape)
    resolved = resolve_block_size(block_size, dims)
    grid = block_grid_shape(resolved, dims)
    if param.numel() == 1:
        return param.reshape(()).expand(dims)
    if tuple(param.shape) != grid:
        raise AnnotationError(
            f"per-block parameter of shape {tuple(param.shape)} does not match the block grid {grid} of "
            f"tensor shape {dims} with block_size {tuple(block_size)}"
        )
    if not dims:
        return param.reshape(())
    spread = param.reshape(_interleaved(grid, [1] * len(grid)))
    return spread.expand(_interleaved(grid, resolved)).reshape(dims)


def quantize_per_block(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    block_size: Sequence[int],
    qmin: int,
    qmax: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Integer codes of ``x`` on its per-block grid, in the container dtype the Q/DQ ops accept."""
    xf = x.detach().float()
    s = expand_block_param(scale.to(device=xf.device, dtype=torch.float32), block_size, xf.shape)
    zp = expand_block_param(zero_point.to(device=xf.device, dtype=torch.float32), block_size, xf.shape)
    q = torch.clamp(torch.round(xf / s) + zp, qmin, qmax)
    return q.to(storage_dtype(dtype))


def dequantize_per_block(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    block_size: Sequence[int],
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Float values of integer codes ``q`` under per-block ``scale`` / ``zero_point``."""
    qf = q.to(torch.float32)
    s = expand_block_param(scale.to(device=qf.device, dtype=torch.float32), block_size, qf.shape)
    zp = expand_block_param(zero_point.to(device=qf.device, dtype=torch.float32), block_size, qf.shape)
    return ((qf - zp) * s).to(out_dtype)


class PerBlockMinMaxObserver(ObserverBase):
    """Running min and max per block of a weight, giving one scale (and zero point) per block.

    Symmetric by default since per-block weight grids (groupwise int4, LPBQ) are symmetric on
    every backend that supports them.
    """

    num_batches: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(self, block_size: Sequence[int], **kwargs: Any) -> None:
        kwargs.setdefault("qscheme", torch.per_channel_symmetric)
        block = tuple(int(b) for b in block_size)
        bad = [i for i, b in enumerate(block) if b == 0 or b < -1]
        if not block or bad:
            raise AnnotationError(
                f"block_size {block} is invalid (dim(s) {bad}); "
                "give one positive entry (or -1 for the whole dim) per tensor dim"
            )
        super().__init__(block_size=block, **kwargs)
        self.block: tuple[int, ...] = block
        self.register_buffer("min_val", torch.empty(0))
        self.register_buffer("max_val", torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x
        lo, hi = self._block_extremes(x)
        if self.min_val.numel() == 0:
            self.min_val = lo
            self.max_val = hi
        else:
            if self.min_val.shape != lo.shape:
                raise AnnotationError(
                    f"PerBlockMinMaxObserver saw a block grid {tuple(lo.shape)} (tensor shape "
                    f"{tuple(x.shape)}) after {tuple(self.min_val.shape)}; one observer serves one tensor"
                )
            torch.minimum(self.min_val, lo, out=self.min_val)
            torch.maximum(self.max_val, hi, out=self.max_val)
        self.num_batches.add_(ONE)
        return x

    def _block_extremes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = tuple(x.shape)
        resolved = resolve_block_size(self.block, shape)
        grid = block_grid_shape(resolved, shape)
        blocks = x.detach().float().reshape(_interleaved(grid, resolved))
        inner = tuple(range(1, 2 * len(grid), 2))
        lo, hi = blocks.amin(dim=inner), blocks.amax(dim=inner)
        if not nonfinite.all_ordinary(self, lo, hi):  # amin/amax propagate NaN; an inf shows as an extreme
            lo, hi = nonfinite.finite_extremes(self, blocks, dims=inner)
        return lo, hi

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._qparams(self.min_val, self.max_val)

    def merge_(self, others: Sequence[Any]) -> None:
        merge_extremes_(self, others)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize-dequantize ``x`` on the current per-block grid, straight-through for gradients."""
        scale, zero_point = self.calculate_qparams()
        s = expand_block_param(scale.to(device=x.device, dtype=x.dtype), self.block, x.shape)
        zp = expand_block_param(zero_point.to(device=x.device, dtype=x.dtype), self.block, x.shape)
        return _fake_quantize(x, s, zp, self.quant_min, self.quant_max, None)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}"
