"""Elementwise activations; sigmoid/tanh/hardsigmoid get fixed qparams from their known range."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import (
    FixedQParamsQuantizationSpec,
    QuantizationConfig,
    QuantizationSpecBase,
    annotate_node,
    annotate_single_in_single_out,
    full_range,
    is_float_tensor,
    register_annotator,
)
from quantplug_reference.rules.common import reuse_fixed_inputs, static_activations
from quantplug_reference.rules.fusion import is_fused_activation

aten = torch.ops.aten


@register_annotator(
    [aten.relu.default, aten.relu_.default, aten.hardtanh.default, aten.hardtanh_.default, aten.relu6.default]
)
def annotate_relu(node: Node, config: QuantizationConfig) -> None:
    if not static_activations(config):
        return
    if is_fused_activation(node):
        # the producer (conv/linear/add) runs the relu: only the fused output is quantized
        if is_float_tensor(node) and config.output_activation is not None:
            annotate_node(node, output_qspec=config.output_activation)
        return
    annotate_single_in_single_out(node, config)
    reuse_fixed_inputs(node)


@register_annotator(
    [
        aten.gelu.default,
        aten.silu.default,
        aten.silu_.default,
        aten.hardswish.default,
        aten.hardswish_.default,
        aten.leaky_relu.default,
        aten.leaky_relu_.default,
        aten.elu.default,
        aten.clamp.default,
        aten.softmax.int,
        aten._softmax.default,
        aten.log_softmax.int,
        aten._log_softmax.default,
    ]
)
def annotate_elementwise(node: Node, config: QuantizationConfig) -> None:
    if not static_activations(config):
        return
    annotate_single_in_single_out(node, config)
    reuse_fixed_inputs(node)


def fixed_output_spec(
    config: QuantizationConfig, low: float, high: float
) -> FixedQParamsQuantizationSpec | None:
    """An output spec covering exactly ``[low, high]`` on the activation grid."""
    act = config.output_activation
    if act is None:
        return None
    dtype: torch.dtype = act.dtype  # type: ignore[attr-defined]
    qmin, qmax = full_range(dtype)
    levels = qmax - qmin + 1
    scale = (high - low) / levels
    zero_point = round(qmin - low / scale)
    return FixedQParamsQuantizationSpec(
        dtype=dtype,
        scale=scale,
        zero_point=zero_point,
        quant_min=qmin,
        quant_max=qmax,
        qscheme=torch.per_tensor_affine,
    )


@register_annotator(
    [aten.sigmoid.default, aten.sigmoid_.default, aten.hardsigmoid.default, aten.hardsigmoid_.default]
)
def annotate_sigmoid(node: Node, config: QuantizationConfig) -> None:
    _annotate_fixed(node, config, 0.0, 1.0)


@register_annotator([aten.tanh.default, aten.tanh_.default])
def annotate_tanh(node: Node, config: QuantizationConfig) -> None:
    _annotate_fixed(node, config, -1.0, 1.0)


def _annotate_fixed(node: Node, config: QuantizationConfig, low: float, high: float) -> None:
    if not static_activations(config):
        return
    arg = node.args[0]
    inputs: dict[Node, QuantizationSpecBase | None] = {}
    if isinstance(arg, Node) and is_float_tensor(arg) and config.input_activation is not None:
        inputs[arg] = config.input_activation
    out = fixed_output_spec(config, low, high) if is_float_tensor(node) else None
    if inputs or out is not None:
        annotate_node(node, inputs, out)
        reuse_fixed_inputs(node)
