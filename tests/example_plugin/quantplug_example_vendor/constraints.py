"""What the example chip's ops accept, as a built-in table of OpConstraints."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from quantplug.backend import (
    OUTPUT,
    ArchRequirement,
    OpConstraint,
    Port,
    PortConstraint,
    PortRelation,
    RequantRatio,
    SameScale,
    ScaleProduct,
)
from quantplug_example_vendor.configs import PER_BLOCK_MIN_ARCH

SOURCE = "quantplug-example-vendor built-in table"

#: activations: unsigned 8 or 16 bit, one scale per tensor, a scale the requantizer can hold
ACT = PortConstraint(
    dtypes=frozenset({torch.uint8, torch.uint16}),
    per_tensor_only=True,
    scale_range=(2**-24, math.inf),
    description="activation scales are stored as 2**-24 multiples",
)
#: weights: symmetric int8 (or 4-bit in an int8 container), per output channel
WEIGHT = PortConstraint(
    dtypes=frozenset({torch.int8, torch.int4}),  # type: ignore[attr-defined]
    symmetric=True,
    axes=frozenset({0}),
)
BIAS = PortConstraint(dtypes=frozenset({torch.int32}), zero_point_zero=True)

#: the adder adds raw integers: both inputs must be on one scale. "share" asks the core to give
#: them one observer (so the relation holds by construction) instead of reporting a violation
ADD_INPUTS_SHARE_ONE_SCALE = SameScale((0, 1), enforce="share", description="the adder adds raw integers")
#: the int32 accumulator of a matrix unit holds input x weight products
BIAS_SCALE = ScaleProduct(
    2, (0, 1), description="bias scale = input scale x weight scale (int32 accumulator)"
)
#: the requantizer multiplies the accumulator by a fixed-point fraction below 1
REQUANT = RequantRatio((0, 1), OUTPUT, maximum=1.0, description="the requantizer's multiplier is below 1")


def _is_per_block(spec: object) -> bool:
    return getattr(spec, "block_size", None) is not None


def _is_16_bit(spec: object) -> bool:
    return getattr(spec, "dtype", None) in (torch.uint16, torch.int16)


PER_BLOCK_GATE = ArchRequirement(
    min_arch=PER_BLOCK_MIN_ARCH,
    reason="per-block weights need EV300 or later",
    when=lambda ports: _is_per_block(ports.get(1)),
)
SIXTEEN_BIT_GATE = ArchRequirement(
    min_arch=2,
    reason="16-bit activations need EV200 or later",
    when=lambda ports: _is_16_bit(ports.get(OUTPUT)),
)


def _op(
    name: str,
    ports: Mapping[Port, PortConstraint],
    *,
    arch: tuple[ArchRequirement, ...] = (),
    must_share_input_output: bool = False,
    relations: tuple[PortRelation, ...] = (),
) -> OpConstraint:
    return OpConstraint(
        op=name,
        ports=ports,
        must_share_input_output=must_share_input_output,
        arch=(SIXTEEN_BIT_GATE, *arch),
        source=SOURCE,
        relations=relations,
    )


#: backend op name (the ``backend_op`` of a rule) -> constraint
TABLE: dict[str, OpConstraint] = {
    "FullyConnected": _op(
        "FullyConnected",
        {0: ACT, 1: WEIGHT, 2: BIAS, OUTPUT: ACT},
        arch=(PER_BLOCK_GATE,),
        relations=(BIAS_SCALE, REQUANT),
    ),
    "Conv2d": _op("Conv2d", {0: ACT, 1: WEIGHT, 2: BIAS, OUTPUT: ACT}, relations=(BIAS_SCALE, REQUANT)),
    "Relu": _op("Relu", {0: ACT, OUTPUT: ACT}),
    "ElementWiseAdd": _op(
        "ElementWiseAdd", {0: ACT, 1: ACT, OUTPUT: ACT}, relations=(ADD_INPUTS_SHARE_ONE_SCALE,)
    ),
    "Concat": _op("Concat", {OUTPUT: ACT}, must_share_input_output=True),
}


def constraints_for(backend_op: str | None) -> list[OpConstraint]:
    """The constraints of one backend op (none for ops the table does not know)."""
    found = TABLE.get(backend_op or "")
    return [found] if found is not None else []
