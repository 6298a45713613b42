"""Convolutions, with a following relu fused (no encoding between them). Linear: ``linear_rules``."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug import QuantizationConfig, annotate_weighted, register_annotator
from quantplug_reference.rules.common import reuse_fixed_inputs
from quantplug_reference.rules.fusion import has_fused_activation

aten = torch.ops.aten


@register_annotator(
    [
        aten.conv1d.default,
        aten.conv2d.default,
        aten.conv3d.default,
        aten.conv_transpose1d.default,
        aten.conv_transpose2d.input,
    ]
)
def annotate_conv(node: Node, config: QuantizationConfig) -> None:
    annotate_weighted(node, config, quantize_output=not has_fused_activation(node))
    reuse_fixed_inputs(node)
