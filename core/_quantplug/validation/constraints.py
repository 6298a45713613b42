"""What a backend op accepts, as data: per-port grids, relations between ports, numeric limits.

Backends return these from ``quantplug_op_constraints``; the validation engine checks every
annotated node against them. They hold no torch graph objects, so a backend can build them from a
built-in table or from a vendor SDK's op-info library alike.

Three kinds of facts:

* per port (:class:`PortConstraint`): grid, symmetry, granularity, fixed encodings, and limits on
  the calibrated scale and zero point;
* between ports of one node (:class:`SameEncoding`, :class:`SameScale`, :class:`ScaleProduct`,
  :class:`RequantRatio`), e.g. "both inputs of add carry one scale";
* the hardware generation (:class:`ArchRequirement`).

What can be known from annotations is checked at ``prepare``; what needs calibrated values
(scales, zero points, ratios) is checked again at ``convert``. A relation with
``enforce="share"`` is not checked but satisfied: the core puts its ports in one sharing group.
"""

from __future__ import annotations

import math
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
    #: calibrated scales must lie in ``[low, high]`` (``math.inf`` for no upper bound); checked on
    #: fixed encodings at prepare and on every calibrated encoding at convert
    scale_range: tuple[float, float] | None = None
    #: calibrated zero points must lie in ``[low, high]``
    zero_point_range: tuple[int, int] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        for name in ("scale_range", "zero_point_range"):
            bounds = getattr(self, name)
            if bounds is not None and (len(bounds) != 2 or not bounds[0] <= bounds[1]):
                raise ValueError(
                    f"PortConstraint.{name} must be (low, high) with low <= high, got {bounds!r}"
                )
        if self.scale_range is not None and self.scale_range[1] <= 0:
            raise ValueError(f"PortConstraint.scale_range {self.scale_range!r} admits no positive scale")


@dataclass(frozen=True)
class ArchRequirement:
    """A minimum hardware architecture, possibly only for some annotations.

    ``when`` sees the node's port specs (port -> spec view) and says whether the requirement
    applies (e.g. only when the weight is per-block). ``None`` means always.
    """

    min_arch: int
    reason: str
    when: Callable[[Mapping[Port, object]], bool] | None = None


#: how a relation is honoured: ``"check"`` reports a violation, ``"share"`` makes the core put
#: the ports in one sharing group (one observer) so the relation holds by construction
ENFORCE_CHOICES = ("check", "share")


def _ports_label(ports: tuple[Port, ...]) -> str:
    return ", ".join("output" if p == OUTPUT else f"input {p}" for p in ports)


def _check_ports(kind: str, ports: tuple[Port, ...], minimum: int) -> None:
    if len(ports) < minimum:
        raise ValueError(f"{kind} needs at least {minimum} port(s), got {ports!r}")
    if len(set(ports)) != len(ports):
        raise ValueError(f"{kind} names a port twice: {ports!r}")
    for p in ports:
        if not (p == OUTPUT or (isinstance(p, int) and not isinstance(p, bool) and p >= 0)):
            raise ValueError(f"{kind}: {p!r} is not a port (an input index >= 0 or OUTPUT)")


@dataclass(frozen=True)
class _SameValue:
    """Ports that must agree on a value (the subclasses say which)."""

    ports: tuple[Port, ...]
    enforce: str = "check"
    rtol: float = 1e-6
    description: str = ""

    def __post_init__(self) -> None:
        kind = type(self).__name__
        object.__setattr__(self, "ports", tuple(self.ports))
        _check_ports(kind, self.ports, 2)
        _check_enforce(kind, self.enforce)
        _check_rtol(self.rtol)

    def label(self) -> str:
        return _ports_label(self.ports)


@dataclass(frozen=True)
class SameEncoding(_SameValue):
    """The ports carry one encoding: same grid, scale and zero point.

    Typical of ops that move bytes without rescaling (a concat, a select). With
    ``enforce="share"`` the core puts the ports in one sharing group, so the relation holds by
    construction (their specs must agree on the grid); with ``"check"`` separate groups are a
    violation at prepare and unequal calibrated encodings one at convert.
    """

    @property
    def rule(self) -> str:
        return "same encoding"


