"""``--option key=value``: parsing, checking against a backend's declared options, and the
per-backend option listing shown by ``quantplug quantize --help``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quantplug.cli.inputs import InputError

#: accepted by every backend (see quantplug.get_quantizer)
COMMON_OPTIONS = (("strict", "bool", "true", "fail on backend constraint violations (false: only warn)"),)


def parse_pairs(pairs: Sequence[str]) -> dict[str, str]:
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(f"--option expects key=value, got {pair!r}")
        if key in options:
            raise InputError(f"--option {key} given twice")
        options[key] = value.strip()
    return options


def _type_name(option: Any) -> str:
    return getattr(option.type, "__name__", str(option.type))


def describe_option(option: Any) -> str:
    default = option.default
    default = (
        "none" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
    )
    text = f"{option.name}={_type_name(option)} (default {default})"
    if option.help:
        text += f": {option.help}"
    if option.choices:
        text += "; one of " + ", ".join(map(str, option.choices))
    return text


def backends_epilog() -> str:
    """Every installed backend with its options; imports the plugins (only used by --help)."""
    import textwrap

    from quantplug.errors import QuantplugError
    from quantplug.plugins.registry import list_backends, load_backend

    lines = ["backend options (--option KEY=VALUE):"]
    entries = list_backends()
    if not entries:
        lines.append("  no backends installed (pip install quantplug-reference)")
    for entry in entries:
        dist = f" ({entry.distribution} {entry.version})" if entry.distribution else ""
        if entry.status in ("disabled", "conflict"):
            lines.append(f"  {entry.name}{dist}: {entry.status}")
            continue
        try:
            info = load_backend(entry.name).info
        except QuantplugError as exc:
            lines.append(f"  {entry.name}{dist}: cannot load: {str(exc).splitlines()[0]}")
            continue
        lines.append(f"  {entry.name}{dist}: {info.description}")
        for option in info.options:
            lines.extend(
                textwrap.wrap(
                    describe_option(option),
                    width=100,
                    initial_indent="    ",
                    subsequent_indent="        ",
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
    lines.append(
        "  every backend: " + "; ".join(f"{n}={t} (default {d}): {h}" for n, t, d, h in COMMON_OPTIONS)
    )
    return "\n".join(lines)
