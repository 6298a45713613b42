"""The kit's own process (``python -m _quantplug.conformance.worker``): runs checks against an
installed backend and reports each step to the parent (``isolated``) as one JSON line.

The request (backend, options, checks, cases already run, timeout) comes on stdin. The events
go to a private copy of stdout: whatever the plugin prints lands on stderr, so it cannot corrupt
them. Besides the per-check timeout (``faults.guarded``), ``faulthandler`` ends this process,
with every thread's stack on stderr, when a step outlives the timeout by its grace (:func:`grace`:
a hook blocked in native code, which no Python-level interrupt reaches); the parent then reports
that check as hung and starts a new process for the rest.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from collections.abc import Callable
from typing import Any

#: what a step may take beyond the timeout before this process ends itself, at most (and what
#: starting up may take beyond it: importing torch, the checks and the plugin)
GRACE_S = 15.0


def grace(timeout: float) -> float:
    """How long past ``timeout`` a check's interrupt (``faults.guarded``) may take to land before
    the process ends itself: :data:`GRACE_S`, but no longer than the timeout itself. An
    interrupt lands within the next Python bytecode; what outlasts it is blocked in native code
    and will not return, so a user who asked for a short timeout (``--timeout 5``) hears of a
    blocked hook after twice that, not after the timeout and 15 s more."""
    return min(GRACE_S, timeout)


def main() -> int:
    # `python -m` puts the working folder first on sys.path; the kit judges the environment as
    # installed, as `quantplug conformance` does (cli.main.run_module)
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    events = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    request = json.loads(sys.stdin.read())
    timeout = float(request["timeout"])

    def emit(event: dict[str, Any]) -> None:
        after = GRACE_S if event["event"] == "started" else grace(timeout)  # the next step's deadline
        faulthandler.dump_traceback_later(timeout + after, exit=True)
        events.write(json.dumps(event, default=str) + "\n")

    try:
        emit({"event": "started"})
        return _run(request, timeout, emit)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _run(request: dict[str, Any], timeout: float, emit: Callable[[dict[str, Any]], None]) -> int:
    from _quantplug.conformance.checks import load
    from _quantplug.conformance.checks.session import Session
    from _quantplug.conformance.faults import describe, guarded, user_interrupted
    from _quantplug.conformance.steps import run_steps
    from _quantplug.errors import BackendLoadError, QuantplugError
    from _quantplug.plugins.registry import load_backend

    every_check = load()  # torch and the checks, on the start-up's deadline, not a check's
    name = request["backend"]
    try:
        with guarded(timeout):
            entry = load_backend(name).entry
    except BaseException as exc:
        if user_interrupted(exc):
            raise
        failure: dict[str, Any] = {"event": "load-failed", "kind": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, BackendLoadError):
            failure.update(
                name=exc.name,
                distribution=exc.distribution,
                module=exc.module,
                cause=_cause(exc),
                extension_of=exc.extension_of,
            )
        elif not isinstance(exc, QuantplugError):
            failure["message"] = f"loading backend {name!r}: {describe(exc)}"
        emit(failure)
        return 0
    emit({"event": "loaded", "distribution": entry.distribution, "version": entry.version})
    wanted = set(request["checks"])
    checks = [c for c in every_check if c.name in wanted]
    done = {(check, case) for check, case in request["done"]}
    session = Session(name, request["options"])
    for event in run_steps(session, checks, timeout=timeout, done=done, list_only=request["list"]):
        emit(event)
    emit({"event": "end"})
    return 0


def _cause(exc: Any) -> str:
    cause = exc.cause
    return f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause)


if __name__ == "__main__":
    sys.exit(main())
