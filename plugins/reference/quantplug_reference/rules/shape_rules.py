"""Data movement: the output reuses the input's encoding; cat unifies its inputs' encodings."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug import (
    QuantizationConfig,
    SharedQuantizationSpec,
    annotate_shared_in_out,
    is_float_tensor,
    register_annotator,
)
from quantplug.annotation.specs import QuantizationSpecBase, annotate_node, is_annotated

aten = torch.ops.aten


@register_annotator(
    [
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.flatten.using_ints,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.unsqueeze.default,
        aten.contiguous.default,
        aten.clone.default,
    ]
)
def annotate_data_movement(node: Node, config: QuantizationConfig) -> None:
    annotate_shared_in_out(node, config)


@register_annotator([aten.cat.default, aten.concat.default])
def annotate_cat(node: Node, config: QuantizationConfig) -> None:
    """All inputs and the output share the first input's encoding (cat only moves values)."""
    if is_annotated(node) or config.input_activation is None or not is_float_tensor(node):
        return
    inputs = [a for a in node.args[0] if is_float_tensor(a)]  # type: ignore[union-attr]
    if not inputs:
        return
    first = inputs[0]
    specs: dict[Node, QuantizationSpecBase | None] = {first: config.input_activation}
    for other in inputs[1:]:
        if other is not first:
            specs[other] = SharedQuantizationSpec((first, node))
    annotate_node(node, specs, SharedQuantizationSpec((first, node)))
