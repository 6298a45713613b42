"""Per-node config selection: which QuantizationConfig (or none: keep float) a node gets.

Precedence, most specific first: node name, custom predicate, module name (longest prefix of the
node's module path), module type (innermost module), op, global. An override of ``None``
discards: the node keeps float.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.fx import Node

from _quantplug.annotation.specs import QuantizationConfig
from _quantplug.graph.op_names import op_name

_UNSET: Any = object()


def _type_name(t: type | str) -> str:
    return t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}"


@dataclass
class ConfigSelector:
    """The global config plus every override, with a single ``select(node)`` query."""

    global_config: QuantizationConfig | None
    node_names: dict[str, QuantizationConfig | None] = field(default_factory=dict)
    predicates: list[tuple[Callable[[Node], bool], QuantizationConfig | None]] = field(default_factory=list)
    module_names: dict[str, QuantizationConfig | None] = field(default_factory=dict)
    module_types: dict[str, QuantizationConfig | None] = field(default_factory=dict)
    ops: dict[str, QuantizationConfig | None] = field(default_factory=dict)

    def select(self, node: Node) -> tuple[QuantizationConfig | None, str]:
        """The node's config and the reason it was chosen (shown in coverage reports)."""
        if node.name in self.node_names:
            return self.node_names[node.name], f"node name {node.name!r}"
        for predicate, config in self.predicates:
            if predicate(node):
                return config, f"filter {getattr(predicate, '__name__', 'predicate')}"
        stack = node.meta.get("nn_module_stack") or {}
        if self.module_names:
            best = _UNSET
            best_len = -1
            for fqn, _ in stack.values():
                for prefix, config in self.module_names.items():
                    if (fqn == prefix or fqn.startswith(prefix + ".") or prefix == "") and len(
                        prefix
                    ) > best_len:
                        best, best_len = config, len(prefix)
            if best is not _UNSET:
                return best, "module name"
        if self.module_types:
            for _, type_str in reversed(list(stack.values())):
                name = _type_name(type_str) if not isinstance(type_str, str) else type_str
                if name in self.module_types:
                    return self.module_types[name], f"module type {name}"
        name = op_name(node.target)
        if name in self.ops:
            return self.ops[name], f"op {name}"
        return self.global_config, "global"

    def set_module_type(self, module_type: type | str, config: QuantizationConfig | None) -> None:
        self.module_types[_type_name(module_type)] = config
