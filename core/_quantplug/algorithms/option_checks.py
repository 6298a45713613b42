"""An algorithm's options: their declaration, and the checks it implies, shared by the algorithm
(when it is built) and the command line (from its metadata file, before anything heavy is imported).

Torch-free on purpose: ``quantplug quantize --algorithm-option gptq.damp=nan`` must fail in the
argument check, with the message building the algorithm would give.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from _quantplug.errors import OptionError
from _quantplug.plugins.contract import OPTION_TYPES
from _quantplug.suggest import did_you_mean


@dataclass(frozen=True)
class AlgorithmOption:
    """One option of an algorithm (a constructor keyword), described for listings and the CLI."""

    name: str
    type: str  # one of OPTION_TYPES
    default: Any
    help: str = ""
    choices: tuple[Any, ...] | None = None
    #: the least and the greatest value an ``int``/``float`` option accepts (None: unbounded).
    #: Checked with the type (:func:`range_problem`; a ``float`` must also be finite) before the
    #: algorithm is built, so a value that would fail deep in its arithmetic (a negative damping,
    #: no sampled rows) is an ``OptionError`` naming the option.
    minimum: float | None = None
    maximum: float | None = None


def option_metadata(option: AlgorithmOption) -> dict[str, Any]:
    """The option as its algorithm's metadata file holds it (``<name>.algorithm.json``)."""
    return {
        "name": option.name,
        "type": option.type,
        "default": option.default,
        "help": option.help,
        "choices": list(option.choices) if option.choices is not None else None,
        "minimum": getattr(option, "minimum", None),
        "maximum": getattr(option, "maximum", None),
    }


def option_from_metadata(described: Mapping[str, Any]) -> AlgorithmOption:
    """The option a metadata file describes (:func:`option_metadata` read back)."""
    choices = described.get("choices")
    return AlgorithmOption(
        name=str(described["name"]),
        type=str(described["type"]),
        default=described.get("default"),
        help=str(described.get("help", "")),
        choices=tuple(choices) if choices is not None else None,
        minimum=described.get("minimum"),
        maximum=described.get("maximum"),
    )


def option_values(
    algorithm: str, declared: Sequence[AlgorithmOption], given: Mapping[str, Any]
) -> dict[str, Any]:
    """``given`` checked against ``declared`` and completed with defaults (strings converted).

    Command-line values arrive as strings; they are converted to the declared type. Unknown
    names, wrong types and values outside ``choices`` raise :class:`~_quantplug.errors.OptionError`.
    """
    by_name = {o.name: o for o in declared}
    values = {o.name: o.default for o in declared}
    for key, raw in given.items():
        option = by_name.get(key)
        if option is None:
            known = ", ".join(sorted(by_name)) or "none"
            raise OptionError(
                f"algorithm {algorithm!r} has no option {key!r}{did_you_mean(key, by_name)}; "
                f"its options: {known}"
            )
        values[key] = _convert_option(algorithm, option, raw)
    return values


def _convert_option(algorithm: str, option: AlgorithmOption, raw: Any) -> Any:
    kind = OPTION_TYPES[option.type]
    value = raw
    try:
        if isinstance(raw, str) and kind is not str:
            if kind is bool:
                lowered = raw.strip().lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(raw)
                value = lowered in ("true", "1", "yes")
            else:
                value = kind(raw)
        elif kind is float and isinstance(raw, int) and not isinstance(raw, bool):
            value = float(raw)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(raw)
    except ValueError:
        raise OptionError(
            f"option {option.name!r} of algorithm {algorithm!r} must be a {option.type}, got {raw!r}"
        ) from None
    if option.choices is not None and value not in option.choices:
        raise OptionError(
            f"option {option.name!r} of algorithm {algorithm!r} must be one of "
            f"{', '.join(map(repr, option.choices))}, got {value!r}"
        )
    problem = range_problem(option.type, value, option.minimum, option.maximum)
    if problem is not None:
        raise OptionError(f"option {option.name!r} of algorithm {algorithm!r} must {problem}, got {raw!r}")
    return value


def range_problem(type_name: str, value: object, minimum: float | None, maximum: float | None) -> str | None:
    """What is wrong with ``value`` for an option of ``type_name`` bounded by ``minimum``/``maximum``
    (inclusive; None: unbounded), as the end of "option 'x' of algorithm 'y' must ...", or None.

    A float must be finite whatever its bounds: NaN passes every comparison, and an infinite
    damping or rate is never what was meant.
    """
    if type_name not in ("int", "float") or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if type_name == "float" and not math.isfinite(value):
        return "be a finite number"
    low = -math.inf if minimum is None else minimum
    high = math.inf if maximum is None else maximum
    return None if low <= value <= high else f"be {bounds_text(minimum, maximum)}"


def bounds_text(minimum: float | None, maximum: float | None) -> str:
    """``>= 1``, ``<= 16``, ``in [1, 16]`` (or "" unbounded): for messages and listings."""
    if minimum is None and maximum is None:
        return ""
    if maximum is None:
        return f">= {minimum:g}"
    if minimum is None:
        return f"<= {maximum:g}"
    return f"in [{minimum:g}, {maximum:g}]"
