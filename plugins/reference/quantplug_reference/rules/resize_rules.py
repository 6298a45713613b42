"""Resizing: nearest-neighbour upsampling only repeats values (shared encoding); bilinear
interpolates, so its output is measured on its own."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    annotate_shared_in_out,
    annotate_single_in_single_out,
    register_annotator,
)
from quantplug_reference.rules.common import reuse_fixed_inputs, static_activations

aten = torch.ops.aten


@register_annotator(
    [aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec, aten.upsample_nearest2d.default]
)
def annotate_nearest(node: Node, config: QuantizationConfig) -> None:
    if static_activations(config):
        annotate_shared_in_out(node, config)


@register_annotator(
    [aten.upsample_bilinear2d.vec, aten.upsample_bilinear2d.default, aten.upsample_linear1d.vec]
)
def annotate_interpolating(node: Node, config: QuantizationConfig) -> None:
    if not static_activations(config):
        return
    annotate_single_in_single_out(node, config)
    reuse_fixed_inputs(node)
