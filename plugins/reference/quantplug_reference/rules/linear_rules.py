"""Linear layers, with a following relu fused (no encoding between them).

Kept apart from the conv rules so that a graph of linears never imports them (and vice versa).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug import QuantizationConfig, annotate_weighted, register_annotator
from quantplug_reference.rules.common import reuse_fixed_inputs
from quantplug_reference.rules.fusion import has_fused_activation

aten = torch.ops.aten


@register_annotator([aten.linear.default])
def annotate_linear(node: Node, config: QuantizationConfig) -> None:
    annotate_weighted(node, config, quantize_output=not has_fused_activation(node))
    reuse_fixed_inputs(node)
