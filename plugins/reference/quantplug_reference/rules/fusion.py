"""Which producer/activation pairs run as one kernel (so no encoding sits between them).

The pairs are declared to the core (``PATTERNS``, hook ``quantplug_fusion_patterns``), which
decides each one from the configs selected for both nodes; the predicates below read that
decision. A relu the user keeps float leaves its producer quantized on its own (ONNX Runtime
has a QLinearConv without the relu).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from quantplug.backend import FusionPattern, fused_head, fused_tail

aten = torch.ops.aten

FUSABLE_ACTIVATIONS = frozenset(
    {aten.relu.default, aten.relu_.default, aten.hardtanh.default, aten.hardtanh_.default, aten.relu6.default}
)
FUSING_PRODUCERS = frozenset(
    {
        aten.conv1d.default,
        aten.conv2d.default,
        aten.conv3d.default,
        aten.conv_transpose1d.default,
        aten.conv_transpose2d.input,
        aten.linear.default,
        aten.add.Tensor,
        aten.add_.Tensor,
        aten.mul.Tensor,
        aten.mul_.Tensor,
    }
)


PATTERNS = (
    FusionPattern(FUSING_PRODUCERS, FUSABLE_ACTIVATIONS, when_tail_float="quantize_head", name="op+relu"),
)


def has_fused_activation(node: Node) -> bool:
    """``node`` feeds a relu-like op that runs in its kernel and carries the output encoding."""
    return fused_tail(node) is not None


def is_fused_activation(node: Node) -> bool:
    """``node`` is a relu-like op right after a fusing producer: only its output is quantized.

    True whether or not the producer is quantized: after a quantized producer the pair is fused
    (the core's decision, ``fused_head``); after a float one the relu reads the float value
    directly, which saves a quantize/dequantize pair on ONNX Runtime.
    """
    producer = node.args[0] if node.args else None
    return fused_head(node) is not None or (
        isinstance(producer, Node)
        and producer.op == "call_function"
        and producer.target in FUSING_PRODUCERS
        and len(producer.users) == 1
    )
