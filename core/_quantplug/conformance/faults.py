"""What a check's crash, exit or hang is reported as: the plugin code at fault, named.

Anything a plugin raises while the kit runs it is that plugin's failure, ``SystemExit`` and
``KeyboardInterrupt`` included: a hook calling ``sys.exit(0)`` must not end the run with "exit
0", as if the backend conformed. The one exception is the user's own Ctrl-C, which
:func:`guarded` tells apart (its SIGINT handler marks it) and lets through.

A check that runs longer than its timeout is interrupted by ``SIGALRM`` (:func:`guarded`, on the
main thread), which stops a hook looping or sleeping in Python code. A hook blocked inside native
code is beyond that: in a process of the kit's own (``worker``), ``faulthandler`` then ends the
process a grace period later and the parent (``isolated``) reports the check as hung; in the
caller's process (a backend registered in-process) nothing can stop it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from _quantplug.plugins.culprit import culprit, exit_call

#: the least a check may be given (seconds); the kit's default is ``runner.DEFAULT_TIMEOUT_S``
MIN_TIMEOUT_S = 1.0


class CheckTimeout(BaseException):
    """Raised into a check that ran past its timeout (a BaseException: plugins must not catch it)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no result after {seconds:g} s")
        self.seconds = seconds


def describe(exc: BaseException) -> str:
    """One line for a check that ended with ``exc`` (not a :class:`Failed` or :class:`Skipped`)."""
    if isinstance(exc, SystemExit):
        return (
            f"{exit_call(exc)} was called ({culprit(exc)}): plugin code must raise an exception, never "
            "end the process"
        )
    if isinstance(exc, KeyboardInterrupt):
        return f"KeyboardInterrupt raised by plugin code, not by the user ({culprit(exc)})"
    if isinstance(exc, CheckTimeout):
        return f"timed out: {exc} ({culprit(exc)}); a hook may hang"
    return f"{type(exc).__name__}: {exc} ({culprit(exc)})"


class _Guard:
    """Per-process state of :func:`guarded`: whether the user pressed Ctrl-C."""

    interrupted = False


def user_interrupted(exc: BaseException) -> bool:
    """``exc`` is the user's Ctrl-C (seen by :func:`guarded`'s handler), to be let through."""
    return isinstance(exc, KeyboardInterrupt) and _Guard.interrupted


@contextmanager
def guarded(timeout: float | None) -> Iterator[None]:
    """Run one check here: the user's Ctrl-C is marked as theirs, and after ``timeout`` seconds
    :class:`CheckTimeout` is raised into it (main thread only; elsewhere neither applies, and a
    KeyboardInterrupt there can only come from code)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _Guard.interrupted = False

    def on_sigint(signum: int, frame: Any) -> None:
        _Guard.interrupted = True
        raise KeyboardInterrupt

    def on_alarm(signum: int, frame: Any) -> None:
        raise CheckTimeout(float(timeout or 0))

    previous_int = signal.signal(signal.SIGINT, on_sigint)
    timer = (
        timeout is not None and hasattr(signal, "SIGALRM") and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )
    previous_alarm = signal.signal(signal.SIGALRM, on_alarm) if timer else None
    if timer:
        signal.setitimer(signal.ITIMER_REAL, float(timeout))  # type: ignore[arg-type]
    try:
        yield
    finally:
        if timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_alarm)
        signal.signal(signal.SIGINT, previous_int)
