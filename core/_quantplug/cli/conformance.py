"""``quantplug conformance NAME``: run the backend conformance kit.

The checks run in a fresh interpreter of the kit's own, on the environment as installed
(``_quantplug.conformance.runner``); this process never imports the plugin.

Exit codes: 0 the backend conforms (skipped checks allowed), 1 a check failed (a hook that raises,
exits or hangs fails its check), 2 bad usage or an unknown/broken backend name.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

EXIT_CONFORMS = 0
EXIT_FAILED = 1
#: ``runner.DEFAULT_TIMEOUT_S``, repeated so that building the parser imports no torch (a test holds
#: them equal)
DEFAULT_TIMEOUT_S = 600.0


def add_parser(sub: Any, add_common: Callable[..., None]) -> None:
    p = sub.add_parser(
        "conformance",
        help="check that a backend does what users rely on (exit 0 only if it conforms)",
        description="Run the conformance kit against an installed backend, in a fresh interpreter: "
        "listing without import, typed option errors, every claimed op annotated within an SQNR "
        "floor, consistent sharing, validation, untouched inputs and process state, integer "
        "weights, declared files, determinism, no leaked models. A hook that raises, exits or "
        "hangs fails its check. Exit 0 when it conforms, 1 when a check fails.",
    )
    p.add_argument("backend", help="backend name (see `quantplug backends`)")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option applied to every quantizer the kit builds, repeatable",
    )
    p.add_argument(
        "--check",
        action="append",
        dest="checks",
        metavar="NAME",
        help="run only this check, repeatable (listed, options, ops, sharing, validation, untouched, "
        "integer-weights, lowering, deterministic, no-leak)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"seconds each check (each op of the per-op check) may run before it fails as hung "
        f"(default: {DEFAULT_TIMEOUT_S:g})",
    )
    add_common(p, sub=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    import json

    from _quantplug.cli.options import parse_pairs
    from _quantplug.conformance.runner import run_conformance

    options = parse_pairs(args.option)
    report = run_conformance(  # an unknown or broken backend raises: a usage error (exit 2)
        args.backend,
        options=options,
        only=args.checks,
        progress=lambda name: console.info(f"checking {name} ..."),
        timeout=args.timeout,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print(report.format(verbose=bool(getattr(args, "verbose", False))))
    return EXIT_CONFORMS if report.ok else EXIT_FAILED
