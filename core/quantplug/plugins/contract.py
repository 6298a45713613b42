"""The values plugin hooks return: plain, frozen data the core can check and print."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from quantplug.errors import OptionError

if TYPE_CHECKING:
    from quantplug.lowering.artifact import Artifact
    from quantplug.quantizer.context import BackendContext

_MISSING: Any = object()


@dataclass(frozen=True)
class BackendOption:
    """One option a backend accepts in ``get_quantizer(name, **options)``.

    ``type`` is one of bool/int/float/str (``None`` allowed when ``default`` is None);
    ``choices`` restricts the values; ``parse`` lets a CLI turn ``key=value`` text into the value.
    """

    name: str
    type: type
    default: Any = None
    help: str = ""
    choices: tuple[Any, ...] | None = None

    def coerce(self, value: Any, *, backend: str) -> Any:
        """Check (and, for text from a command line, convert) one value."""
        if value is None and self.default is None:
            return None
        if isinstance(value, str) and self.type is not str:
            value = _parse_text(value, self.type, backend=backend, option=self.name)
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.type) or (self.type is int and isinstance(value, bool)):
            raise OptionError(
                f"option {self.name!r} of backend {backend!r} must be {self.type.__name__}, "
                f"got {value!r} ({type(value).__name__})"
            )
        if self.choices is not None and value not in self.choices:
            raise OptionError(
                f"option {self.name!r} of backend {backend!r} got {value!r}; valid values: "
                + ", ".join(map(str, self.choices))
            )
        return value


def _parse_text(text: str, typ: type, *, backend: str, option: str) -> Any:
    try:
        if typ is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        return typ(text)
    except ValueError:
        raise OptionError(
            f"option {option!r} of backend {backend!r} must be {typ.__name__}, got {text!r}"
        ) from None


@dataclass(frozen=True)
class Preset:
    """A named precision/config recipe, e.g. ``"8a8w"`` or ``"int8"``."""

    name: str
    description: str = ""


@dataclass(frozen=True)
class BackendInfo:
    """What a backend is and which options and presets it accepts."""

    name: str
    description: str
    options: tuple[BackendOption, ...] = ()
    presets: tuple[Preset, ...] = ()
    #: the option that selects a preset (``"preset"``, ``"precision"``...); its values are checked
    #: against ``presets``.
    preset_option: str | None = None

    def option(self, name: str) -> BackendOption | None:
        return next((o for o in self.options if o.name == name), None)

    def resolve_options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults filled in, unknown names and bad values rejected with the valid alternatives."""
        known = {o.name: o for o in self.options}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise OptionError(
                f"backend {self.name!r} has no option(s) {', '.join(map(repr, unknown))}; valid options: "
                + (", ".join(sorted(known)) or "none")
            )
        resolved = {}
        for name, opt in known.items():
            value = given.get(name, opt.default)
            resolved[name] = opt.coerce(value, backend=self.name) if name in given else value
        if self.preset_option is not None:
            preset = resolved.get(self.preset_option)
            if preset is not None and preset not in {p.name for p in self.presets}:
                raise OptionError(
                    f"backend {self.name!r} has no {self.preset_option} {preset!r}; valid values: "
                    + ", ".join(p.name for p in self.presets)
                )
        return resolved


def op_name(op: Any) -> str:
    """Canonical text of an op target: ``"aten.conv2d.default"``, or a function's qualified name."""
    if isinstance(op, str):
        return op
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(op)
    name = getattr(op, "__name__", None)
    module = getattr(op, "__module__", None)
    if name is not None and module is not None:
        return f"{module}.{name}"
    return str(op)


@dataclass(frozen=True)
class RulesModule:
    """A module of annotation rules and the ops it covers.

    The core imports ``module`` only when a graph contains one of ``ops`` (canonical op names as
    produced by :func:`op_name`), so a backend with hundreds of rules costs nothing until used.
    """

    module: str
    ops: frozenset[str]

    def __init__(self, module: str, ops: Sequence[Any]) -> None:
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "ops", frozenset(op_name(o) for o in ops))


#: A graph pass: takes the GraphModule (and the backend context), returns it or a replacement.
GraphPass = Callable[[torch.fx.GraphModule, "BackendContext"], "torch.fx.GraphModule | None"]


@dataclass(frozen=True)
class NamedPass:
    """A graph pass with a name for logs and error messages."""

    name: str
    fn: GraphPass


@dataclass(frozen=True)
class LoweringPlan:
    """How a backend turns a quantized program into files: ordered passes, then a writer."""

    passes: tuple[NamedPass, ...] = ()
    writer: Callable[[torch.fx.GraphModule, BackendContext], Artifact] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
