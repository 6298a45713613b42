"""Convolutions (QNN Conv2d / Conv3d / TransposeConv2d / TransposeConv3d).

Weights are per-channel symmetric when ``per_channel_conv`` is on (axis 0; axis 1 for transpose
convolutions), LPBQ blocks along the input channels for ``16a4w_block``; biases int32 derived
from input x weight scales. Unlike ExecuTorch, ``conv2d.padding``, ``convolution`` and
``conv_transpose1d`` get per-channel weights too.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import BackendContext, QuantizationConfig, register_annotator
from quantplug_qnn_htp.rules.common import annotate_weighted_op

aten = torch.ops.aten


@register_annotator(
    [aten.conv1d.default, aten.conv2d.default, aten.conv2d.padding],
    backend_op="Conv2d",
)
def annotate_conv2d(node: Node, config: QuantizationConfig, context: BackendContext) -> None:
    annotate_weighted_op(node, config, "conv", context=context)


@register_annotator([aten.convolution.default], backend_op="Conv2d")
def annotate_convolution(node: Node, config: QuantizationConfig, context: BackendContext) -> None:
    # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    transposed = bool(node.args[6]) if len(node.args) > 6 else False
    groups = _int_arg(node, 8, "groups", 1)
    if transposed:
        annotate_weighted_op(node, config, "conv_transpose", groups=groups, context=context)
    else:
        annotate_weighted_op(node, config, "conv", context=context)


@register_annotator([aten.conv3d.default], backend_op="Conv3d")
def annotate_conv3d(node: Node, config: QuantizationConfig, context: BackendContext) -> None:
    annotate_weighted_op(node, config, "conv", context=context)


def _transpose_groups(node: Node) -> int:
    # conv_transpose{1,2,3}d(input, weight, bias, stride, padding, output_padding, groups, dilation)
    return _int_arg(node, 6, "groups", 1)


def _int_arg(node: Node, index: int, name: str, default: int) -> int:
    """An integer argument given by position or keyword (scalars in exported graphs are ints)."""
    value = node.args[index] if len(node.args) > index else node.kwargs.get(name, default)
    return int(value)  # type: ignore[arg-type]


@register_annotator(
    [aten.conv_transpose1d.default, aten.conv_transpose2d.input], backend_op="TransposeConv2d"
)
def annotate_conv_transpose2d(node: Node, config: QuantizationConfig) -> None:
    annotate_weighted_op(node, config, "conv_transpose", groups=_transpose_groups(node))


@register_annotator([aten.conv_transpose3d.input], backend_op="TransposeConv3d")
def annotate_conv_transpose3d(node: Node, config: QuantizationConfig) -> None:
    annotate_weighted_op(node, config, "conv_transpose", groups=_transpose_groups(node))
