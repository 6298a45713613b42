"""Embedding lookup: the table is quantized like a weight (per row, per group or per tensor), on
the whole int8 grid and with the fine scale floor of weights that only dequantize
(``configs.lookup_table_spec``); int8 per row where the config's weights are 4-bit
(``configs.embedding_table_spec``).

Per-row and per-group tables dequantize to float rows; under a static config the output then
gets its own activation encoding. A per-tensor table's rows share the table's encoding. Dynamic
configs keep embeddings float (they quantize linear inputs only).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    SharedQuantizationSpec,
    annotate_node,
    is_annotated,
    is_float_tensor,
    register_annotator,
)
from quantplug_reference.configs import embedding_table_spec
from quantplug_reference.rules.common import static_activations, weight_only
from quantplug_reference.rules.linear_rules import fit_block_spec

aten = torch.ops.aten


@register_annotator([aten.embedding.default])
def annotate_embedding(node: Node, config: QuantizationConfig) -> None:
    if is_annotated(node) or config.weight is None:
        return
    if not (static_activations(config) or weight_only(config)):
        return
    table = node.args[0]
    if not isinstance(table, Node) or not is_float_tensor(table):
        return
    weight = embedding_table_spec(fit_block_spec(config.weight, table))  # a lookup multiplies nothing
    if getattr(weight, "block_size", None) is not None or getattr(weight, "qscheme", None) in (
        torch.per_channel_symmetric,
        torch.per_channel_affine,
    ):
        # per-row / per-group tables dequantize to float rows
        annotate_node(node, {table: weight}, config.output_activation)  # type: ignore[dict-item]
    elif config.output_activation is None:
        annotate_node(node, {table: weight})  # type: ignore[dict-item]
    else:
        annotate_node(node, {table: weight}, SharedQuantizationSpec((table, node)))  # type: ignore[dict-item]
