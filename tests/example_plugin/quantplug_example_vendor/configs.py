"""Presets (precisions) and chips of the example vendor, as plain data and QuantizationConfigs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from quantplug.backend import (
    DerivedQuantizationSpec,
    MinMaxObserver,
    PerChannelMinMaxObserver,
    QuantizationConfig,
    QuantizationSpec,
    derived_bias_spec,
)

#: preset name -> description (``get_quantizer("example_vendor", precision=...)``)
PRESETS: dict[str, str] = {
    "8a8w": "uint8 asymmetric activations, int8 per-channel symmetric weights, int32 bias",
    "16a8w": "uint16 asymmetric activations, int8 per-channel symmetric weights, int32 bias",
    "8a4w_block": "uint8 activations, linear weights int4 with one scale per block of inputs (EV300+)",
}

#: chip name -> architecture generation (what quantplug_target_arch returns)
CHIPS: dict[str, int] = {"EV100": 1, "EV200": 2, "EV300": 3}

#: the first architecture whose matrix unit reads per-block (LPBQ) weights
PER_BLOCK_MIN_ARCH = 3

#: the first architecture whose host interface takes quantized tensors (see host_io_config)
QUANTIZED_IO_MIN_ARCH = 3

#: the backend node data key naming the unit of the chip that runs a node ("matrix", "vector",
#: "dma"): the compiler partitions the program by it (``quantplug.backend.set_backend_node_data``)
UNIT = "example_vendor.unit"


def build_config(precision: str, options: Mapping[str, Any]) -> QuantizationConfig:
    """The global config of a precision preset (see PRESETS)."""
    act = QuantizationSpec(
        dtype=torch.uint16 if precision == "16a8w" else torch.uint8,
        qscheme=torch.per_tensor_affine,
        observer_or_fake_quant_ctr=MinMaxObserver,
    )
    per_channel = QuantizationSpec(
        dtype=torch.int8,
        quant_min=-127,
        quant_max=127,
        qscheme=torch.per_channel_symmetric,
        ch_axis=0,
        observer_or_fake_quant_ctr=PerChannelMinMaxObserver,
    )
    if precision == "8a4w_block":
        # block_size fits a linear weight [out, in]; the conv rule turns this spec into per-channel
        weight = QuantizationSpec(
            dtype=torch.int4,  # type: ignore[attr-defined]  # (missing from torch's stubs)
            quant_min=-7,
            quant_max=7,
            qscheme=torch.per_channel_symmetric,
            block_size=(1, int(options["block_size"])),
        )  # no observer given: the core picks its per-block min-max observer
    else:
        weight = per_channel

    def bias(node: Node) -> DerivedQuantizationSpec | None:
        # int32 bias = input scale x weight scale per output channel. A per-block weight has
        # several scales per channel, so such a bias stays float (the chip adds it in fp16).
        if weight.block_size is not None and node.target == torch.ops.aten.linear.default:
            return None
        return derived_bias_spec(node, weight_spec=per_channel)

    return QuantizationConfig(input_activation=act, output_activation=act, weight=weight, bias=bias)


def host_io_config() -> QuantizationConfig:
    """The specs of the program's own inputs and outputs on a chip with a quantized host interface.

    The host passes uint8 tensors in and takes uint8 tensors out, whatever the precision inside:
    at 16a8w the inputs are requantized to 16 bits where they enter, the outputs to 8 bits where
    they leave.
    """
    io = QuantizationSpec(
        dtype=torch.uint8, qscheme=torch.per_tensor_affine, observer_or_fake_quant_ctr=MinMaxObserver
    )
    return QuantizationConfig(input_activation=io, output_activation=io, weight=None, bias=None)
