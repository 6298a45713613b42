"""Which producer/activation pairs run as one kernel (so no encoding sits between them)."""

from __future__ import annotations

import torch
from torch.fx import Node

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


def has_fused_activation(node: Node) -> bool:
    """``node`` feeds exactly one relu-like op, which will carry the output encoding."""
    users = list(node.users)
    return len(users) == 1 and users[0].op == "call_function" and users[0].target in FUSABLE_ACTIVATIONS


def is_fused_activation(node: Node) -> bool:
    """``node`` is a relu-like op whose producer fuses it."""
    producer = node.args[0] if node.args else None
    return (
        isinstance(producer, Node)
        and producer.op == "call_function"
        and producer.target in FUSING_PRODUCERS
        and len(producer.users) == 1
    )
