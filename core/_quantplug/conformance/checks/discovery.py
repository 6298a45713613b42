"""How users find and configure a backend: listed without importing it, options resolved or
rejected with typed errors.
"""

from __future__ import annotations

import sys
from typing import Any

import quantplug
from _quantplug.conformance.checks.session import FRESH_PROBE, Failed, Session
from _quantplug.errors import OptionError
from _quantplug.plugins.contract import OPTION_TYPES, BackendInfo, BackendOption
from _quantplug.plugins.registry import load_backend
from _quantplug.quantizer.quantizer import Quantizer


def check_listed(session: Session, case: str) -> str:
    entry = session.entry
    if entry is None:
        raise Failed(f"list_backends() does not list {session.name!r}")
    if entry.status in ("error", "conflict", "disabled"):
        raise Failed(
            f"list_backends() shows {session.name!r} with status {entry.status!r}: {entry.error or ''}"
        )
    if entry.source == "entry-point":
        found = session.as_installed()
        problems = []
        if not found["listed"]:
            problems.append("not listed in a fresh interpreter")
        if found["imported_by_listing"]:
            problems.append("list_backends() imported " + ", ".join(found["imported_by_listing"]))
        if found["rules_imported"]:
            problems.append("get_quantizer() imported rules modules " + ", ".join(found["rules_imported"]))
        if found["others_imported"]:
            problems.append(
                "get_quantizer() imported modules of other backends " + ", ".join(found["others_imported"])
            )
        if not entry.version:
            problems.append(f"distribution {entry.distribution!r} has no version")
        if problems:
            raise Failed("; ".join(problems))
        return (
            f"listed from {entry.distribution} {entry.version} without importing it; get_quantizer() imports "
            "no rules module and nothing of other backends"
        )
    # in-process: listing imports nothing by construction; rules must still load lazily
    rules = [m.module for m in session.quantizer().rules.modules]
    saved = {m: sys.modules.pop(m) for m in rules if m in sys.modules}
    try:
        session.quantizer()
        eager = [m for m in rules if m in sys.modules]
    finally:
        for m in rules:
            sys.modules.pop(m, None)
        sys.modules.update(saved)
    if eager:
        raise Failed(
            "get_quantizer() imported rules modules " + ", ".join(eager) + " (import them only in rules)"
        )
    return "listed (in-process); get_quantizer() imports no rules module"


#: 0.1.0's name of the fresh interpreter's script (now shared with ``untouched``: it also reports
#: the process-wide state importing the plugin changes)
PROBE = FRESH_PROBE


def check_options(session: Session, case: str) -> str:
    info = load_backend(session.name).info
    problems: list[str] = []
    tried = 0

    def attempt(options: dict[str, Any], *, expect_error: bool, what: str) -> Quantizer | None:
        nonlocal tried
        tried += 1
        try:
            q = quantplug.get_quantizer(session.name, **options)
        except OptionError as exc:
            if not expect_error:
                problems.append(f"{what}: rejected ({exc})")
            return None
        except Exception as exc:
            problems.append(f"{what}: raised {type(exc).__name__} ({exc}) instead of OptionError")
            return None
        if expect_error:
            problems.append(f"{what}: accepted, expected an OptionError")
        return q

    for o in info.options:
        if o.type not in OPTION_TYPES.values():
            problems.append(f"option {o.name!r}: type {o.type!r} is not {' or '.join(OPTION_TYPES)}")
            continue
        if o.default is not None and not _is_type(o.default, o.type):
            problems.append(f"option {o.name!r}: default {o.default!r} is not a {o.type.__name__}")
        if o.choices is not None and o.default is not None and o.default not in o.choices:
            problems.append(f"option {o.name!r}: default {o.default!r} is not one of its choices")
    if info.preset_option is not None:
        preset = info.option(info.preset_option)
        if preset is None:
            problems.append(f"preset_option {info.preset_option!r} is not a declared option")
        elif preset.default is not None and preset.default not in {p.name for p in info.presets}:
            problems.append(f"the default {info.preset_option} {preset.default!r} is not a preset")
    attempt({}, expect_error=False, what="the defaults")
    unknown = "conformance_no_such_option"
    attempt({unknown: 1}, expect_error=True, what=f"an unknown option {unknown!r}")
    for o in info.options:
        if o.type not in OPTION_TYPES.values():
            continue
        # an option that applies only with others set (``applies_with``) is tried in that company
        company = {other: allowed[0] for other, allowed in o.applies_with.items() if allowed}
        if company:
            outside = _outside_company(info, o)
            if outside is not None:
                example = o.default if o.default is not None else (o.choices or [True])[0]
                # any value given outside its company is refused, even a valid one
                attempt(
                    {o.name: example, **outside},
                    expect_error=True,
                    what=f"{o.name} with {', '.join(f'{k}={v!r}' for k, v in outside.items())}",
                )
        if o.type is not str:
            attempt(
                {o.name: f"not-a-{o.type.__name__}", **company},
                expect_error=True,
                what=f"{o.name}='not-a-{o.type.__name__}'",
            )
        elif o.choices is not None:
            attempt(
                {o.name: "conformance-not-a-choice", **company},
                expect_error=True,
                what=f"{o.name} outside its choices",
            )
        values = list(o.choices) if o.choices is not None else ([True, False] if o.type is bool else [])
        for value in values:
            q = attempt({o.name: value, **company}, expect_error=False, what=f"{o.name}={value!r}")
            if q is not None and q.options[o.name] != value:
                problems.append(f"{o.name}={value!r} resolved to {q.options[o.name]!r}")
            if o.type is not str:
                text = str(value).lower() if isinstance(value, bool) else str(value)
                q = attempt({o.name: text, **company}, expect_error=False, what=f"{o.name}={text!r} (text)")
                if q is not None and q.options[o.name] != value:
                    problems.append(f"{o.name}={text!r} (text) resolved to {q.options[o.name]!r}")
    q = attempt({"strict": "false"}, expect_error=False, what="strict='false'")
    if q is not None and q.context.strict is not False:
        problems.append("strict='false' is not visible as context.strict == False")
    if q is not None and "strict" in q.options:
        problems.append("the backend declares an option named 'strict', which is the core's (context.strict)")
    attempt({"strict": "maybe"}, expect_error=True, what="strict='maybe'")
    if problems:
        raise Failed(f"{len(problems)} problem(s): " + "; ".join(problems))
    return (
        f"{len(info.options)} option(s): defaults, types, choices and text forms ({tried} quantizers built)"
    )


def _outside_company(info: BackendInfo, option: BackendOption) -> dict[str, Any] | None:
    """Settings of the options ``option`` depends on that it does not apply with, if any exist."""
    for other, allowed in option.applies_with.items():
        declared = info.option(other)
        if declared is None or declared.choices is None:
            continue
        rest = [c for c in declared.choices if c not in allowed]
        if rest:
            return {other: rest[0]}
    return None


def _is_type(value: Any, typ: type) -> bool:
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typ)
