"""Running the kit: every check (or some) against one backend, into a :class:`ConformanceReport`."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from _quantplug.conformance.checks import CHECKS, Check, Failed, Session, Skipped
from _quantplug.conformance.report import FAIL, PASS, SKIP, CaseResult, CheckResult, ConformanceReport


def run_case(check: Check, session: Session, case: str) -> CaseResult:
    """One case of one check; a capability the backend lacks skips it, any error fails it."""
    label = case or check.name
    try:
        missing = [c for c in check.requires if not session.profile.supports(c)]
        if missing:
            reasons = "; ".join(f"{c}: {session.profile.unsupported[c]}" for c in missing)
            return CaseResult(label, SKIP, f"the backend declares no {', '.join(missing)} ({reasons})")
        return CaseResult(label, PASS, check.run(session, case))
    except Skipped as exc:
        return CaseResult(label, SKIP, str(exc))
    except Failed as exc:
        return CaseResult(label, FAIL, str(exc))
    except Exception as exc:  # a crash is a failure of the backend, reported with where it happened
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return CaseResult(
            label, FAIL, f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno} in {where.name})"
        )


def run_conformance(
    name: str,
    *,
    options: Mapping[str, Any] | None = None,
    only: Iterable[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ConformanceReport:
    """Run the conformance checks against backend ``name``.

    Args:
        name: the backend name (installed, or registered in-process).
        options: backend options applied to every quantizer the kit builds.
        only: check names to run (default: all); see ``quantplug.conformance.CHECKS``.
        progress: called with each check's name before it runs.

    Returns:
        The report; ``report.ok`` is False when any check failed.
    """
    selected = _select(only)
    session = Session(name, dict(options or {}))
    entry = session.entry
    report = ConformanceReport(name, entry.distribution if entry else None, entry.version if entry else None)
    for check in selected:
        if progress is not None:
            progress(check.name)
        result = CheckResult(check.name, check.title)
        try:
            cases = check.case_ids(session)
        except Exception as exc:  # the cases come from the backend (its claimed ops)
            result.cases.append(CaseResult(check.name, FAIL, f"{type(exc).__name__}: {exc}"))
        else:
            result.cases.extend(run_case(check, session, case) for case in cases)
            if not result.cases:
                result.cases.append(CaseResult(check.name, PASS, "nothing to check"))
        report.checks.append(result)
    return report


def _select(only: Iterable[str] | None) -> list[Check]:
    if only is None:
        return list(CHECKS)
    wanted = list(only)
    known = {c.name for c in CHECKS}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        from _quantplug.errors import QuantplugError

        raise QuantplugError(
            f"unknown conformance check(s) {', '.join(map(repr, unknown))}; "
            f"checks: {', '.join(sorted(known))}"
        )
    return [c for c in CHECKS if c.name in wanted]
