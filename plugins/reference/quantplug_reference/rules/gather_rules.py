"""Gathers (``x[indices]``, ``aten.index.Tensor``): values moved under static presets, and
mixture-of-experts weights quantized as weights under weight-only and dynamic ones.

Static presets treat a gather as ``index_select`` (``shape_rules``): the output reuses the
input's encoding.

A mixture-of-experts layer keeps every expert's weights in one ``[experts, out, in]`` parameter
and, per token, gathers the rows of the experts the router chose: transformers'
``experts_implementation="batched_mm"`` exports ``bmm(W[expert_ids], x)`` (``bmm(x,
W[expert_ids])`` for ``[experts, in, out]`` weights). Those parameters are most of a Mixtral's or
a Qwen-MoE's bytes, and no linear reads them: weight-only and dynamic presets left them float.
Under those configs the gathered parameter is quantized as a linear's weight is, one encoding
per expert: the preset's groups of inputs become ``(1, 1, group)`` blocks (``(1, group, 1)`` for
``[experts, in, out]``), and a per-channel preset one block per expert and output row. The
gathered rows dequantize to float, as an embedding's do, so int8 experts use the whole
``[-127, 127]`` grid (``weight_bits`` bounds integer products only) and the fine scale floor of
``configs.DEQUANTIZED_WEIGHT_EPS``. Under ``dynamic_int8`` the
``bmm`` they feed stays a float product: ONNX Runtime has no integer batched product with a
scale per expert row.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    QuantizationSpec,
    annotate_node,
    is_annotated,
    is_float_tensor,
    register_annotator,
)
from quantplug_reference.configs import lookup_table_spec, weight_eps
from quantplug_reference.rules import shape_rules  # the module: its rules are not this one's
from quantplug_reference.rules.common import static_activations

aten = torch.ops.aten


def _input_axis(index: Node) -> int | None:
    """Which axis of the gathered ``[experts, a, b]`` weight its every ``bmm`` reads as inputs
    (2 for ``bmm(W, x)``, 1 for ``bmm(x, W)``), or None when it is read otherwise."""
    axes = set()
    for user in index.users:
        if user.op != "call_function" or user.target is not aten.bmm.default:
            return None
        axes.add(2 if user.args[0] is index else 1)
    return axes.pop() if len(axes) == 1 else None


def expert_weight_spec(spec: QuantizationSpec, shape: torch.Size, axis: int) -> QuantizationSpec:
    """``spec`` (a linear weight's: per output channel, or per group of inputs) for an
    ``[experts, ...]`` weight whose inputs run along ``axis``: blocks within one expert's row."""
    from quantplug.backend import PerBlockMinMaxObserver

    group = spec.block_size[-1] if spec.block_size is not None else 0
    inputs = int(shape[axis])
    block = [1, 1, 1]
    block[axis] = group if group and inputs % group == 0 else inputs
    return dataclasses.replace(
        spec,
        qscheme=torch.per_channel_symmetric,
        ch_axis=0,
        block_size=tuple(block),
        observer_or_fake_quant_ctr=PerBlockMinMaxObserver.with_args(eps=weight_eps(spec)),
    )


@register_annotator([aten.index.Tensor])
def annotate_gather(node: Node, config: QuantizationConfig) -> None:
    if static_activations(config):
        shape_rules.annotate_data_movement(node, config)  # as index_select
    else:
        _annotate_expert_weights(node, config)


def _annotate_expert_weights(node: Node, config: QuantizationConfig) -> None:
    if is_annotated(node) or not isinstance(config.weight, QuantizationSpec):
        return
    weight, indices = node.args[0], node.args[1]
    if not (isinstance(weight, Node) and weight.op == "get_attr" and is_float_tensor(weight)):
        return
    shape = weight.meta["val"].shape
    if len(shape) != 3 or not isinstance(indices, (list, tuple)) or len(indices) != 1:
        return  # one index tensor on the experts' axis: each token's expert
    axis = _input_axis(node)
    if axis is None:
        return
    spec = lookup_table_spec(config.weight)  # the rows dequantize: no integer product to saturate
    annotate_node(node, {weight: expert_weight_spec(spec, shape, axis)})
