"""Convolutions, with a following relu fused (no encoding between them). Linear: ``linear_rules``.

Only static configs quantize convolutions; weight-only and dynamic presets keep them float.
A transposed convolution stores its weight as ``[in, out / groups, k...]``: per-channel weights
use axis 1 there (the output channels, which the int32 bias also follows); grouped transposed
convolutions, where no single axis holds the output channels, get one weight scale.
Depthwise convolutions keep weights on the whole int8 grid: ONNX Runtime's depthwise kernels
widen both operands to 16 bits on every CPU, so their products cannot saturate (see ``configs``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from quantplug.backend import (
    MinMaxObserver,
    QuantizationConfig,
    QuantizationSpec,
    annotate_weighted,
    derived_bias_spec,
    register_annotator,
)
from quantplug_reference.configs import EPS, full_int8_range
from quantplug_reference.rules.common import reuse_fixed_inputs, static_activations
from quantplug_reference.rules.fusion import has_fused_activation

aten = torch.ops.aten

TRANSPOSED = frozenset(
    {aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input}
)
#: position of ``groups`` in the transposed convolutions' schema
_GROUPS_INDEX = 6


@register_annotator(
    [
        aten.conv1d.default,
        aten.conv2d.default,
        aten.conv3d.default,
        aten.conv_transpose1d.default,
        aten.conv_transpose2d.input,
        aten.conv_transpose3d.input,
    ]
)
def annotate_conv(node: Node, config: QuantizationConfig) -> None:
    if not static_activations(config):
        return
    if node.target in TRANSPOSED:
        config = transposed_config(node, config)
    elif is_depthwise(node):
        config = dataclasses.replace(config, weight=full_int8_range(config.weight))
    annotate_weighted(node, config, quantize_output=not has_fused_activation(node))
    reuse_fixed_inputs(node)


def is_depthwise(node: Node) -> bool:
    """One input and one output channel per group (ONNX Runtime's test for its depthwise kernels)."""
    weight = node.args[1] if len(node.args) > 1 else None
    val = weight.meta.get("val") if isinstance(weight, Node) else None
    groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    if not isinstance(val, torch.Tensor) or val.dim() < 3 or not isinstance(groups, int) or groups < 2:
        return False
    return int(val.shape[1]) == 1 and int(val.shape[0]) == groups


def transposed_config(node: Node, config: QuantizationConfig) -> QuantizationConfig:
    """The config with the weight's channel axis moved to the transposed layout's output axis."""
    weight = config.weight
    if not isinstance(weight, QuantizationSpec) or not weight.is_per_channel:
        return config
    groups = node.args[_GROUPS_INDEX] if len(node.args) > _GROUPS_INDEX else node.kwargs.get("groups", 1)
    if groups == 1:
        spec = dataclasses.replace(weight, ch_axis=1)
    else:
        spec = dataclasses.replace(
            weight,
            qscheme=torch.per_tensor_symmetric,
            ch_axis=None,
            observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=EPS),
        )
    bias = None if config.bias is None else (lambda n: derived_bias_spec(n, weight_spec=spec))
    return dataclasses.replace(config, weight=spec, bias=bias)
