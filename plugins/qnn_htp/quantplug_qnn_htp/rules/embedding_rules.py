"""Embedding: the table is quantized with the activation grid (per tensor) and the looked-up
output shares it, as ExecuTorch's default path (QNN Gather: output not separately quantized)."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug import QuantizationConfig, SharedQuantizationSpec, is_float_tensor, register_annotator
from quantplug.annotation.specs import annotate_node, is_annotated

aten = torch.ops.aten


@register_annotator([aten.embedding.default])
def annotate_embedding(node: Node, config: QuantizationConfig) -> None:
    if is_annotated(node):
        return
    table = node.args[0]
    if not is_float_tensor(table) or config.input_activation is None:
        return
    out = SharedQuantizationSpec((table, node)) if is_float_tensor(node) else None  # type: ignore[arg-type]
    annotate_node(node, {table: config.input_activation}, out)  # type: ignore[dict-item]
