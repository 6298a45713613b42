"""Naming a program's nodes and tensors the way the user knows them: module paths and parameters.

Node names (``dequantize_per_tensor_default_23``) are internal: an error a user can act on says
``ln2.weight`` or "the output of ``attn`` (MultiheadAttention)". ``torch.export`` records each
op's module stack (``nn_module_stack``); a quantized constant is named after the argument of the
op that reads it (``weight`` of the ``aten.layer_norm`` in module ``ln2``).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from _quantplug.graph.op_names import op_name

_QDQ_NAMESPACES = ("quantized_decomposed", "quantplug")


def module_of(node: Node) -> tuple[str, str] | None:
    """``(path, class name)`` of the innermost module ``node`` was traced in (None: unknown)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, kind = list(stack.values())[-1]
    name = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
    return str(path), name


def _is_qdq(node: Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace in _QDQ_NAMESPACES


def _readers(node: Node) -> list[Node]:
    """The ops reading ``node``, through any Q/DQ nodes in between."""
    found: list[Node] = []
    todo = list(node.users)
    seen: set[Node] = set()
    while todo:
        user = todo.pop(0)
        if user in seen:
            continue
        seen.add(user)
        if user.op == "call_function" and _is_qdq(user):
            todo.extend(user.users)
        elif user.op == "call_function":
            found.append(user)
    return found


def _argument_name(user: Node, value: Node) -> str | None:
    schema = getattr(user.target, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(user.args):
        if arg is value and i < len(schema.arguments):
            return str(schema.arguments[i].name)
    for key, arg in user.kwargs.items():
        if arg is value:
            return str(key)
    return None


def parameter_name(node: Node) -> str | None:
    """``ln2.weight`` for a (quantized) constant read as the ``weight`` of an op in ``ln2``."""
    for user in _readers(node):
        where = module_of(user)
        if where is None:
            continue
        arg = next(
            (_argument_name(user, a) for a in user.all_input_nodes if a is node or _upstream(a, node)), None
        )
        if arg is not None:
            return f"{where[0]}.{arg}" if where[0] else arg
    return None


def _upstream(value: Node, source: Node) -> bool:
    """Whether ``value`` is ``source`` seen through Q/DQ nodes."""
    while value.op == "call_function" and _is_qdq(value) and value.args:
        first = value.args[0]
        if not isinstance(first, Node):
            return False
        if first is source:
            return True
        value = first
    return False


def where(node: Node) -> str:
    """`` in module ln2 (LayerNorm)`` (empty when the module is unknown)."""
    found = module_of(node)
    return f" in module {found[0] or '<root>'} ({found[1]})" if found else ""


def describe(node: Node) -> str:
    """How a user would recognise ``node``'s tensor: a parameter, a model input, a module's output."""
    source: Node = node
    while (
        source.op == "call_function" and _is_qdq(source) and source.args and isinstance(source.args[0], Node)
    ):
        source = source.args[0]
    if source.op == "placeholder":
        return f"model input {source.name!r}"
    if source.op == "get_attr":
        param = parameter_name(source)
        attr = str(source.target)
        return f"parameter {param} (stored as {attr!r})" if param else f"constant {attr!r}"
    where = module_of(source)
    op = op_name(source.target)
    if where is None:
        return f"the output of {op} (node {source.name!r})"
    path, kind = where
    return f"the output of {op} in module {path or '<root>'} ({kind}, node {source.name!r})"
