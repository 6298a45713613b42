"""``quantplug metadata NAME [NAME ...] [--check]``: write (or check) a backend's generated files.

A backend ships two kinds of file derived from its code, so that quantplug can read them without
importing it: its options and presets (``<name>.backend.json`` beside its plugin module, from
``quantplug_backend_info()``) and, for each rules package it reads with ``rules_from_index``, the
index of the ops each rules module covers (``rules.json``, from the modules' ``register_annotator``
declarations). This command writes them from the installed plugin; ``--check`` writes nothing and
exits 1 naming each stale file (a vendor's CI). Exit 2: bad usage or an unknown or broken backend.

Torch and the plugin are imported only when the command runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

EXIT_CURRENT = 0
EXIT_STALE = 1


def add_parser(sub: Any, add_common: Callable[..., None]) -> None:
    p = sub.add_parser(
        "metadata",
        help="write (or --check) a backend's generated files: its options and its rules indexes",
        description="Write the files quantplug reads without importing a backend, from the installed "
        "plugin: NAME.backend.json (its options and presets, from quantplug_backend_info) and the "
        "rules.json of each rules package it reads with rules_from_index (the ops of each rules "
        "module, from its @register_annotator declarations). Ship them as package data.",
    )
    p.add_argument("backends", nargs="+", metavar="NAME", help="backend name (see `quantplug backends`)")
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 naming each file that is missing or does not match the plugin",
    )
    add_common(p, sub=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    from _quantplug.cli.errors import InputError
    from _quantplug.plugins.metadata import MetadataError

    try:
        stale = [problem for name in args.backends for problem in _update(name, check=args.check)]
    except MetadataError as exc:
        raise InputError(str(exc)) from exc
    for problem in stale:
        console.error(problem)
    return EXIT_STALE if stale else EXIT_CURRENT


def _update(name: str, *, check: bool) -> list[str]:
    """Write backend ``name``'s files (``check``: only compare them); the problems found."""
    from _quantplug.plugins.metadata import COMMAND, check_metadata, write_metadata
    from _quantplug.quantizer.rules_index import drift, expected_index, index_path, packages_read_by

    problems: list[str] = []
    if check:
        path, reason = check_metadata(name)
        if reason is not None:
            problems.append(reason)
        else:
            print(f"{name}: {path} is current")
    else:
        print(f"{name}: wrote {write_metadata(name)}")
    for package in packages_read_by(name):
        if check:
            found = drift(package)
            problems += [f"{line}; regenerate it with `{COMMAND} {name}`" for line in found]
            if not found:
                print(f"{name}: {index_path(package)} is current")
        else:
            path, text = expected_index(package)
            path.write_text(text, encoding="utf-8")
            print(f"{name}: wrote {path}")
    return problems
