"""The kit's steps, wherever they run: each step is an event (a check starts, its cases, a case
runs, its result), applied to a report by :class:`Assembly`.

The calling process (a backend registered in-process) and the kit's own interpreter
(``worker``, an installed backend) run the very same :func:`run_steps`; ``isolated`` assembles the
worker's events. Kept apart from ``runner``, which chooses where to run, so that no module of the
kit imports another in a cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from _quantplug.conformance.checks import Check, Failed, Skipped
from _quantplug.conformance.faults import describe, guarded, user_interrupted
from _quantplug.conformance.report import FAIL, PASS, SKIP, CaseResult, CheckResult, ConformanceReport

if TYPE_CHECKING:
    from _quantplug.conformance.checks.session import Session

Event = dict[str, Any]


def run_case(check: Check, session: Session, case: str, *, timeout: float | None = None) -> CaseResult:
    """One case of one check; a capability the backend lacks skips it. Anything else the
    backend's code does (an exception, ``sys.exit``, a KeyboardInterrupt of its own, running
    past ``timeout`` seconds) fails it, naming the hook and the code at fault; only the user's
    own Ctrl-C propagates."""
    label = case or check.name
    try:
        with guarded(timeout):
            missing = [c for c in check.requires if not session.profile.supports(c)]
            if missing:
                reasons = "; ".join(f"{c}: {session.profile.unsupported[c]}" for c in missing)
                return CaseResult(label, SKIP, f"the backend declares no {', '.join(missing)} ({reasons})")
            return CaseResult(label, PASS, check.run(session, case))
    except Skipped as exc:
        return CaseResult(label, SKIP, str(exc))
    except Failed as exc:
        return CaseResult(label, FAIL, str(exc))
    except BaseException as exc:  # the backend's fault, whatever it raised (faults.describe)
        if user_interrupted(exc):
            raise
        return CaseResult(label, FAIL, describe(exc))


def run_steps(
    session: Session,
    checks: Iterable[Check],
    *,
    timeout: float | None,
    done: Collection[tuple[str, str]] = (),
    list_only: bool = False,
) -> Iterator[Event]:
    """Run ``checks`` against ``session``'s backend, one event per step; cases in ``done``
    (``(check, case)``, already run by an earlier process) are left out, and with ``list_only``
    the cases are listed, not run."""
    for check in checks:
        yield {"event": "check", "check": check.name}
        try:
            with guarded(timeout):
                cases = check.case_ids(session)  # from the backend: its claimed ops
        except BaseException as exc:
            if user_interrupted(exc):
                raise
            yield {"event": "cases-failed", "check": check.name, "message": describe(exc)}
            continue
        yield {"event": "cases", "check": check.name, "cases": list(cases)}
        for case in () if list_only else cases:
            if (check.name, case) in done:
                continue
            yield {"event": "running", "check": check.name, "case": case}
            result = run_case(check, session, case, timeout=timeout)
            yield {
                "event": "result",
                "check": check.name,
                "case": case,
                "label": result.case,
                "status": result.status,
                "message": result.message,
            }
        yield {"event": "check-done", "check": check.name}


class Assembly:
    """A report built from :func:`run_steps`' events, possibly from several processes: what
    ran, what is running (to blame when a process dies), what is left."""

    def __init__(
        self, name: str, checks: Iterable[Check], progress: Callable[[str], None] | None = None
    ) -> None:
        self.report = ConformanceReport(name)
        self.checks = list(checks)
        self.results = {c.name: CheckResult(c.name, c.title) for c in self.checks}
        self.progress = progress
        self.done: set[tuple[str, str]] = set()
        self.finished: set[str] = set()
        self.check: str | None = None  # the check being run
        self.case: str | None = None  # its case being run (None: between cases)
        self.started: set[str] = set()

    def feed(self, event: Event) -> None:
        kind, check = event["event"], event.get("check")
        if kind == "check":
            self.check, self.case = check, None
            if check not in self.started and self.progress is not None:
                self.progress(str(check))
            self.started.add(str(check))
        elif kind == "cases-failed":
            self.results[str(check)].cases.append(CaseResult(str(check), FAIL, event["message"]))
            self.finished.add(str(check))
            self.check = None
        elif kind == "running":
            self.case = event["case"]
        elif kind == "result":
            self.results[str(check)].cases.append(
                CaseResult(event["label"], event["status"], event["message"])
            )
            self.done.add((str(check), event["case"]))
            self.case = None
        elif kind == "check-done":
            self.finished.add(str(check))
            self.check = None

    def fail_running(self, message: str) -> None:
        """The process running the checks ended (or hung) at the current step: that case fails,
        or, between cases, the check."""
        if self.check is None:
            return
        if self.case is not None:
            self.feed(
                {
                    "event": "result",
                    "check": self.check,
                    "case": self.case,
                    "label": self.case or self.check,
                    "status": FAIL,
                    "message": message,
                }
            )
        else:
            self.feed({"event": "cases-failed", "check": self.check, "message": message})

    def remaining(self) -> list[Check]:
        return [c for c in self.checks if c.name not in self.finished]

    def finish(self) -> ConformanceReport:
        for check in self.checks:
            result = self.results[check.name]
            if not result.cases:
                result.cases.append(CaseResult(check.name, PASS, "nothing to check"))
            self.report.checks.append(result)
        return self.report
