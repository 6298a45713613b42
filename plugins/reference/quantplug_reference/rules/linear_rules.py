"""Linear layers, with a following relu fused (no encoding between them).

Kept apart from the conv rules so that a graph of linears never imports them (and vice versa).
Static configs quantize input, weight, bias and output; weight-only configs the weight alone;
dynamic configs the input (at run time) and the weight. A per-group weight spec whose group does
not divide the layer's input features falls back to one scale per output channel.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from quantplug.backend import (
    PerChannelMinMaxObserver,
    QuantizationConfig,
    QuantizationSpec,
    annotate_weighted,
    register_annotator,
)
from quantplug_reference.configs import weight_eps
from quantplug_reference.rules.common import reuse_fixed_inputs
from quantplug_reference.rules.fusion import has_fused_activation

aten = torch.ops.aten


def fit_block_spec(spec: object, weight: object) -> object:
    """``spec``, or its per-channel form when its blocks do not tile ``weight``'s shape."""
    if not isinstance(spec, QuantizationSpec) or spec.block_size is None:
        return spec
    val = weight.meta.get("val") if isinstance(weight, Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != len(spec.block_size):
        return per_channel_form(spec)
    for size, block in zip(val.shape, spec.block_size):
        if block > 0 and int(size) % block != 0:
            return per_channel_form(spec)
    return spec


def per_channel_form(spec: QuantizationSpec) -> QuantizationSpec:
    return dataclasses.replace(
        spec,
        block_size=None,
        qscheme=torch.per_channel_symmetric,
        ch_axis=0,
        observer_or_fake_quant_ctr=PerChannelMinMaxObserver.with_args(eps=weight_eps(spec)),
    )


@register_annotator([aten.linear.default])
def annotate_linear(node: Node, config: QuantizationConfig) -> None:
    weight = node.args[1] if len(node.args) > 1 else None
    fitted = fit_block_spec(config.weight, weight)
    if fitted is not config.weight:
        config = dataclasses.replace(config, weight=fitted)  # type: ignore[arg-type]
    dynamic = bool(getattr(config.input_activation, "is_dynamic", False))
    annotate_weighted(node, config, quantize_output=not dynamic and not has_fused_activation(node))
    reuse_fixed_inputs(node)
