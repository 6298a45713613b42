"""Binary arithmetic and matrix products."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug import QuantizationConfig, annotate_binary, register_annotator
from quantplug.annotation.specs import annotate_node
from quantplug_reference.rules.common import reuse_fixed_inputs
from quantplug_reference.rules.fusion import has_fused_activation

aten = torch.ops.aten


@register_annotator([aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor])
def annotate_arithmetic(node: Node, config: QuantizationConfig) -> None:
    annotate_binary(node, config)
    if node.target == aten.add.Tensor and has_fused_activation(node):
        ann = node.meta.get("quantization_annotation")
        if ann is not None:
            ann.output_qspec = None
            annotate_node(node)
    reuse_fixed_inputs(node)


@register_annotator([aten.matmul.default, aten.bmm.default, aten.mm.default])
def annotate_matmul(node: Node, config: QuantizationConfig) -> None:
    annotate_binary(node, config)
    reuse_fixed_inputs(node)
