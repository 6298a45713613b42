"""Running the kit: every check (or some) against one backend, into a :class:`ConformanceReport`.

The kit judges a backend as installed. An installed backend (an entry point) is checked in a
fresh interpreter of the kit's own (``isolated``), started from the environment as installed:
nothing this process registers in-process (extensions, backends shadowing it), puts on
``sys.path`` or imports reaches it, and a hook that exits, crashes the interpreter or hangs
fails its check instead of ending or blocking the run. A backend registered in-process exists
only in this process and is checked here (the report says so: ``quantplug conformance`` cannot
see it).

Both run the same steps (:func:`run_steps`): each step is an event (a check starts, its cases,
a case runs, its result), applied to the report by :class:`Assembly`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

from _quantplug.conformance.checks import CHECKS, Check, Failed, Session, Skipped
from _quantplug.conformance.faults import MIN_TIMEOUT_S, describe, guarded, user_interrupted
from _quantplug.conformance.report import FAIL, PASS, SKIP, CaseResult, CheckResult, ConformanceReport

#: seconds one check (one case of a per-op check) may take before it fails as hung
DEFAULT_TIMEOUT_S = 600.0

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


def run_conformance(
    name: str,
    *,
    options: Mapping[str, Any] | None = None,
    only: Iterable[str] | None = None,
    progress: Callable[[str], None] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> ConformanceReport:
    """Run the conformance checks against backend ``name`` as installed.

    An installed backend is checked in a fresh interpreter started from this environment (what
    ``quantplug conformance NAME`` sees): in-process registrations, extensions a test session
    adds and modules already imported here play no part. A backend registered in-process is
    checked in this process, the only one where it exists (the report shows it as
    ``(in-process)``).

    Args:
        name: the backend name (installed, or registered in-process).
        options: backend options applied to every quantizer the kit builds.
        only: check names to run (default: all); see ``quantplug.conformance.CHECKS``.
        progress: called with each check's name before it runs.
        timeout: seconds each check (each op of the per-op check) may run; one running longer
            fails as hung, and the kit goes on with the next.

    Returns:
        The report; ``report.ok`` is False when any check failed (a hook raising, calling
        ``sys.exit`` or hanging included).

    Raises:
        QuantplugError: the backend is unknown, disabled or claimed twice, or cannot be loaded
            (``BackendLoadError``).
    """
    return judge(name, options=options, only=only, progress=progress, timeout=timeout)


def judge(
    name: str,
    *,
    options: Mapping[str, Any] | None = None,
    only: Iterable[str] | None = None,
    progress: Callable[[str], None] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    environ: Mapping[str, str] | None = None,
) -> ConformanceReport:
    """:func:`run_conformance`, with the environment an installed backend is judged in
    (default: this process's; the pytest plugin passes the one pytest started with)."""
    from _quantplug.conformance import isolated
    from _quantplug.plugins.registry import in_process_names

    selected = _select(only)
    timeout = _check_timeout(timeout)
    if name in in_process_names():
        return _run_here(name, dict(options or {}), selected, progress, timeout)
    return isolated.run(
        name, dict(options or {}), selected, progress=progress, timeout=timeout, environ=environ
    )


def list_cases(
    name: str, *, timeout: float = DEFAULT_TIMEOUT_S, environ: Mapping[str, str] | None = None
) -> list[tuple[Check, list[str] | str]]:
    """Each check and its cases (an op per case for the per-op check), or why they could not be
    listed; found as :func:`judge` would run them (the pytest plugin makes a test of each).

    Raises:
        QuantplugError: the backend cannot be found or loaded.
    """
    from _quantplug.conformance import isolated
    from _quantplug.plugins.registry import in_process_names

    timeout = _check_timeout(timeout)
    if name in in_process_names():
        events: Iterable[Event] = run_steps(Session(name), CHECKS, timeout=timeout, list_only=True)
    else:
        events = isolated.steps(name, {}, CHECKS, timeout=timeout, environ=environ, list_only=True)
    found: dict[str, list[str] | str] = {}
    missing = "the kit's process listed no cases"
    for event in events:
        if event["event"] == "cases":
            found[event["check"]] = list(event["cases"])
        elif event["event"] == "cases-failed":
            found[event["check"]] = event["message"]
        elif event["event"] == "stopped":
            missing = f"the kit's process listing the cases {event['reason']}"
    return [(c, found.get(c.name, missing)) for c in CHECKS]


def _run_here(
    name: str,
    options: Mapping[str, Any],
    checks: list[Check],
    progress: Callable[[str], None] | None,
    timeout: float,
) -> ConformanceReport:
    session = Session(name, options)
    assembly = Assembly(name, checks, progress)
    entry = session.entry
    if entry is not None:
        assembly.report.distribution, assembly.report.version = entry.distribution, entry.version
    for event in run_steps(session, checks, timeout=timeout):
        assembly.feed(event)
    return assembly.finish()


def _check_timeout(timeout: float) -> float:
    from _quantplug.errors import OptionError

    try:
        value = float(timeout)
    except (TypeError, ValueError):
        value = float("nan")
    if not value >= MIN_TIMEOUT_S or value == float("inf"):
        raise OptionError(
            f"the conformance timeout must be a number of seconds >= {MIN_TIMEOUT_S:g}, got {timeout!r}"
        )
    return value


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
