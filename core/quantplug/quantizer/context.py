"""The context every backend hook receives: which backend, with which options."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BackendContext:
    """Backend name, resolved options and a scratch dict a plugin may fill once and reuse.

    ``state`` exists so a plugin can derive something expensive from the options (an SoC's
    architecture, a parsed SDK table) on first use instead of in every hook call.
    """

    backend: str
    options: Mapping[str, Any]
    state: dict[str, Any] = field(default_factory=dict)
    #: the quantizer's ``strict``: hooks that find something the hardware cannot run (a
    #: constraint violation, an incomplete artifact) raise when True and warn when False
    strict: bool = True

    def option(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)
