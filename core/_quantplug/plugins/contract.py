"""The values plugin hooks return: plain, frozen data the core can check and print.

This module imports no torch (``op_name`` imports it when called): a backend's options are
checked, listed and suggested by the command line before torch is imported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from _quantplug.errors import OptionError
from _quantplug.graph.op_names import op_name
from _quantplug.suggest import did_you_mean

if TYPE_CHECKING:
    import torch

    from _quantplug.lowering.artifact import Artifact
    from _quantplug.quantizer.context import BackendContext

_MISSING: Any = object()

#: the option value types a backend may declare, by the name metadata files use
OPTION_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}


def _number_text(value: float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


@dataclass(frozen=True)
class BackendOption:
    """One option a backend accepts in ``get_quantizer(name, **options)``.

    ``type`` is one of bool/int/float/str (``None`` allowed when ``default`` is None); the rest
    declares which values make sense, so every backend gets the same checks and messages for
    free, before anything runs (and, through the backend's metadata file, before its plugin is
    imported: see :mod:`_quantplug.plugins.metadata`):

    * ``choices``: the only valid values;
    * ``minimum`` / ``maximum`` (inclusive) and ``exclusive_minimum`` (the value must exceed
      it) for numbers; ``finite`` (the default) rejects NaN and infinities of a float option;
    * ``applies_with``: ``{"precision": ("16a4w_block",)}``: the option may only be given when
      each named option has one of those values (it means nothing otherwise);
    * ``check``: code for what the rest cannot say, returning the reason a value is invalid
      (or None); it runs in ``get_quantizer`` only, as it needs the plugin imported.
    """

    name: str
    type: type
    default: Any = None
    help: str = ""
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    finite: bool = True
    applies_with: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    check: Callable[[Any], str | None] | None = field(default=None, compare=False)

    def __hash__(self) -> int:  # applies_with is a dict: hash what identifies the option
        return hash((self.name, self.type))

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
                f"option {self.name!r} of backend {backend!r} got {value!r}"
                f"{did_you_mean(value, self.choices)}; valid values: " + ", ".join(map(str, self.choices))
            )
        reason = self._range_problem(value)
        if reason is None and self.check is not None:
            reason = self.check(value)
        if reason is not None:
            raise OptionError(f"option {self.name!r} of backend {backend!r} got {value!r}: {reason}")
        return value

    def valid_range(self) -> str:
        """The declared range in words (``"a number >= 0 and <= 65536"``), or an empty string."""
        parts = []
        if self.exclusive_minimum is not None:
            parts.append(f"> {_number_text(self.exclusive_minimum)}")
        if self.minimum is not None:
            parts.append(f">= {_number_text(self.minimum)}")
        if self.maximum is not None:
            parts.append(f"<= {_number_text(self.maximum)}")
        if self.type is float and self.finite:
            parts.insert(0, "finite")
        return " and ".join(parts)

    def _range_problem(self, value: Any) -> str | None:
        if self.type not in (int, float) or isinstance(value, bool):
            return None
        bad = (
            (self.type is float and self.finite and not math.isfinite(value))
            or (self.exclusive_minimum is not None and not value > self.exclusive_minimum)
            or (self.minimum is not None and not value >= self.minimum)
            or (self.maximum is not None and not value <= self.maximum)
        )
        return f"it must be {self.valid_range()}" if bad else None


#: accepted by every backend, resolved like a declared bool option (text "false"/"off"/"0" works),
#: and never one of a backend's own options: hooks read it as ``context.strict``
STRICT_OPTION = BackendOption(
    "strict", bool, True, "raise ConstraintViolationError on constraint violations (false: only warn)"
)
#: the options every backend accepts besides its own
COMMON_OPTIONS = (STRICT_OPTION,)
COMMON_OPTION_NAMES = frozenset(o.name for o in COMMON_OPTIONS)


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
    #: the bool option that selects the quantization-aware-training variant of the configs, if
    #: any: ``prepare(..., qat=...)`` must agree with it.
    qat_option: str | None = None
    #: the plugin API version the backend was written against (``"1.1"``): a quantplug that does
    #: not provide it (an older minor version, another major one) refuses to load the backend,
    #: naming the version to install. None: any 1.x.
    requires_api: str | None = None

    def option(self, name: str) -> BackendOption | None:
        return next((o for o in self.options if o.name == name), None)

    def resolve_options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults filled in, unknown names and bad values rejected with the valid alternatives."""
        known = {o.name: o for o in self.options}
        unknown = sorted(set(given) - set(known))
        if unknown:
            hint = did_you_mean(unknown[0], known) if len(unknown) == 1 else ""
            raise OptionError(
                f"backend {self.name!r} has no option(s) {', '.join(map(repr, unknown))}{hint}; "
                "valid options: " + (", ".join(sorted(known)) or "none")
            )
        resolved = {}
        for name, opt in known.items():
            value = given.get(name, opt.default)
            resolved[name] = opt.coerce(value, backend=self.name) if name in given else value
        if self.preset_option is not None:
            preset = resolved.get(self.preset_option)
            names = [p.name for p in self.presets]
            if preset is not None and preset not in names:
                raise OptionError(
                    f"backend {self.name!r} has no {self.preset_option} {preset!r}"
                    f"{did_you_mean(preset, names)}; valid values: " + ", ".join(names)
                )
        for name in given:
            self._check_applies(known[name], resolved, given[name])
        return resolved

    def _check_applies(self, option: BackendOption, resolved: Mapping[str, Any], value: Any) -> None:
        if value is None:
            return
        for other, allowed in option.applies_with.items():
            if resolved.get(other) not in allowed:
                wanted = " or ".join(map(str, allowed))
                raise OptionError(
                    f"option {option.name!r} of backend {self.name!r} applies only when {other} is "
                    f"{wanted} (got {other}={resolved.get(other)!r}); drop {option.name} or set "
                    f"{other}={allowed[0]}"
                )


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
GraphPass = Callable[["torch.fx.GraphModule", "BackendContext"], "torch.fx.GraphModule | None"]


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
