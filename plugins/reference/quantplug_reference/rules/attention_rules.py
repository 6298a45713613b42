"""Fused attention (``F.scaled_dot_product_attention``): query, key, value and output quantized.

The attention mask stays float; the softmax inside the op is not visible to annotation.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    QuantizationSpecBase,
    annotate_node,
    is_annotated,
    is_float_tensor,
    register_annotator,
)
from quantplug_reference.rules.common import reuse_fixed_inputs, static_activations

aten = torch.ops.aten


@register_annotator([aten.scaled_dot_product_attention.default])
def annotate_sdpa(node: Node, config: QuantizationConfig) -> None:
    if is_annotated(node) or not static_activations(config):
        return
    inputs: dict[Node, QuantizationSpecBase | None] = {}
    for arg in node.args[:3]:
        if isinstance(arg, Node) and is_float_tensor(arg):
            inputs[arg] = config.input_activation
    out = config.output_activation if is_float_tensor(node) else None
    annotate_node(node, inputs, out)
    reuse_fixed_inputs(node)
