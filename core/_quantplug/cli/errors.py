"""The command line's own error: bad input from the user (printed as one line, exit status 2)."""

from __future__ import annotations


class InputError(Exception):
    """Bad input from the user: the CLI prints the message as one line and exits 2."""
