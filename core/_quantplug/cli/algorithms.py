"""``quantplug algorithms`` and the ``--algorithm`` / ``--algorithm-option`` arguments of ``quantize``.

Everything here reads the algorithms' metadata (entry points and ``<name>.algorithm.json``): a
listing, a help screen or a misspelt name or option answers without importing torch or any
algorithm. ``quantize`` imports the algorithms once its arguments are checked.

``--algorithm-option NAME.KEY=VALUE`` sets an option of algorithm NAME; ``KEY=VALUE`` is enough
when a single ``--algorithm`` is given.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from _quantplug.algorithms.option_checks import bounds_text, option_from_metadata, option_values
from _quantplug.cli.checks import check_calibration_path
from _quantplug.cli.errors import InputError
from _quantplug.plugins.contract import OPTION_TYPES
from _quantplug.suggest import did_you_mean


def add_parser(sub: Any, add_common: Callable[..., None]) -> None:
    p = sub.add_parser(
        "algorithms",
        help="list installed accuracy algorithms",
        description="List accuracy algorithms (entry-point group quantplug.algorithms) with their options, "
        "from metadata only (nothing is imported). Use them with `quantplug quantize --algorithm NAME`.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_common(p, sub=True)
    p.set_defaults(func=run)


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-A",
        "--algorithm",
        action="append",
        default=[],
        metavar="NAME",
        help="accuracy algorithm, repeatable, applied in order (e.g. -A cle -A bias_correction); "
        "`quantplug algorithms` lists them",
    )
    p.add_argument(
        "--algorithm-option",
        action="append",
        default=[],
        metavar="[NAME.]KEY=VALUE",
        help="an algorithm's option, repeatable (NAME. may be left out with a single --algorithm)",
    )
    p.add_argument(
        "--no-algorithm-guard",
        dest="algorithm_guard",
        action="store_false",
        help="keep every weight choice of the algorithms, even where the model's output on the first "
        "calibration batches is worse than with round-to-nearest (by default such a layer keeps "
        "round-to-nearest)",
    )
    p.add_argument(
        "--held-out",
        metavar="PATH",
        help="batches not calibrated on (the --calibration formats; the first 8 are used) for the "
        "algorithm guard to judge the algorithms' choices on, instead of the calibration batches "
        "they were fitted to: a choice that only fits the calibration data is refused",
    )


def run(args: argparse.Namespace, console: Any) -> int:
    from _quantplug.algorithms.registry import list_algorithms

    rows = [
        {
            "name": e.name,
            "distribution": e.distribution,
            "version": e.version,
            "source": e.source,
            "description": e.description,
            "paper": e.paper,
            "options": [dict(o) for o in e.options],
        }
        for e in list_algorithms()
    ]
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if not rows:
        print("no quantplug algorithms installed")
        return 0
    print(algorithms_help(rows))
    return 0


def algorithms_help(rows: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The installed algorithms and their options, as ``quantplug algorithms`` and ``--help`` show them."""
    if rows is None:
        from _quantplug.algorithms.registry import list_algorithms

        rows = [
            {"name": e.name, "description": e.description, "paper": e.paper, "options": e.options}
            for e in list_algorithms()
        ]
    lines = []
    for row in rows:
        lines.append(f"  {row['name']}: {row['description'] or '(no description)'}")
        if row.get("paper"):
            lines.append(f"      paper: {row['paper']}")
        for option in row.get("options", ()):
            shown = f"{option['name']} ({option['type']}, default {option['default']!r})"
            if option.get("choices"):
                shown += f" one of {', '.join(map(str, option['choices']))}"
            if option.get("minimum") is not None or option.get("maximum") is not None:
                shown += f" {bounds_text(option.get('minimum'), option.get('maximum'))}"
            text = f"{shown}: {option.get('help', '')}"
            lines.extend(textwrap.wrap(text, 100, initial_indent="      ", subsequent_indent="        "))
    return "\n".join(lines)


def check_algorithm_arguments(args: argparse.Namespace) -> list[tuple[str, dict[str, str]]]:
    """``(name, {option: value})`` per ``--algorithm``, checked against metadata (no import).

    Unknown names and options get "did you mean"; values are checked against the declared type,
    choices and bounds when the algorithm ships metadata (otherwise when it is loaded).
    """
    names: list[str] = list(getattr(args, "algorithm", []) or [])
    raw: list[str] = list(getattr(args, "algorithm_option", []) or [])
    if getattr(args, "held_out", None) is not None:
        if not names:
            raise InputError("--held-out is what the algorithm guard judges on; give --algorithm NAME too")
        if not getattr(args, "algorithm_guard", True):
            raise InputError(
                "--held-out is what the algorithm guard judges on, and --no-algorithm-guard turns the "
                "guard off; give one or the other"
            )
        check_calibration_path(args.held_out, "held-out data")
    if not names:
        if raw:
            raise InputError("--algorithm-option given without --algorithm NAME")
        return []
    from _quantplug.algorithms.registry import list_algorithms

    entries = {e.name: e for e in list_algorithms()}
    for name in names:
        if name not in entries:
            listed = ", ".join(sorted(entries)) or "none"
            raise InputError(f"unknown algorithm {name!r}{did_you_mean(name, entries)}; installed: {listed}")
    if len(set(names)) != len(names):
        raise InputError(f"--algorithm repeats a name: {', '.join(names)}; give each algorithm once")
    options: dict[str, dict[str, str]] = {name: {} for name in names}
    for item in raw:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"--algorithm-option {item!r} is not [NAME.]KEY=VALUE")
        owner, dot, option = key.rpartition(".")
        if not dot:
            if len(names) > 1:
                raise InputError(
                    f"--algorithm-option {item!r}: with several --algorithm, name the algorithm "
                    f"({', '.join(n + '.' + key for n in names)})"
                )
            owner = names[0]
        if owner not in options:
            raise InputError(
                f"--algorithm-option {item!r} names algorithm {owner!r}{did_you_mean(owner, names)}, "
                f"which is not among --algorithm {', '.join(names)}"
            )
        declared = {str(o["name"]): o for o in entries[owner].options}
        if declared:
            if option not in declared:
                raise InputError(
                    f"algorithm {owner!r} has no option {option!r}{did_you_mean(option, declared)}; "
                    f"its options: {', '.join(sorted(declared))}"
                )
            _check_value(owner, declared[option], value)
        options[owner][option] = value
    return [(name, options[name]) for name in names]


def _check_value(algorithm: str, option: Mapping[str, Any], value: str) -> None:
    """``value`` (text) checked as building the algorithm will check it, from its metadata (an
    option of a kind quantplug does not know is left to the algorithm)."""
    if option.get("type") in OPTION_TYPES:
        option_values(algorithm, (option_from_metadata(option),), {str(option["name"]): value})
