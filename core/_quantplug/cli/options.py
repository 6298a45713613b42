"""``--option key=value``: parsing, and the per-backend option listing shown by
``quantplug quantize --help``, read from the backends' metadata files (no plugin is imported)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from _quantplug.cli.errors import InputError
from _quantplug.plugins.contract import COMMON_OPTIONS, BackendOption


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


def describe_option(option: BackendOption) -> str:
    default = option.default
    default = (
        "none" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
    )
    text = f"{option.name}={getattr(option.type, '__name__', option.type)} (default {default})"
    if option.help:
        text += f": {option.help}"
    if option.choices:
        text += "; one of " + ", ".join(map(str, option.choices))
    if option.valid_range():
        text += f"; {option.valid_range()}"
    for other, allowed in option.applies_with.items():
        text += f"; only with {other}=" + "|".join(map(str, allowed))
    return text


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(
        text,
        width=100,
        initial_indent="    ",
        subsequent_indent="        ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def backends_epilog() -> str:
    """Every installed backend with its options, from metadata files (imports no plugin)."""
    from _quantplug.plugins.metadata import MetadataError
    from _quantplug.plugins.registry import declared_info, list_backends

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
            info = declared_info(entry.name)
        except MetadataError as exc:
            lines.append(f"  {entry.name}{dist}: unreadable metadata ({exc})")
            continue
        if info is None:
            lines.append(
                f"  {entry.name}{dist}: its plugin declares no options metadata; "
                "`quantplug backends --check` imports it and lists them"
            )
            continue
        lines.append(f"  {entry.name}{dist}: {info.description}")
        for option in info.options:
            lines.extend(_wrapped(describe_option(option)))
    lines.append("  every backend: " + "; ".join(describe_option(o) for o in COMMON_OPTIONS))
    return "\n".join(lines)
