"""The result of validation: every violation, with where it is and what was expected."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("quantplug.validation")


@dataclass(frozen=True)
class Violation:
    """One constraint broken by one node's annotation."""

    node: str
    op: str
    backend_op: str | None
    port: str
    expected: str
    actual: str
    rule: str

    def format(self) -> str:
        target = f"{self.op} ({self.backend_op})" if self.backend_op else self.op
        where = f"node {self.node!r} [{target}] {self.port}"
        return f"{where}: {self.rule}: expected {self.expected}, got {self.actual}"


@dataclass
class ValidationReport:
    """All violations found in one graph, plus how many nodes were checked."""

    violations: list[Violation] = field(default_factory=list)
    checked_nodes: int = 0
    unconstrained_ops: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return not self.violations

    def __bool__(self) -> bool:
        return self.ok

    def by_node(self) -> dict[str, list[Violation]]:
        grouped: dict[str, list[Violation]] = {}
        for v in self.violations:
            grouped.setdefault(v.node, []).append(v)
        return grouped

    def format(self) -> str:
        if self.ok:
            return f"{self.checked_nodes} node(s) checked, no violations"
        return "\n".join("  - " + v.format() for v in self.violations)

    def log_warnings(self) -> None:
        for v in self.violations:
            logger.warning("quantization constraint: %s", v.format())

    def to_dict(self) -> dict[str, object]:
        return {
            "checked_nodes": self.checked_nodes,
            "violations": [v.__dict__ for v in self.violations],
            "unconstrained_ops": sorted(self.unconstrained_ops),
        }
