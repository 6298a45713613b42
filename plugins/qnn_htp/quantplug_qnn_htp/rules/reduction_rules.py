"""Reductions, arg-reductions and top-k/sort."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    annotate_single_in,
    annotate_single_in_single_out,
    register_annotator,
)
from quantplug_qnn_htp.rules.common import annotate_input_shared_out, annotate_siso

aten = torch.ops.aten


@register_annotator([aten.amax.default], backend_op="ReduceMax")
def annotate_amax(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)


@register_annotator([aten.amin.default], backend_op="ReduceMin")
def annotate_amin(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)


@register_annotator([aten.mean.default, aten.mean.dim], backend_op="ReduceMean")
def annotate_mean(node: Node, config: QuantizationConfig) -> None:
    annotate_siso(node, config)


@register_annotator([aten.sum.dim_IntList], backend_op="ReduceSum")
def annotate_sum(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)


# integer (or tuple) outputs: only the input is quantized
@register_annotator([aten.argmax.default], backend_op="Argmax")
def annotate_argmax(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in(node, config)


@register_annotator([aten.argmin.default], backend_op="Argmin")
def annotate_argmin(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in(node, config)


@register_annotator([aten.max.dim], backend_op="ReduceMax")
def annotate_max_dim(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in(node, config)


@register_annotator([aten.min.dim], backend_op="ReduceMin")
def annotate_min_dim(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in(node, config)


@register_annotator([aten.topk.default, aten.sort.default], backend_op="TopK")
def annotate_topk(node: Node, config: QuantizationConfig) -> None:
    """Input quantized; the values piece (``getitem`` 0) shares the input encoding."""
    annotate_input_shared_out(node, config, output=False)
