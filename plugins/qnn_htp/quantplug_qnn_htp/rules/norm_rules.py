"""Normalizations. LayerNorm/BatchNorm weights: int16 symmetric with 16-bit activations, else the
activation grid (QNN wants uint8 weights there); GroupNorm weights the weight grid; RmsNorm
weights the activation grid; norm biases int32 symmetric per tensor."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    QuantizationSpecBase,
    annotate_node,
    annotate_single_in_single_out,
    is_annotated,
    is_float_tensor,
    register_annotator,
)
from quantplug_qnn_htp.rules.common import out_spec

aten = torch.ops.aten


def _arg(node: Node, index: int, name: str):  # type: ignore[no-untyped-def]
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name)


def _norm_bias(config: QuantizationConfig) -> QuantizationSpecBase | None:
    spec = getattr(config, "norm_bias", None)
    if spec is not None:
        return spec
    bias = config.bias
    return bias if isinstance(bias, QuantizationSpecBase) else None


def _annotate_norm(
    node: Node,
    config: QuantizationConfig,
    weight_index: int,
    bias_index: int,
    weight_spec: QuantizationSpecBase | None,
) -> None:
    if is_annotated(node):
        return
    inputs: dict[Node, QuantizationSpecBase | None] = {}
    act = node.args[0]
    if is_float_tensor(act) and config.input_activation is not None:
        inputs[act] = config.input_activation  # type: ignore[index]
    weight = _arg(node, weight_index, "weight")
    if is_float_tensor(weight) and weight_spec is not None:
        inputs[weight] = weight_spec
    bias = _arg(node, bias_index, "bias")
    bias_spec = _norm_bias(config)
    if is_float_tensor(bias) and bias_spec is not None:
        inputs[bias] = bias_spec
    out = out_spec(config, node)  # None for native_layer_norm's tuple: getitem annotates the values
    if inputs or out is not None:
        annotate_node(node, inputs, out)


def _norm_weight(config: QuantizationConfig) -> QuantizationSpecBase | None:
    spec = getattr(config, "norm_weight", None)
    return spec if spec is not None else config.input_activation


@register_annotator([aten.layer_norm.default, aten.native_layer_norm.default], backend_op="LayerNorm")
def annotate_layer_norm(node: Node, config: QuantizationConfig) -> None:
    # layer_norm(input, normalized_shape, weight, bias, eps)
    _annotate_norm(node, config, 2, 3, _norm_weight(config))


@register_annotator([aten.group_norm.default], backend_op="GroupNorm")
def annotate_group_norm(node: Node, config: QuantizationConfig) -> None:
    # group_norm(input, num_groups, weight, bias, eps)
    _annotate_norm(node, config, 2, 3, config.weight)


@register_annotator([aten.batch_norm.default, aten.instance_norm.default])
def annotate_batch_norm(node: Node, config: QuantizationConfig) -> None:
    # batch_norm(input, weight, bias, running_mean, running_var, ...)
    _annotate_norm(node, config, 1, 2, _norm_weight(config))


@register_annotator([aten.rms_norm.default], backend_op="RmsNorm")
def annotate_rms_norm(node: Node, config: QuantizationConfig) -> None:
    # rms_norm(input, normalized_shape, weight, eps): input and weight on the activation grid
    if is_annotated(node):
        return
    inputs = {}
    act = node.args[0]
    if is_float_tensor(act) and config.input_activation is not None:
        inputs[act] = config.input_activation
    weight = _arg(node, 2, "weight")
    if is_float_tensor(weight) and config.input_activation is not None:
        inputs[weight] = config.input_activation
    out = out_spec(config, node)
    if inputs or out is not None:
        annotate_node(node, inputs, out)


@register_annotator([aten.linalg_vector_norm.default])
def annotate_vector_norm(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)
