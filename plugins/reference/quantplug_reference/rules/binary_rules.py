"""Binary arithmetic; add/mul followed by a relu run as one fused op (matrix products: matmul_rules)."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import QuantizationConfig, annotate_binary, annotate_node, register_annotator
from quantplug_reference.rules.common import reuse_fixed_inputs, static_activations
from quantplug_reference.rules.fusion import FUSING_PRODUCERS, has_fused_activation

aten = torch.ops.aten


@register_annotator(
    [aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor]
)
def annotate_arithmetic(node: Node, config: QuantizationConfig) -> None:
    if not static_activations(config):
        return
    annotate_binary(node, config)
    if node.target in FUSING_PRODUCERS and has_fused_activation(node):
        ann = node.meta.get("quantization_annotation")
        if ann is not None:
            ann.output_qspec = None  # the relu after it carries the output encoding
            annotate_node(node)
    reuse_fixed_inputs(node)
