"""Relu, add and concat."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    QuantizationSpecBase,
    SharedQuantizationSpec,
    annotate_binary,
    annotate_node,
    annotate_single_in_single_out,
    fused_head,
    is_annotated,
    is_float_tensor,
    register_annotator,
    set_backend_node_data,
)
from quantplug_example_vendor.configs import UNIT

aten = torch.ops.aten


@register_annotator([aten.relu.default], backend_op="Relu")
def annotate_relu(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)
    # fused into the linear/conv before it, the matrix unit's output stage applies it
    set_backend_node_data(node, UNIT, "matrix" if fused_head(node) else "vector")


@register_annotator([aten.add.Tensor], backend_op="ElementWiseAdd")
def annotate_add(node: Node, config: QuantizationConfig) -> None:
    # a scalar operand (x + 0.5) was lifted to a constant tensor by lift_scalar_operands
    annotate_binary(node, config)
    set_backend_node_data(node, UNIT, "vector")


@register_annotator([aten.cat.default], backend_op="Concat")
def annotate_cat(node: Node, config: QuantizationConfig) -> None:
    """Every input gets the activation spec; the output shares the first input's encoding.

    The inputs are *not* tied together here: the backend's ``quantplug_resolve_sharing`` hook
    merges all input edges of a cat into one observer group (concat unification).
    """
    if is_annotated(node) or config.input_activation is None or not is_float_tensor(node):
        return
    tensors = node.args[0]
    inputs = (
        [a for a in tensors if isinstance(a, Node) and is_float_tensor(a)]
        if isinstance(tensors, list)
        else []
    )
    if not inputs:
        return
    specs: dict[Node, QuantizationSpecBase | None] = {a: config.input_activation for a in inputs}
    annotate_node(node, specs, SharedQuantizationSpec((inputs[0], node)))
    set_backend_node_data(node, UNIT, "dma")
