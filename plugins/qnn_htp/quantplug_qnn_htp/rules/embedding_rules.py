"""Tables looked up by index: embeddings, and parameters gathered per token.

By default the table is quantized with the activation grid (per tensor) and the looked-up output
shares it, as ExecuTorch's default path (QNN Gather: output not separately quantized). With
``per_channel_embedding`` the table takes the preset's weight grid per channel along the axis
looked up (4-bit at 16a4w) and the output gets its own activation encoding (ExecuTorch's
``is_embedding_per_channel``).

A mixture-of-experts layer keeps every expert's weights in one ``[experts, out, in]`` parameter
that each token gathers rows of (``W[expert_ids]``, ``aten.index.Tensor``; transformers'
``experts_implementation="batched_mm"``) before a ``bmm``: a QNN Gather of a static tensor, as an
embedding's lookup is. Those parameters are most of the model's bytes, so they follow the same
option: one weight-grid scale per expert with ``per_channel_embedding``, else the activation grid
(16-bit at 16a4w, shared with the gathered rows). Per-axis encodings name one axis, and QNN's
blocks belong to Conv and FullyConnected weights: finer expert grids have no HTP form.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    QuantizationSpec,
    SharedQuantizationSpec,
    annotate_node,
    annotate_shared_in_out,
    is_annotated,
    is_float_tensor,
    register_annotator,
)

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


def _gathered_parameter_axis(node: Node) -> int | None:
    """The axis along which ``node`` gathers rows of a float parameter, or None when it gathers
    from a computed tensor or indexes more than one axis."""
    table = node.args[0]
    if not (isinstance(table, Node) and table.op == "get_attr" and is_float_tensor(table)):
        return None
    if node.target is aten.index_select.default:
        dim = int(node.args[1])  # type: ignore[arg-type]
        return dim % table.meta["val"].dim()
    indices = node.args[1]
    if isinstance(indices, (list, tuple)) and len(indices) == 1 and indices[0] is not None:
        return 0
    return None


@register_annotator([aten.index.Tensor, aten.index_select.default])
def annotate_gather(node: Node, config: QuantizationConfig) -> None:
    if is_annotated(node):
        return
    per_channel = getattr(config, "embedding_weight", None)
    axis = _gathered_parameter_axis(node)
    if axis is None or not isinstance(per_channel, QuantizationSpec) or not is_float_tensor(node):
        annotate_shared_in_out(node, config)  # values moved: the output keeps the input's encoding
        return
    table = node.args[0]
    annotate_node(node, {table: dataclasses.replace(per_channel, ch_axis=axis)}, config.output_activation)  # type: ignore[dict-item]
