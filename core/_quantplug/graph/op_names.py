"""The canonical text of an op, the name rules, constraints and messages use for it.

Imports no torch until called: a backend's rules list their ops as text, and the command line
reads those lists before torch is imported.
"""

from __future__ import annotations

from typing import Any


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
