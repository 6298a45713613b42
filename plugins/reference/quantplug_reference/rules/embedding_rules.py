"""Embedding lookup: the table is quantized per row like a weight; the rows it returns share it."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug import QuantizationConfig, SharedQuantizationSpec, is_float_tensor, register_annotator
from quantplug.annotation.specs import annotate_node, is_annotated

aten = torch.ops.aten


@register_annotator([aten.embedding.default])
def annotate_embedding(node: Node, config: QuantizationConfig) -> None:
    if is_annotated(node) or config.weight is None:
        return
    table = node.args[0]
    if not isinstance(table, Node) or not is_float_tensor(table):
        return
    weight = config.weight
    per_row = getattr(weight, "qscheme", None) in (torch.per_channel_symmetric, torch.per_channel_affine)
    if per_row:
        # per-row tables dequantize to float rows; the output gets its own activation encoding
        annotate_node(node, {table: weight}, config.output_activation)
    else:
        annotate_node(node, {table: weight}, SharedQuantizationSpec((table, node)))
