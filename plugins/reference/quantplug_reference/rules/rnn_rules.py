"""Recurrent layers (GRU, LSTM, RNN).

Static configs quantize them at their boundary only, like XNNPACK's ``gru_io_only``: the sequence
input and initial states on the way in, the outputs (the ``getitem`` pieces of the op's result
tuple, see ``shape_rules``) on the way out; the recurrence itself (gates, weights) stays float.

Weight-only configs quantize their weight matrices, as they do a linear's: a weight-only int4
model whose LSTM (often most of its parameters) stayed float32 was barely smaller. ONNX Runtime
runs the LSTM in float on the dequantized weights either way.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import (
    QuantizationConfig,
    QuantizationSpecBase,
    annotate_node,
    is_annotated,
    is_float_tensor,
    register_annotator,
)
from quantplug_reference.rules.common import static_activations, weight_only
from quantplug_reference.rules.linear_rules import fit_block_spec

aten = torch.ops.aten

RNN_OPS = frozenset({aten.gru.input, aten.lstm.input, aten.rnn_tanh.input, aten.rnn_relu.input})


@register_annotator(sorted(RNN_OPS, key=str))
def annotate_rnn(node: Node, config: QuantizationConfig) -> None:
    if is_annotated(node):
        return
    if weight_only(config):
        annotate_recurrent_weights(node, config)
        return
    if not static_activations(config):
        return
    inputs: dict[Node, QuantizationSpecBase | None] = {}
    x = node.args[0]
    if is_float_tensor(x):
        inputs[x] = config.input_activation  # type: ignore[index]
    states = node.args[1]
    for state in states if isinstance(states, (list, tuple)) else [states]:
        if is_float_tensor(state) and state is not x:
            inputs[state] = config.input_activation  # type: ignore[index]
    if inputs:
        annotate_node(node, inputs)


def annotate_recurrent_weights(node: Node, config: QuantizationConfig) -> None:
    """Weight-only configs: the ``w_ih``/``w_hh`` of every layer and direction (and a projected
    LSTM's ``w_hr``), each a constant ``[gates * hidden, inputs]`` matrix the op multiplies like a
    linear's weight; biases and the recurrence stay float, as the linear rule leaves them."""
    params = node.args[2] if len(node.args) > 2 else None
    if not isinstance(params, (list, tuple)):
        return
    inputs: dict[Node, QuantizationSpecBase | None] = {}
    for param in params:
        val = param.meta.get("val") if isinstance(param, Node) else None
        if (
            isinstance(param, Node)
            and param.op == "get_attr"
            and isinstance(val, torch.Tensor)
            and val.dim() == 2
        ):
            inputs[param] = fit_block_spec(config.weight, param)  # type: ignore[assignment]
    if inputs:
        annotate_node(node, inputs)
