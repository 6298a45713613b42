"""The context every backend hook receives: which backend, with which options."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.fx import Node

    from _quantplug.annotation.specs import QuantizationConfig


@dataclass
class BackendContext:
    """Backend name, resolved options and a scratch dict a plugin may fill once and reuse.

    ``options`` holds every declared option (user values coerced, defaults filled in) plus the
    reserved ``strict`` (bool), so a lowering-time check can raise in strict mode and warn
    otherwise (``report.enforce(context.option("strict"))``). ``state`` exists so a plugin can
    derive something expensive from the options (an SoC's architecture, a parsed SDK table) on
    first use instead of in every hook call.
    """

    backend: str
    options: Mapping[str, Any]
    state: dict[str, Any] = field(default_factory=dict)
    _config_of: Callable[[Node], QuantizationConfig | None] | None = field(
        default=None, repr=False, compare=False
    )

    def option(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)

    @property
    def strict(self) -> bool:
        """``strict`` as the user resolved it (True unless they passed ``strict=False``)."""
        return bool(self.options.get("strict", True))

    def config_for(self, node: Node) -> QuantizationConfig | None:
        """The config the user's overrides select for any ``node`` (None: the user keeps it float).

        Lets a rule look at a neighbour: a conv rule can see that the relu after it was set to
        float. The answer is the user's selection; whether the backend has a rule for that node's
        op is a separate question (``quantizer.rules.ops``).
        """
        if self._config_of is None:
            from _quantplug.errors import QuantplugError

            raise QuantplugError("config_for() needs the context of a Quantizer (quantplug.get_quantizer)")
        return self._config_of(node)

    def bind_configs(self, config_of: Callable[[Node], QuantizationConfig | None]) -> None:
        """Called by the Quantizer that owns this context."""
        self._config_of = config_of
