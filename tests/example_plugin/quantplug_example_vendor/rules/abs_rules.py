"""``aten.abs``, which the reference backend has no rule for (added by the reference extension)."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import QuantizationConfig, annotate_single_in_single_out, register_annotator

aten = torch.ops.aten


@register_annotator([aten.abs.default], backend_op="Abs")
def annotate_abs(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)
