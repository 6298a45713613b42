"""What a backend op accepts, as data: per-port dtypes, symmetry, fixed qparams, sharing, arch.

Backends return these from ``quantplug_op_constraints``; the validation engine checks every
annotated node against them. They hold no torch graph objects, so a backend can build them from a
built-in table or from a vendor SDK's op-info library alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Union

import torch

#: A port: an input position (0 = first tensor argument) or ``"output"``.
Port = Union[int, str]
OUTPUT: Port = "output"


@dataclass(frozen=True)
class PortConstraint:
    """What one input or the output of an op accepts.

    Any field left ``None`` is unconstrained. ``dtypes`` lists the allowed quantized grids; an
    allowed ``torch.int4``/``torch.uint4`` also accepts an 8-bit container narrowed to 4 bits (the
    PT2E idiom). A port left unquantized is not checked (that is coverage, not a constraint).
    """

    dtypes: frozenset[torch.dtype] | None = None
    symmetric: bool | None = None
    per_tensor_only: bool = False
    axes: frozenset[int] | None = None
    fixed_scale: float | None = None
    fixed_zero_point: int | None = None
    fixed_scale_fn: Callable[[int, int], tuple[float, int]] | None = None
    zero_point_zero: bool = False
    description: str = ""


@dataclass(frozen=True)
class ArchRequirement:
    """A minimum hardware architecture, possibly only for some annotations.

    ``when`` sees the node's port specs (port -> spec view) and says whether the requirement
    applies (e.g. only when the weight is per-block). ``None`` means always.
    """

    min_arch: int
    reason: str
    when: Callable[[Mapping[Port, object]], bool] | None = None


@dataclass(frozen=True)
class OpConstraint:
    """The full constraint of one backend op.

    ``must_share_input_output`` marks math-invariant ops (view, transpose, max-pool...): the
    output must reuse the input's encoding through a shared spec.
    """

    op: str
    ports: Mapping[Port, PortConstraint] = field(default_factory=dict)
    must_share_input_output: bool = False
    arch: tuple[ArchRequirement, ...] = ()
    source: str = "built-in"
