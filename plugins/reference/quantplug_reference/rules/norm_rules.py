"""Normalization: input and output quantized; the affine parameters stay float.

A batch norm that follows a conv or linear is folded into it before annotation (core); a batch
norm left standing (after a pooling, an add...) is handled here like the other norms.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import QuantizationConfig, annotate_single_in_single_out, register_annotator
from quantplug_reference.rules.common import reuse_fixed_inputs, static_activations

aten = torch.ops.aten


@register_annotator(
    [
        aten.layer_norm.default,
        aten.group_norm.default,
        aten.batch_norm.default,
        aten.instance_norm.default,
        aten.rms_norm.default,
    ]
)
def annotate_norm(node: Node, config: QuantizationConfig) -> None:
    if not static_activations(config):
        return
    annotate_single_in_single_out(node, config)
    reuse_fixed_inputs(node)
