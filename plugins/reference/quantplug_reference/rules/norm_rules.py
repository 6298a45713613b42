"""Normalization: input and output quantized; the affine parameters stay float."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug import QuantizationConfig, annotate_single_in_single_out, register_annotator
from quantplug_reference.rules.common import reuse_fixed_inputs

aten = torch.ops.aten


@register_annotator([aten.layer_norm.default, aten.group_norm.default])
def annotate_norm(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)
    reuse_fixed_inputs(node)
