"""The conformance kit's results: one line per check, details for what failed, JSON for machines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass
class CaseResult:
    """One case of a check (an op, or the check itself when it has a single case)."""

    case: str
    status: str
    message: str = ""


@dataclass
class CheckResult:
    """One check: what it verifies, and the outcome of each of its cases."""

    name: str
    title: str
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def status(self) -> str:
        statuses = {c.status for c in self.cases}
        if FAIL in statuses:
            return FAIL
        if statuses == {SKIP}:
            return SKIP
        return PASS

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if c.status == FAIL]

    def summary(self) -> str:
        if len(self.cases) == 1:
            return self.cases[0].message
        counts = {s: sum(c.status == s for c in self.cases) for s in (PASS, FAIL, SKIP)}
        parts = [f"{counts[PASS]} passed"]
        if counts[FAIL]:
            parts.append(f"{counts[FAIL]} failed")
        if counts[SKIP]:
            parts.append(f"{counts[SKIP]} skipped")
        return f"{len(self.cases)} cases: " + ", ".join(parts)


@dataclass
class ConformanceReport:
    """Every check run against one backend; ``ok`` when none failed (skips are allowed)."""

    backend: str
    distribution: str | None = None
    version: str | None = None
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == FAIL]

    def format(self, *, verbose: bool = False) -> str:
        origin = f" ({self.distribution} {self.version})" if self.distribution else " (in-process)"
        lines = [f"quantplug conformance: backend {self.backend!r}{origin}"]
        width = max((len(c.name) for c in self.checks), default=8)
        for check in self.checks:
            lines.append(f"  {check.status.upper():<4}  {check.name:<{width}}  {check.title}")
            lines.append(f"        {'':<{width}}  {check.summary()}")
            shown = check.cases if verbose and len(check.cases) > 1 else check.failures
            for case in shown:
                if len(check.cases) == 1 and case.status == FAIL:
                    continue  # the summary is the message
                lines.append(f"        {'':<{width}}  - {case.status} {case.case}: {case.message}")
        counts = {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, SKIP)}
        verdict = "CONFORMS" if self.ok else "DOES NOT CONFORM (failed: " + ", ".join(self.failed) + ")"
        lines.append(
            f"{len(self.checks)} checks: {counts[PASS]} passed, {counts[FAIL]} failed, "
            f"{counts[SKIP]} skipped -> {verdict}"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "distribution": self.distribution,
            "version": self.version,
            "ok": self.ok,
            "failed": self.failed,
            "checks": [
                {
                    "name": c.name,
                    "title": c.title,
                    "status": c.status,
                    "summary": c.summary(),
                    "cases": [{"case": x.case, "status": x.status, "message": x.message} for x in c.cases],
                }
                for c in self.checks
            ],
        }
