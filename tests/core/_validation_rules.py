"""Rules of the validation test backend (a rules module, imported lazily by the core)."""

from __future__ import annotations

import torch
from torch.fx import Node

from _quantplug.annotation.specs import QuantizationSpecBase, SharedQuantizationSpec, annotate_node
from quantplug import QuantizationConfig, annotate_single_in_single_out, annotate_weighted, register_annotator

aten = torch.ops.aten

#: set by a test to give sigmoid a fixed output spec; None uses the activation spec (a violation)
SIGMOID_SPEC: QuantizationSpecBase | None = None


@register_annotator([aten.linear.default], backend_op="FullyConnected")
def linear(node: Node, config: QuantizationConfig) -> None:
    annotate_weighted(node, config)


@register_annotator([aten.sigmoid.default], backend_op="Sigmoid")
def sigmoid(node: Node, config: QuantizationConfig) -> None:
    if SIGMOID_SPEC is None:
        annotate_single_in_single_out(node, config)
    else:
        annotate_node(node, {node.args[0]: config.input_activation}, SIGMOID_SPEC)


@register_annotator([aten.view.default], backend_op="Reshape")
def view(node: Node, config: QuantizationConfig) -> None:
    if SIGMOID_SPEC is None:
        annotate_single_in_single_out(node, config)  # not shared: violates must-share
    else:
        arg = node.args[0]
        annotate_node(node, {arg: SharedQuantizationSpec(arg)}, SharedQuantizationSpec((arg, node)))
