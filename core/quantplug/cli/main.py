"""The ``quantplug`` command: list backends and quantize a program (the built-in demo by default)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_USAGE = 2


def _parse_options(pairs: Sequence[str]) -> dict[str, str]:
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"quantplug: --option expects key=value, got {pair!r}")
        options[key.strip()] = value.strip()
    return options


def cmd_backends(args: argparse.Namespace) -> int:
    import quantplug
    from quantplug.plugins.registry import load_backend

    rows: list[dict[str, Any]] = []
    for entry in quantplug.list_backends():
        row = {
            "name": entry.name,
            "distribution": entry.distribution,
            "version": entry.version,
            "status": entry.status,
            "error": entry.error,
        }
        if args.check and entry.status in ("available", "loaded", "error"):
            try:
                loaded = load_backend(entry.name)
                row.update(status="loaded", description=loaded.info.description)
            except quantplug.QuantplugError as exc:
                row.update(status="error", error=str(exc))
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no quantplug backends installed (pip install quantplug-reference)")
        return 0
    for row in rows:
        dist = f"{row['distribution']} {row['version']}" if row["distribution"] else "in-process"
        extra = f" - {row['description']}" if row.get("description") else ""
        print(f"{row['name']:<16} {dist:<32} {row['status']}{extra}")
        if row.get("error"):
            print(f"    error: {row['error']}")
    return 0


def _sqnr(ref: Any, out: Any) -> float:
    import torch

    noise = (ref - out).pow(2).mean()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.pow(2).mean() / noise))


def cmd_quantize(args: argparse.Namespace) -> int:
    import torch

    import quantplug
    from quantplug.demo.model import demo_calibration, demo_model

    started = time.perf_counter()
    if args.model:
        program = torch.export.load(args.model)
        model_name = args.model
        from quantplug.flow.inspect import example_inputs

        example = example_inputs(program.module())
        calibration = [example]
        reference_module = program.module()
        print("warning: no calibration data given; calibrating on one random batch", file=sys.stderr)
    else:
        model, example = demo_model()
        program = torch.export.export(model, example)
        calibration = demo_calibration()
        reference_module = model
        model_name = "built-in demo (DemoNet, 16 synthetic batches)"
    quantizer = quantplug.get_quantizer(args.backend, **_parse_options(args.option))
    prepared = quantplug.prepare(program, quantizer)
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    quantized = quantplug.convert(prepared)
    coverage = quantizer.coverage(program)
    with torch.no_grad():
        sqnr = _sqnr(reference_module(*example), quantized(*example))
    out_dir = Path(args.out)
    artifact = quantplug.lower(quantized, quantizer)
    files = artifact.save(out_dir)
    elapsed = time.perf_counter() - started
    print(f"model:     {model_name}")
    print(f"backend:   {quantizer.backend} {quantizer.options}")
    print(f"nodes:     {len(coverage.quantized_nodes)} quantized, {len(coverage.float_nodes)} float")
    for n in coverage.float_nodes:
        print(f"           float {n.node}: {n.reason}")
    print(f"SQNR:      {sqnr:.1f} dB (quantized vs float output)")
    print(f"artifact:  {', '.join(str(f) for f in files)}")
    print(f"time:      {elapsed:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantplug", description="Quantize PyTorch 2 programs for a backend."
    )
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("backends", help="list installed backends")
    p.add_argument("--json", action="store_true")
    p.add_argument("--check", action="store_true", help="import each plugin and report load errors")
    p.set_defaults(func=cmd_backends)
    p = sub.add_parser("quantize", help="quantize a saved ExportedProgram (.pt2), or the built-in demo")
    p.add_argument(
        "model", nargs="?", help="a torch.export.save()d program; omitted: the built-in demo model"
    )
    p.add_argument("--backend", default="reference")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="backend option")
    p.add_argument("--out", default="quantplug-out", help="output folder (default: quantplug-out)")
    p.set_defaults(func=cmd_quantize)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["quantize", *(argv or [])])
    from quantplug.errors import QuantplugError

    try:
        return int(args.func(args))
    except QuantplugError as exc:
        if args.verbose:
            raise
        print(f"quantplug: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
