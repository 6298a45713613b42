"""Integer quantization grids: 2-, 4-, 8- and 16-bit, signed and unsigned, as first-class values.

A spec names its grid with a torch dtype (``torch.int4``, ``torch.uint16`` ...). The standard
Q/DQ ops only store 8/16/32-bit containers, so sub-byte grids live in an 8-bit container with a
narrowed range; this module is the single place that knows that mapping.
"""

from __future__ import annotations

import torch

from _quantplug.errors import AnnotationError

# Sub-byte dtypes exist at run time but not in torch's type stubs.
INT4: torch.dtype = getattr(torch, "int4")  # noqa: B009
UINT4: torch.dtype = getattr(torch, "uint4")  # noqa: B009
INT2: torch.dtype = getattr(torch, "int2")  # noqa: B009
UINT2: torch.dtype = getattr(torch, "uint2")  # noqa: B009

# dtype -> (bits, signed, container dtype used by the Q/DQ ops)
_GRIDS: dict[torch.dtype, tuple[int, bool, torch.dtype]] = {
    torch.uint8: (8, False, torch.uint8),
    torch.int8: (8, True, torch.int8),
    torch.uint16: (16, False, torch.uint16),
    torch.int16: (16, True, torch.int16),
    torch.int32: (32, True, torch.int32),
    INT4: (4, True, torch.int8),
    UINT4: (4, False, torch.uint8),
    INT2: (2, True, torch.int8),
    UINT2: (2, False, torch.uint8),
}

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_GRIDS)


def _grid(dtype: torch.dtype) -> tuple[int, bool, torch.dtype]:
    try:
        return _GRIDS[dtype]
    except KeyError:
        names = ", ".join(str(d).removeprefix("torch.") for d in _GRIDS)
        raise AnnotationError(f"unsupported quantized dtype {dtype}; use one of: {names}") from None


def full_range(dtype: torch.dtype) -> tuple[int, int]:
    """The whole integer range of a grid, e.g. (-8, 7) for int4."""
    bits, signed, _ = _grid(dtype)
    if signed:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The container dtype the quantized_decomposed ops accept for this grid."""
    return _grid(dtype)[2]


def is_signed(dtype: torch.dtype) -> bool:
    return _grid(dtype)[1]


def bit_width(dtype: torch.dtype, quant_min: int | None = None, quant_max: int | None = None) -> int:
    """Bits actually used: a narrowed range in an int8 container (PT2E's int4 idiom) counts as 4."""
    bits = _grid(dtype)[0]
    if quant_min is None or quant_max is None:
        return bits
    span = quant_max - quant_min
    return max(1, min(bits, int(span).bit_length()))


def resolve_range(dtype: torch.dtype, quant_min: int | None, quant_max: int | None) -> tuple[int, int]:
    """Fill a spec's missing bounds from its dtype and check the bounds fit the grid."""
    lo, hi = full_range(dtype)
    qmin = lo if quant_min is None else int(quant_min)
    qmax = hi if quant_max is None else int(quant_max)
    if qmin > qmax:
        raise AnnotationError(f"quant_min {qmin} must be <= quant_max {qmax}")
    clo, chi = full_range(storage_dtype(dtype))
    if qmin < clo or qmax > chi:
        raise AnnotationError(f"range [{qmin}, {qmax}] does not fit dtype {dtype} (container [{clo}, {chi}])")
    return qmin, qmax
