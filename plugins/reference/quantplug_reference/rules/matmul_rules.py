"""Matrix products: ``matmul``/``bmm``/``mm``, ``addmm`` and ``baddbmm``.

A constant ``[in, out]`` second operand is a weight (HF GPT-2's ``Conv1D`` is
``addmm(bias, x.view(-1, d), W)``; ``x @ W + b`` exports as ``matmul`` + ``add``), quantized as a
linear's weight is, with its output channels on axis 1: per-channel specs take ``ch_axis=1``,
per-group blocks run along the input features (axis 0). ``addmm(bias, x, W)`` with a constant
bias, and ``matmul(x, W)`` whose only user adds a constant bias, get the int32 bias derived from
the input and weight scales, with no encoding between product and bias, as a linear. Weight-only
and dynamic presets quantize those weights (and, dynamic, the input) as they do a linear's. Every
other product quantizes its operands and output on the activation grid.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    QuantizationSpec,
    QuantizationSpecBase,
    annotate_node,
    derived_bias_spec,
    is_annotated,
    is_float_tensor,
    register_annotator,
)
from quantplug_reference.rules.common import reuse_fixed_inputs, static_activations
from quantplug_reference.rules.linear_rules import fit_block_spec

aten = torch.ops.aten


def _weight(node: object) -> Node | None:
    """``node`` if it is a constant 2-D float tensor (a weight), else None."""
    if (
        isinstance(node, Node)
        and node.op == "get_attr"
        and is_float_tensor(node)
        and node.meta["val"].dim() == 2
    ):
        return node
    return None


def _bias_for(candidate: object, weight: Node) -> Node | None:
    """``candidate`` if it is a constant holding one value per output feature of ``weight``."""
    if not (isinstance(candidate, Node) and candidate.op == "get_attr" and is_float_tensor(candidate)):
        return None
    shape = tuple(candidate.meta["val"].shape)
    out = int(weight.meta["val"].shape[1])
    return candidate if shape and shape[-1] == out and math.prod(shape) == out else None


def in_out_weight_spec(spec: QuantizationSpecBase | None, weight: Node) -> QuantizationSpecBase | None:
    """A linear weight spec (``[out, in]``, channels on axis 0) for an ``[in, out]`` weight."""
    if not isinstance(spec, QuantizationSpec):
        return spec
    if spec.block_size is not None:
        transposed = dataclasses.replace(spec, block_size=tuple(reversed(spec.block_size)))
        fitted = fit_block_spec(transposed, weight)
        if isinstance(fitted, QuantizationSpec) and fitted.block_size is None:
            return dataclasses.replace(fitted, ch_axis=1)
        return fitted  # type: ignore[return-value]
    if spec.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine):
        return dataclasses.replace(spec, ch_axis=1)
    return spec


def _annotate_product(
    node: Node,
    x: Node,
    weight: Node,
    config: QuantizationConfig,
    *,
    bias: Node | None = None,
    bias_owner: Node | None = None,
    extra: dict[Node, QuantizationSpecBase | None] | None = None,
) -> None:
    """``x @ weight`` as a linear: input, ``[in, out]`` weight, the derived int32 ``bias`` on
    ``bias_owner`` (``node`` for addmm, the ``add`` after a matmul), and the output."""
    w_spec = in_out_weight_spec(config.weight, weight)
    inputs: dict[Node, QuantizationSpecBase | None] = dict(extra or {})
    if is_float_tensor(x) and config.input_activation is not None:
        inputs[x] = config.input_activation
    if w_spec is not None:
        inputs[weight] = w_spec
    static = static_activations(config)
    output = config.output_activation if static and is_float_tensor(node) else None
    if bias is not None and bias_owner is not None and static and w_spec is not None:
        bias_spec = derived_bias_spec(
            node,
            input_index=list(node.args).index(x),
            weight_index=list(node.args).index(weight),
            bias_index=None,
            weight_spec=w_spec,
            bias=bias,
        )
        if bias_owner is node:
            inputs[bias] = bias_spec
        else:  # matmul + add: no encoding between the product and its bias
            annotate_node(node, inputs, None)
            reuse_fixed_inputs(node)
            annotate_node(bias_owner, {bias: bias_spec}, output)
            return
    annotate_node(node, inputs, output)
    reuse_fixed_inputs(node)


@register_annotator([aten.matmul.default, aten.mm.default])
def annotate_matmul(node: Node, config: QuantizationConfig) -> None:
    if is_annotated(node):
        return
    x, weight = node.args[0], _weight(node.args[1])
    if weight is not None and isinstance(x, Node):
        users = list(node.users)
        add = (
            users[0]
            if len(users) == 1 and users[0].target is aten.add.Tensor and users[0].args[0] is node
            else None
        )
        bias = _bias_for(add.args[1], weight) if add is not None else None
        _annotate_product(node, x, weight, config, bias=bias, bias_owner=add if bias is not None else None)
        return
    _annotate_activations(node, config)


@register_annotator([aten.bmm.default, aten.baddbmm.default])
def annotate_bmm(node: Node, config: QuantizationConfig) -> None:
    _annotate_activations(node, config)


@register_annotator([aten.addmm.default])
def annotate_addmm(node: Node, config: QuantizationConfig) -> None:
    """``addmm(bias, x, W, beta, alpha)``: a linear when ``W`` is a constant ``[in, out]`` weight."""
    if is_annotated(node):
        return
    bias, x, weight = node.args[0], node.args[1], _weight(node.args[2])
    if weight is None or not isinstance(x, Node):
        _annotate_activations(node, config)
        return
    unit = node.kwargs.get("alpha", 1) == 1 and node.kwargs.get("beta", 1) == 1
    fused = _bias_for(bias, weight) if unit else None
    extra = {}
    if fused is None and is_float_tensor(bias) and static_activations(config):
        extra[bias] = config.input_activation  # a scaled or activation bias: an ordinary operand
    _annotate_product(
        node, x, weight, config, bias=fused, bias_owner=node if fused is not None else None, extra=extra
    )  # type: ignore[arg-type]


def _annotate_activations(node: Node, config: QuantizationConfig) -> None:
    """Every float tensor operand and the output on the activation grid."""
    if is_annotated(node) or not static_activations(config):
        return
    inputs = {a: config.input_activation for a in node.args[:3] if is_float_tensor(a)}
    annotate_node(node, inputs, config.output_activation if is_float_tensor(node) else None)  # type: ignore[arg-type]
    reuse_fixed_inputs(node)
