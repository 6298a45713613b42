"""The reference backend's presets, as QuantizationConfigs built from the options."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from quantplug import QuantizationConfig, QuantizationSpec, derived_bias_spec
from quantplug.errors import OptionError
from quantplug.observers.base import ObserverFactory
from quantplug.observers.minmax import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
)

PRESETS: dict[str, str] = {
    "int8": "uint8/int8 asymmetric activations, int8 per-channel symmetric weights, int32 bias",
    "int8_per_tensor": "as int8, with one weight scale per tensor",
    "a16w8": "16-bit asymmetric activations, int8 per-channel weights, int32 bias",
}
ACTIVATION_OBSERVERS = ("minmax", "moving_average", "histogram")
EPS = 2**-12


def activation_observer(name: str) -> ObserverFactory:
    if name == "minmax":
        return MinMaxObserver.with_args(eps=EPS)
    if name == "moving_average":
        return MovingAverageMinMaxObserver.with_args(eps=EPS)
    if name == "histogram":
        from quantplug.observers.histogram import HistogramObserver

        return HistogramObserver.with_args(eps=EPS)
    raise OptionError(f"unknown activation_observer {name!r}; valid: {', '.join(ACTIVATION_OBSERVERS)}")


def build_config(preset: str, options: Mapping[str, Any]) -> QuantizationConfig:
    """The global config of a preset (see PRESETS)."""
    act_dtype = torch.uint16 if preset == "a16w8" else getattr(torch, options.get("activation_dtype") or "uint8")
    if preset == "a16w8" and options.get("activation_dtype") == "int8":
        act_dtype = torch.int16
    act = QuantizationSpec(
        dtype=act_dtype,
        observer_or_fake_quant_ctr=activation_observer(options.get("activation_observer") or "histogram"),
        qscheme=torch.per_tensor_affine,
    )
    if preset == "int8_per_tensor":
        weight = QuantizationSpec(
            dtype=torch.int8,
            quant_min=-127,
            quant_max=127,
            qscheme=torch.per_tensor_symmetric,
            observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=EPS),
        )
    else:
        weight = QuantizationSpec(
            dtype=torch.int8,
            quant_min=-127,
            quant_max=127,
            qscheme=torch.per_channel_symmetric,
            ch_axis=0,
            observer_or_fake_quant_ctr=PerChannelMinMaxObserver.with_args(eps=EPS),
        )

    def bias(node: torch.fx.Node) -> Any:
        return derived_bias_spec(node, weight_spec=weight)

    return QuantizationConfig(input_activation=act, output_activation=act, weight=weight, bias=bias)
