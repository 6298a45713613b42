"""Data movement: the output reuses the input's encoding; cat unifies its inputs' encodings.

Multi-output ops (split, chunk, unbind) return a tuple, which cannot carry an encoding: their
input edge is quantized and each ``getitem`` output shares that edge's encoding. The outputs of
recurrent layers (``rnn_rules``) are ``getitem`` pieces too; each gets its own encoding.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    QuantizationSpecBase,
    SharedQuantizationSpec,
    annotate_node,
    annotate_shared_in_out,
    get_annotation,
    is_annotated,
    is_float_tensor,
    output_spec_of,
    register_annotator,
)
from quantplug_reference.rules.common import static_activations

aten = torch.ops.aten


@register_annotator(
    [
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.flatten.using_ints,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.unsqueeze.default,
        aten.contiguous.default,
        aten.clone.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.expand.default,
        aten.pad.default,
        aten.constant_pad_nd.default,
        aten.pixel_shuffle.default,
        aten.pixel_unshuffle.default,
        aten.view_copy.default,
        aten.permute_copy.default,
        aten.squeeze_copy.dim,
        aten.squeeze_copy.dims,
        aten.unsqueeze_copy.default,
        aten.slice_copy.Tensor,
        aten.select_copy.int,
        aten.expand_copy.default,
        aten.alias.default,
        aten.dropout.default,
        aten.unflatten.int,
        aten.narrow.default,
        aten.repeat.default,
        aten.flip.default,
        aten.roll.default,
        aten.index_select.default,
    ]
)
def annotate_data_movement(node: Node, config: QuantizationConfig) -> None:
    if static_activations(config):
        annotate_shared_in_out(node, config)


@register_annotator([aten.cat.default, aten.concat.default, aten.stack.default])
def annotate_cat(node: Node, config: QuantizationConfig) -> None:
    """All inputs and the output share the first input's encoding (cat/stack only move values)."""
    if is_annotated(node) or not static_activations(config) or not is_float_tensor(node):
        return
    inputs = [a for a in node.args[0] if isinstance(a, Node) and is_float_tensor(a)]  # type: ignore[union-attr]
    if not inputs:
        return
    first = inputs[0]
    specs: dict[Node, QuantizationSpecBase | None] = {first: config.input_activation}
    for other in inputs[1:]:
        if other is not first:
            specs[other] = SharedQuantizationSpec((first, node))
    annotate_node(node, specs, SharedQuantizationSpec((first, node)))


SPLIT_OPS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int})
#: the recurrent ops of ``rnn_rules`` (listed here so this module does not import that one)
RNN_OUTPUT_OPS = frozenset({aten.gru.input, aten.lstm.input, aten.rnn_tanh.input, aten.rnn_relu.input})


@register_annotator(sorted(SPLIT_OPS, key=str))
def annotate_split(node: Node, config: QuantizationConfig) -> None:
    """Quantize the input edge only; the pieces (``getitem`` nodes) share its encoding."""
    if is_annotated(node) or not static_activations(config):
        return
    arg = node.args[0] if node.args else None
    if not is_float_tensor(arg):
        return
    in_spec: QuantizationSpecBase | None
    if output_spec_of(arg) is not None:  # type: ignore[arg-type]
        in_spec = SharedQuantizationSpec(arg)  # type: ignore[arg-type]
    else:
        in_spec = config.input_activation
    if in_spec is not None:
        annotate_node(node, {arg: in_spec})  # type: ignore[dict-item]


@register_annotator([operator.getitem])
def annotate_getitem(node: Node, config: QuantizationConfig) -> None:
    """A piece of a split shares the encoding of the split's (quantized) input edge.

    An output of a recurrent layer gets the output activation encoding. ``getitem`` of anything
    else (batch-norm statistics, pooling indices...) stays as is.
    """
    if is_annotated(node) or not is_float_tensor(node) or not static_activations(config):
        return
    parent = node.args[0]
    if not isinstance(parent, Node) or parent.op != "call_function":
        return
    if parent.target in RNN_OUTPUT_OPS:
        if get_annotation(parent) is not None and config.output_activation is not None:
            annotate_node(node, output_qspec=config.output_activation)
        return
    if parent.target not in SPLIT_OPS:
        return
    source = parent.args[0]
    ann = get_annotation(parent)
    if not isinstance(source, Node) or ann is None or ann.input_qspec_map.get(source) is None:
        return  # the split stays float (discarded, or its input is not a float tensor)
    annotate_node(node, output_qspec=SharedQuantizationSpec((source, parent)))
