"""The result of validation: every violation, with where it is and what was expected."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from _quantplug.errors import ConstraintViolationError

logger = logging.getLogger("quantplug.validation")

#: when a violation was found: on annotations (``prepare``), on calibrated encodings
#: (``convert``), or by a backend's own check while lowering (``lower``)
STAGES = ("prepare", "convert", "lower")


@dataclass(frozen=True)
class Violation:
    """One constraint broken by one node: where (node, op, port or ports), which rule, what was
    expected and found, at which stage, and the constraint's own description and source."""

    node: str
    op: str
    backend_op: str | None
    port: str
    expected: str
    actual: str
    rule: str
    stage: str = "prepare"
    detail: str = ""

    def format(self) -> str:
        target = f"{self.op} ({self.backend_op})" if self.backend_op else self.op
        where = f"node {self.node!r} [{target}] {self.port}"
        rule = self.rule if self.stage == "prepare" else f"{self.rule} ({self.stage})"
        text = f"{where}: {rule}: expected {self.expected}, got {self.actual}"
        return f"{text} [{self.detail}]" if self.detail else text


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

    def enforce(self, strict: bool) -> ValidationReport:
        """Raise ``ConstraintViolationError`` (strict) or log each violation as a warning.

        What the core does at prepare and convert; a backend's own check (in a lowering pass,
        say) does the same with ``report.enforce(context.option("strict"))``.
        """
        if not self.ok:
            if strict:
                raise ConstraintViolationError(self)
            self.log_warnings()
        return self

    def extend(self, other: ValidationReport) -> ValidationReport:
        """Add another report's findings to this one (returns self)."""
        self.violations.extend(other.violations)
        self.checked_nodes += other.checked_nodes
        self.unconstrained_ops |= other.unconstrained_ops
        return self

    def to_dict(self) -> dict[str, object]:
        return {
            "checked_nodes": self.checked_nodes,
            "violations": [v.__dict__ for v in self.violations],
            "unconstrained_ops": sorted(self.unconstrained_ops),
        }
