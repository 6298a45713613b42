"""The context every backend hook receives: which backend, with which options."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from _quantplug.errors import QuantplugError

if TYPE_CHECKING:
    from torch.fx import Node

    from _quantplug.annotation.specs import QuantizationConfig


def _warn_strict_in_options() -> None:
    warnings.warn(
        "'strict' is not one of a backend's options since quantplug 0.2.0: read context.strict "
        "(or quantizer.strict); options['strict'] works until quantplug 0.4.0",
        DeprecationWarning,
        stacklevel=3,
    )


class BackendOptions(dict):  # type: ignore[type-arg]
    """A backend's resolved options: exactly the options it declares, defaults filled in.

    In quantplug 0.1.0 the dict also held the core's ``strict``. Code written then keeps working
    until 0.4.0, with a ``DeprecationWarning``: ``options["strict"]`` and ``options.get("strict")``
    read the quantizer's ``strict``, and a comparison with a dict that holds ``strict`` compares
    as the 0.1.0 dict did. Iterating, ``len`` and ``"strict" in options`` see only the backend's
    own options.
    """

    def __init__(self, options: Mapping[str, Any] = (), *, strict: bool = True) -> None:  # type: ignore[assignment]
        super().__init__(options)
        self.strict = strict

    def __missing__(self, key: str) -> Any:
        if key == "strict":
            _warn_strict_in_options()
            return self.strict
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key == "strict" and not dict.__contains__(self, key):
            _warn_strict_in_options()
            return self.strict
        return super().get(key, default)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping) and "strict" in other and not dict.__contains__(self, "strict"):
            _warn_strict_in_options()
            return {**self, "strict": self.strict} == dict(other)
        return dict.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def copy(self) -> BackendOptions:
        return BackendOptions(self, strict=self.strict)


@dataclass
class BackendContext:
    """Backend name, resolved options, ``strict``, and a scratch dict a plugin may fill once.

    ``options`` holds exactly the options the backend declares (user values coerced, defaults
    filled in). ``strict`` is the core's: True unless the user passed ``strict=False``, so a
    lowering-time check can raise in strict mode and warn otherwise
    (``report.enforce(context.strict)``). ``state`` exists so a plugin can derive something
    expensive from the options (an SoC's architecture, a parsed SDK table) on first use instead
    of in every hook call.
    """

    backend: str
    options: Mapping[str, Any]
    state: dict[str, Any] = field(default_factory=dict)
    strict: bool = True
    _config_of: Callable[[Node], QuantizationConfig | None] | None = field(
        default=None, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.options, BackendOptions):
            own = {k: v for k, v in self.options.items() if k != "strict"}
            self.strict = bool(self.options.get("strict", self.strict))
            self.options = BackendOptions(own, strict=self.strict)

    def option(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)

    def config_for(self, node: Node) -> QuantizationConfig | None:
        """The config the user's overrides select for any ``node`` (None: the user keeps it float).

        Lets a rule look at a neighbour: a conv rule can see that the relu after it was set to
        float. The answer is the user's selection; whether the backend has a rule for that node's
        op is a separate question (``quantizer.rules.ops``).
        """
        if self._config_of is None:
            raise QuantplugError("config_for() needs the context of a Quantizer (quantplug.get_quantizer)")
        return self._config_of(node)

    def bind_configs(self, config_of: Callable[[Node], QuantizationConfig | None]) -> None:
        """Called by the Quantizer that owns this context."""
        self._config_of = config_of
