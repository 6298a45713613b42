"""``quantplug new-backend NAME [--dir D]``: write a backend distribution to start from.

Imports nothing heavy: the files are templates (``quantplug.scaffold``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_parser(sub: Any, add_common: Callable[..., None]) -> None:
    p = sub.add_parser(
        "new-backend",
        help="write a new backend plugin distribution (passes `quantplug conformance` as generated)",
        description="Write DIR/quantplug-NAME/: pyproject with the entry point, plugin module, configs, "
        "a rules module, constraints, a fusion pattern, the artifact writer, a conformance profile, "
        "tests (the conformance kit included) and a README. Then: pip install -e DIR/quantplug-NAME && "
        "quantplug conformance NAME.",
    )
    p.add_argument("name", help="the backend name users will type (lowercase identifier, e.g. my_npu)")
    p.add_argument("--dir", default=".", help="where to create quantplug-NAME/ (default: the current folder)")
    add_common(p, sub=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    from _quantplug.plugins.registry import list_backends
    from _quantplug.scaffold import create_backend, names

    derived = names(args.name)
    taken = next((e for e in list_backends() if e.name == args.name), None)  # metadata: nothing imported
    if taken is not None:
        by = f" (distribution {taken.distribution})" if taken.distribution else ""
        console.warn(
            f"a backend named {args.name!r} is already installed{by}: installing this one beside it makes "
            f"every `-b {args.name}` fail (the name is claimed twice); choose another name, or uninstall "
            "the other first"
        )
    root = create_backend(args.name, args.dir)
    print(f"wrote {root}")
    console.info(
        f"next: pip install -e {root}  &&  quantplug conformance {args.name}  "
        f"(then edit {derived['package']}/rules, constraints.py and lowering.py)"
    )
    return 0
