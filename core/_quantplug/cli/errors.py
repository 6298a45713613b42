"""The command line's own exceptions: bad input from the user (printed as one line, exit status
2), and a signal that stops the run (exit status 128 + its number)."""

from __future__ import annotations


class InputError(Exception):
    """Bad input from the user: the CLI prints the message as one line and exits 2."""


class Terminated(BaseException):
    """SIGTERM/SIGHUP as an exception, so the run cleans up (a BaseException: nothing swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