@dataclass(frozen=True)
class SameScale(_SameValue):
    """The ports carry one scale (zero points may differ): "both inputs of add share one scale".

    A relation that includes ``OUTPUT`` reads "output scale = input scale" in reports. With
    ``enforce="share"`` the core shares one observer between the ports (which then also share
    the zero point); ports on different grids cannot share and are reported instead.
    """

    @property
    def rule(self) -> str:
        return "output scale = input scale" if OUTPUT in self.ports else "same scale"


@dataclass(frozen=True)
class ScaleProduct:
    """``scale(result) == prod(scale(f) for f in factors)``, per channel where per-channel.

    The int32 bias of a convolution: bias scale = input scale x weight scale. At prepare the
    result must be a ``DerivedQuantizationSpec`` of the factors' encodings; at convert the
    calibrated values are compared.
    """

    result: Port
    factors: tuple[Port, ...]
    rtol: float = 1e-5
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "factors", tuple(self.factors))
        _check_ports("ScaleProduct", (self.result, *self.factors), 2)
        _check_rtol(self.rtol)

    @property
    def ports(self) -> tuple[Port, ...]:
        return (self.result, *self.factors)

    @property
    def enforce(self) -> str:
        return "check"

    @property
    def rule(self) -> str:
        return "scale product"

    def label(self) -> str:
        return _ports_label(self.ports)


@dataclass(frozen=True)
class RequantRatio:
    """The requantization multiplier ``prod(scale(inputs)) / scale(output)`` lies in a range.

    Fixed-point requantization units accept a bounded multiplier (often below 1, or above
    2**-k). Per channel where any scale is per-channel. Needs calibrated values, so it is
    checked at convert (and at prepare only when every port has a fixed encoding).
    """

    inputs: tuple[Port, ...]
    output: Port = OUTPUT
    minimum: float | None = None
    maximum: float | None = None
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        _check_ports("RequantRatio", (*self.inputs, self.output), 2)
        if self.minimum is None and self.maximum is None:
            raise ValueError("RequantRatio needs a minimum, a maximum or both")
        if self.minimum is not None and self.maximum is not None and self.minimum > self.maximum:
            raise ValueError(f"RequantRatio minimum {self.minimum} > maximum {self.maximum}")

    @property
    def ports(self) -> tuple[Port, ...]:
        return (*self.inputs, self.output)

    @property
    def enforce(self) -> str:
        return "check"

    @property
    def rule(self) -> str:
        return "requantization ratio"

    def label(self) -> str:
        return _ports_label(self.ports)


#: a relation between ports of one node
PortRelation = Union[SameEncoding, SameScale, ScaleProduct, RequantRatio]


def _check_enforce(kind: str, enforce: str) -> None:
    if enforce not in ENFORCE_CHOICES:
        raise ValueError(f"{kind}.enforce must be one of {ENFORCE_CHOICES}, got {enforce!r}")


def _check_rtol(rtol: float) -> None:
    if not (rtol >= 0 and math.isfinite(rtol)):
        raise ValueError(f"rtol must be a finite number >= 0, got {rtol!r}")


@dataclass(frozen=True)
class OpConstraint:
    """The full constraint of one backend op.

    ``must_share_input_output`` marks math-invariant ops (view, transpose, max-pool...): the
    output must reuse the input's encoding through a shared spec. ``relations`` tie ports of one
    node together (same scale, bias = input x weight scale, requantization ratio).
    """

    op: str
    ports: Mapping[Port, PortConstraint] = field(default_factory=dict)
    must_share_input_output: bool = False
    arch: tuple[ArchRequirement, ...] = ()
    source: str = "built-in"
    relations: tuple[PortRelation, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "relations", tuple(self.relations))
        for rel in self.relations:
            if not isinstance(rel, (SameEncoding, SameScale, ScaleProduct, RequantRatio)):
                raise ValueError(
                    f"OpConstraint {self.op!r}: {rel!r} is not a relation "
                    "(SameEncoding, SameScale, ScaleProduct or RequantRatio)"
                )
