"""Pooling and reductions: max pooling only moves values (shared encoding); averages re-measure."""

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


@register_annotator([aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default])
def annotate_max_pool(node: Node, config: QuantizationConfig) -> None:
    if static_activations(config):
        annotate_shared_in_out(node, config)


@register_annotator(
    [
        aten.avg_pool1d.default,
        aten.avg_pool2d.default,
        aten.avg_pool3d.default,
        aten.adaptive_avg_pool1d.default,
        aten.adaptive_avg_pool2d.default,
        aten.adaptive_avg_pool3d.default,
        aten.mean.dim,
        aten.mean.default,
        aten.sum.dim_IntList,
        aten.sum.default,
    ]
)
def annotate_average(node: Node, config: QuantizationConfig) -> None:
    if not static_activations(config):
        return
    annotate_single_in_single_out(node, config)
    reuse_fixed_inputs(node)
