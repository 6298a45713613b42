"""Running the kit: every check (or some) against one backend, into a :class:`ConformanceReport`.

The kit judges a backend as installed. An installed backend (an entry point) is checked in a
fresh interpreter of the kit's own (``isolated``), started from the environment as installed:
nothing this process registers in-process (extensions, backends shadowing it), puts on
``sys.path`` or imports reaches it, and a hook that exits, crashes the interpreter or hangs
fails its check instead of ending or blocking the run. A backend registered in-process exists
only in this process and is checked here (the report says so: ``quantplug conformance`` cannot
see it).

Both run the same steps (``steps.run_steps``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from _quantplug.conformance.checks import CHECKS, Check, load
from _quantplug.conformance.faults import MIN_TIMEOUT_S
from _quantplug.conformance.report import ConformanceReport
from _quantplug.conformance.steps import Assembly, Event, run_steps
from _quantplug.conformance.steps import run_case as run_case  # 0.1.0 read it here

#: seconds one check (one case of a per-op check) may take before it fails as hung
DEFAULT_TIMEOUT_S = 600.0


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
        from _quantplug.conformance.checks.session import Session

        events: Iterable[Event] = run_steps(Session(name), load(), timeout=timeout, list_only=True)
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
    from _quantplug.conformance.checks.session import Session

    load()  # as the kit's own process does: no check's timeout pays for the imports
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
