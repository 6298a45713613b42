"""Reading specs by shape, so torchao's and ExecuTorch's spec classes work as well as ours.

The PT2E flow has several copies of the same four spec classes (torch.ao, torchao, ours). The
core never checks their types; it asks which fields a spec has. This keeps torchao and executorch
out of our imports while accepting their quantizers' annotations unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from enum import Enum
from typing import Any

import torch

from _quantplug.annotation.dtypes import SUPPORTED_DTYPES, resolve_range
from _quantplug.errors import AnnotationError


class SpecKind(Enum):
    SHARED = "shared"
    DERIVED = "derived"
    FIXED = "fixed"
    PLAIN = "plain"


def spec_kind(spec: Any) -> SpecKind:
    """Classify a spec object of any PT2E flavour by its fields."""
    if hasattr(spec, "edge_or_node"):
        return SpecKind.SHARED
    if hasattr(spec, "derive_qparams_fn"):
        return SpecKind.DERIVED
    if hasattr(spec, "scale") and hasattr(spec, "zero_point") and hasattr(spec, "dtype"):
        return SpecKind.FIXED
    if hasattr(spec, "dtype"):
        return SpecKind.PLAIN
    raise AnnotationError(
        f"{spec!r} is not a quantization spec (expected QuantizationSpec, SharedQuantizationSpec, "
        "FixedQParamsQuantizationSpec or DerivedQuantizationSpec)"
    )


def is_float_spec(spec: Any) -> bool:
    """Whether ``spec`` keeps its tensor in floating point: a plain spec of a floating dtype that
    is no quantized grid (``QuantizationSpec(dtype=torch.float32,
    observer_or_fake_quant_ctr=PlaceholderObserver)``, PT2E's way to say "this edge stays float";
    float16 is a cast to half and back, as torchao's convert makes it). Float8 dtypes, which are
    grids, are not float specs."""
    dtype = getattr(spec, "dtype", None)
    return (
        spec_kind(spec) is SpecKind.PLAIN
        and isinstance(dtype, torch.dtype)
        and dtype.is_floating_point
        and dtype not in SUPPORTED_DTYPES
        and getattr(spec, "quant_min", None) is None
        and getattr(spec, "quant_max", None) is None
    )


def spec_range(spec: Any) -> tuple[int, int]:
    """(quant_min, quant_max) with missing bounds filled from the dtype."""
    dtype = spec.dtype
    qmin, qmax = getattr(spec, "quant_min", None), getattr(spec, "quant_max", None)
    if dtype in SUPPORTED_DTYPES:
        return resolve_range(dtype, qmin, qmax)
    if qmin is None or qmax is None:
        what = " (a float spec: it has no integer range)" if is_float_spec(spec) else ""
        raise AnnotationError(f"spec {spec!r} has dtype {dtype} and no quant_min/quant_max{what}")
    return int(qmin), int(qmax)


_derived_tokens = itertools.count()


def spec_signature(spec: Any) -> Hashable:
    """The fields that decide whether two specs may share one observer.

    Matches PT2E's implicit-sharing comparison (dtype, dynamic-ness, range, scheme, axis, fixed
    qparams), plus the block shape. The observer constructor is not part of it: two specs that
    agree on the grid measure the same tensor the same way, and the group's first spec decides.
    """
    kind = spec_kind(spec)
    if kind is SpecKind.SHARED:
        raise AnnotationError("a shared spec has no signature of its own")
    if kind is SpecKind.DERIVED:
        # a derived spec never merges implicitly: its qparams belong to its own sources
        return ("derived", next(_derived_tokens))
    return (
        kind.value,
        spec.dtype,
        bool(getattr(spec, "is_dynamic", False)),
        None if is_float_spec(spec) else spec_range(spec),
        getattr(spec, "qscheme", None),
        getattr(spec, "ch_axis", None),
        getattr(spec, "scale", None),
        getattr(spec, "zero_point", None),
        getattr(spec, "block_size", None),
    )


def is_per_channel(spec: Any) -> bool:
    return (
        getattr(spec, "qscheme", None)
        in (
            torch.per_channel_affine,
            torch.per_channel_symmetric,
            torch.per_channel_affine_float_qparams,
        )
        and getattr(spec, "block_size", None) is None
    )
