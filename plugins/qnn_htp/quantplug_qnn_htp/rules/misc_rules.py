"""Everything else in ExecuTorch's HTP table: constants, scatter/index updates, grid sample, cdist,
im2col/col2im, scaled dot-product attention (kept whole; no 1:1 QNN op)."""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    SharedQuantizationSpec,
    annotate_binary,
    annotate_node,
    annotate_single_in_single_out,
    is_annotated,
    is_float_tensor,
    register_annotator,
)
from quantplug_qnn_htp.rules.concat_rules import annotate_one_encoding

aten = torch.ops.aten


@register_annotator(
    [
        aten.arange.default,
        aten.arange.start,
        aten.arange.start_step,
        aten.scalar_tensor.default,
        aten.full_like.default,
        aten.full.default,
        aten.zeros.default,
        aten.zeros_like.default,
        aten.ones.default,
        aten.ones_like.default,
        aten.rand.default,
        aten.randn.default,
    ]
)
def annotate_constant(node: Node, config: QuantizationConfig) -> None:
    """Float constants are quantized at their output only."""
    if is_annotated(node) or not is_float_tensor(node) or config.output_activation is None:
        return
    annotate_node(node, output_qspec=config.output_activation)


@register_annotator([aten.grid_sampler.default], backend_op="GridSample")
def annotate_grid_sample(node: Node, config: QuantizationConfig) -> None:
    annotate_binary(node, config)


@register_annotator([aten.cdist.default])
def annotate_cdist(node: Node, config: QuantizationConfig) -> None:
    annotate_binary(node, config)


@register_annotator([aten.col2im.default, aten.im2col.default, aten.scaled_dot_product_attention.default])
def annotate_siso_unmapped(node: Node, config: QuantizationConfig) -> None:
    annotate_single_in_single_out(node, config)


def _value_shared(node: Node, config: QuantizationConfig, value_index: int) -> None:
    """Only ``value`` is quantized; the output shares it (the updated self is a mutable buffer)."""
    if is_annotated(node) or config.input_activation is None or len(node.args) <= value_index:
        return
    value = node.args[value_index]
    if not is_float_tensor(value):
        return
    out = SharedQuantizationSpec((value, node)) if is_float_tensor(node) else None  # type: ignore[arg-type]
    annotate_node(node, {value: config.input_activation}, out)  # type: ignore[dict-item]


@register_annotator([aten.index_copy.default, aten.index_copy_.default])
def annotate_index_copy(node: Node, config: QuantizationConfig) -> None:
    # index_copy(self, dim, index, source)
    _value_shared(node, config, 3)


@register_annotator([aten.index_put.default, aten.index_put_.default])
def annotate_index_put(node: Node, config: QuantizationConfig) -> None:
    # index_put(self, indices, values, accumulate)
    _value_shared(node, config, 2)


def _self_shared(node: Node, config: QuantizationConfig, other_index: int | None) -> None:
    """``self`` gets the activation spec; ``src`` (if a tensor) and the output share it."""
    if is_annotated(node) or config.input_activation is None:
        return
    base = node.args[0]
    if not is_float_tensor(base):
        return
    specs = {base: config.input_activation}
    if other_index is not None and len(node.args) > other_index:
        src = node.args[other_index]
        if is_float_tensor(src) and src is not base:
            specs[src] = SharedQuantizationSpec((base, node))  # type: ignore[index,arg-type]
    out = SharedQuantizationSpec((base, node)) if is_float_tensor(node) else None  # type: ignore[arg-type]
    annotate_node(node, specs, out)  # type: ignore[arg-type]


@register_annotator([aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two])
def annotate_scatter(node: Node, config: QuantizationConfig) -> None:
    """scatter(self, dim, index, src/value, ...): ``self``, ``src`` and the output on one encoding.

    ScatterElements keeps one encoding through; an accumulating scatter (add, sum, prod) leaves
    the range of ``self``, so the group is observed over the output too (ExecuTorch observes
    ``self`` only and clips every accumulated value beyond it).
    """
    if is_annotated(node) or config.input_activation is None or not is_float_tensor(node):
        return
    base = node.args[0]
    if not is_float_tensor(base):
        return
    inputs = [base]
    src = node.args[3] if len(node.args) > 3 else None
    if is_float_tensor(src) and src is not base:
        inputs.append(src)  # type: ignore[arg-type]
    annotate_one_encoding(node, config, inputs)  # type: ignore[arg-type]


@register_annotator([aten.slice_scatter.default])
def annotate_slice_scatter(node: Node, config: QuantizationConfig) -> None:
    # slice_scatter(self, src, dim, start, end, step)
    _self_shared(node, config, 1)
