"""Embedding: by default the table is quantized with the activation grid (per tensor) and the
looked-up output shares it, as ExecuTorch's default path (QNN Gather: output not separately
quantized). With ``per_channel_embedding`` the table is int8 per-channel (axis 0) and the output
gets its own activation encoding (ExecuTorch's ``is_embedding_per_channel``)."""

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
    per_channel = getattr(config, "embedding_weight", None)
    if per_channel is not None:
        out = config.output_activation if is_float_tensor(node) else None
        annotate_node(node, {table: per_channel}, out)  # type: ignore[dict-item]
        return
    out = SharedQuantizationSpec((table, node)) if is_float_tensor(node) else None  # type: ignore[arg-type]
    annotate_node(node, {table: config.input_activation}, out)  # type: ignore[dict-item]
