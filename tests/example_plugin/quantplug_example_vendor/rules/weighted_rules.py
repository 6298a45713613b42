"""Linear and conv: per-channel (or per-block) symmetric weights, derived int32 bias."""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    QuantizationSpec,
    annotate_weighted,
    register_annotator,
    set_backend_node_data,
)
from quantplug_example_vendor.configs import UNIT

aten = torch.ops.aten


@register_annotator([aten.linear.default], backend_op="FullyConnected")
def annotate_linear(node: Node, config: QuantizationConfig) -> None:
    # input 0 = activation, 1 = weight [out, in], 2 = bias (see configs.build_config)
    annotate_weighted(node, config)
    set_backend_node_data(node, UNIT, "matrix")  # the compiler's partition key (see writer.py)


@register_annotator([aten.conv2d.default], backend_op="Conv2d")
def annotate_conv2d(node: Node, config: QuantizationConfig) -> None:
    annotate_weighted(node, _without_blocks(config))
    set_backend_node_data(node, UNIT, "matrix")


def _without_blocks(config: QuantizationConfig) -> QuantizationConfig:
    """Conv kernels have no block layout on this chip: per-block weights become per-channel."""
    weight = config.weight
    if not isinstance(weight, QuantizationSpec) or weight.block_size is None:
        return config
    per_channel = dataclasses.replace(weight, block_size=None, ch_axis=0, observer_or_fake_quant_ctr=None)
    return dataclasses.replace(config, weight=per_channel)
