"""What a check is and how it ends, without the checks: the command's process (which only
starts the kit's own, ``isolated``) reads the table of checks without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _quantplug.conformance.checks.session import Session


class Failed(Exception):
    """The backend does not do what the check verifies; the message says what and where."""


class Skipped(Exception):
    """The check does not apply (a capability the backend declares unsupported, say)."""


@dataclass(frozen=True)
class Check:
    """One check: its name, what it verifies, the capabilities it needs, how to run a case."""

    name: str
    title: str
    run: Callable[[Session, str], str]
    requires: tuple[str, ...] = ()
    cases: Callable[[Session], list[str]] | None = None

    def case_ids(self, session: Session) -> list[str]:
        return self.cases(session) if self.cases is not None else [""]
