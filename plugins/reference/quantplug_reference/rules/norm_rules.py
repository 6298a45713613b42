"""Normalization: input and output quantized; the affine parameters stay float."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug import QuantizationConfig, annotate_single_in_single_out, register_annotator

aten = torch.ops.aten


@register_annotator([aten.layer_norm.default])
def annotate_layer_norm(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)
