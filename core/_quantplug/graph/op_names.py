"""The canonical text of an op, the name rules, constraints and messages use for it.

Imports no torch until called: a backend's rules list their ops as text, and the command line
reads those lists before torch is imported.
"""

from __future__ import annotations

from typing import Any

#: ops whose weight (argument 1) acts on an input (argument 0) as a layer, which quantplug can re-run
#: with another input or weight (the weight algorithms' layers; the rewrites make layers of them)
LAYER_OPS = frozenset(
    {
        "aten.linear.default",
        "aten.conv1d.default",
        "aten.conv2d.default",
        "aten.conv3d.default",
        "aten.conv_transpose1d.input",
        "aten.conv_transpose2d.input",
        "aten.conv_transpose3d.input",
    }
)


def op_name(op: Any) -> str:
    """Canonical text of an op target: ``"aten.conv2d.default"``, or a function's qualified name."""
    if isinstance(op, str):
        return op
    import torch

    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(op)
    name = getattr(op, "__name__", None)
    module = getattr(op, "__module__", None)
    if name is not None and module is not None:
        return f"{module}.{name}"
    return str(op)
