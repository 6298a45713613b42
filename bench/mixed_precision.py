"""Mixed precision at 4-bit weights: how much of the gap to 8-bit weights a few 8-bit layers close.

For each model of ``bench.algorithm_models`` and each 4-bit configuration, the search
(:func:`_quantplug.mixed_precision.search_mixed_precision`) chooses per-layer presets
between the 4-bit preset and its 8-bit-weight counterpart on the 8 calibration batches (the
selection never sees the held-out batches); each chosen point is then measured on the 4 held-out
batches, as ``bench.algorithms`` measures everything. Budgets are weight bytes over the all-4-bit
model (+10 %, +25 %), weights the backend leaves float (``reference`` weight-only convolutions;
``qnn_htp``'s LSTM with ``unroll_recurrent=False``) counted at their float32 size; 'half the gap
at' is the smallest point of the measured curve (calibration SQNR) that closes half the gap,
with its size.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import quantplug
from _quantplug.mixed_precision import MixedPrecision, search_mixed_precision
from bench.algorithm_models import MODELS, case
from bench.algorithms import HTP, RESULTS, sqnr

#: config -> (backend, its 4-bit preset, the 8-bit-weight preset, the backend's other options)
CONFIGS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "htp 16a4w": ("qnn_htp", "16a4w", "16a8w", HTP),
    "htp 8a4w": ("qnn_htp", "8a4w", "8a8w", HTP),
    "ref wo_int4": ("reference", "weight_only_int4", "weight_only_int8", {}),
}
BUDGETS = (1.10, 1.25)


def held_out_sqnr(
    result: MixedPrecision,
    ep: torch.export.ExportedProgram,
    calibration: list[tuple[torch.Tensor, ...]],
    measure: list[tuple[torch.Tensor, ...]],
    refs: list[torch.Tensor],
) -> float:
    prepared = quantplug.prepare(ep, result.quantizer())
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
        converted = quantplug.convert(prepared)
        return sqnr(refs, [converted(*b) for b in measure])


def bench_model(name: str, configs: Sequence[str]) -> dict[str, Any]:
    cased = case(name)
    ep, calibration, measure, refs = cased.program, cased.calibration, cased.measure, cased.refs
    rows: dict[str, Any] = {}
    for config in configs:
        backend, low, high, options = CONFIGS[config]
        started = time.perf_counter()
        search = search_mixed_precision(  # a budget nothing reaches: the bench reads the whole curve
            ep, backend, [low, high], calibration, max_weight_bytes=2**62, options=options
        )
        seconds = time.perf_counter() - started
        curve = search.curve
        smallest, largest = curve[0], curve[-1]

        def at(point: Any, search: MixedPrecision = search) -> float:
            chosen = MixedPrecision(
                search.backend, search.options, search.preset_option, search.default, dict(point.choice)
            )
            return held_out_sqnr(chosen, ep, calibration, measure, refs)

        default, eight = at(smallest), at(largest)
        row: dict[str, Any] = {
            "default": default,
            "w8": eight,
            "bytes4": smallest.weight_bytes,
            "bytes8": largest.weight_bytes,
            "search_s": seconds,
            "layers": len(smallest.choice),
        }
        for budget in BUDGETS:
            within = [p for p in curve if p.weight_bytes <= smallest.weight_bytes * budget]
            point = max(within, key=lambda p: p.sqnr_db)
            raised = sum(1 for v in point.choice.values() if v == high)
            row[f"budget {budget:.2f}"] = {"sqnr": at(point), "raised": raised}
        half = smallest.sqnr_db + (largest.sqnr_db - smallest.sqnr_db) / 2
        meeting = [p for p in curve if p.sqnr_db >= half]
        if meeting:
            point = min(meeting, key=lambda p: p.weight_bytes)
            row["half_gap"] = {
                "size": point.weight_bytes / smallest.weight_bytes,
                "sqnr": at(point),
                "raised": sum(1 for v in point.choice.values() if v == high),
            }
        rows[config] = row
        print(f"  {config}: {json.dumps(row, default=str)}", flush=True)
    return rows


def table(results: dict[str, Any]) -> str:
    lines = [
        "| model | config | layers | default (4-bit) | +10 % bytes | +25 % bytes | all 8-bit | gain at +25 % "
        "| gap closed at +25 % | half the gap at (size, SQNR, layers at 8-bit) | search s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, rows in results.items():
        for config, r in rows.items():
            d, w8 = r["default"], r["w8"]
            b10, b25 = r["budget 1.10"], r["budget 1.25"]
            gap = w8 - d
            closed = f"{(b25['sqnr'] - d) / gap:.0%}" if gap > 0.5 else "-"
            half = r.get("half_gap")
            half_cell = (
                f"{half['size']:.2f}x, {half['sqnr']:.1f} dB, {half['raised']}" if half else "not reached"
            )
            lines.append(
                f"| {model} | {config} | {r['layers']} | {d:.1f} | {b10['sqnr']:.1f} ({b10['raised']}) "
                f"| {b25['sqnr']:.1f} ({b25['raised']}) | {w8:.1f} | {b25['sqnr'] - d:+.1f} | {closed} "
                f"| {half_cell} | {r['search_s']:.0f} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.mixed_precision", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "mixed_precision.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("quantplug").setLevel(logging.ERROR)
    started = time.perf_counter()
    results: dict[str, Any] = {}
    out = Path(args.out)
    for model in args.models:
        print(f"{model}:", flush=True)
        results[model] = bench_model(model, args.configs)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    header = (
        "# Mixed precision at 4-bit weights: SQNR (dB) against float on held-out batches\n\n"
        f"`python -m bench.mixed_precision {' '.join(sys.argv[1:] if argv is None else argv)}`".rstrip()
        + f" ({(time.perf_counter() - started) / 60:.1f} min, torch threads {args.threads}). "
        + __doc__.split("\n\n")[1].replace("\n", " ")
        + " In brackets: the layers raised to 8-bit weights.\n\n"
    )
    out.write_text(header + table(results) + "\n")
    print(header + table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
