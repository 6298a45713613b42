"""Recurrent layers (GRU, LSTM) quantized at their boundary only, like XNNPACK's ``gru_io_only``.

The sequence input and initial states are quantized on the way in; the outputs (the ``getitem``
pieces of the op's result tuple, see ``shape_rules``) on the way out. The recurrence itself
(gates, weights) stays float.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug import QuantizationConfig, QuantizationSpecBase, is_float_tensor, register_annotator
from quantplug.annotation.specs import annotate_node, is_annotated
from quantplug_reference.rules.common import static_activations

aten = torch.ops.aten

RNN_OPS = frozenset({aten.gru.input, aten.lstm.input, aten.rnn_tanh.input, aten.rnn_relu.input})


@register_annotator(sorted(RNN_OPS, key=str))
def annotate_rnn(node: Node, config: QuantizationConfig) -> None:
    if is_annotated(node) or not static_activations(config):
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
