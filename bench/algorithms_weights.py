"""AdaRound, SeqMSE and GPTQ (issue 15): model SQNR against float and runtime against calibration.

    python -m bench.algorithms_weights                  # llama, encoder, cnn, digits; 4-bit configs
    python -m bench.algorithms_weights --models llama --threads 2

Uses the models, configs and measurement of :mod:`bench.algorithms` (8 calibration batches, SQNR
on 4 others) and adds what concerns the weight-choice algorithms: each alone, the combinations
SeqMSE+GPTQ and SeqMSE+AdaRound, and the convert time each adds (prepare + calibrate + convert
with it minus the default run), which for AdaRound and SeqMSE on the 2-layer Llama decoder must
stay under 2 minutes on 2 cores. Writes ``bench/results/algorithms_weights.md`` and ``.json``.
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

from bench.algorithm_models import case
from bench.algorithms import CONFIGS, HTP, RESULTS, run_once

WEIGHT_ALGORITHMS = ("seq_mse", "adaround", "gptq")
COMBINATIONS = (("seq_mse", "gptq"), ("seq_mse", "adaround"))
MODELS = ("llama", "encoder", "cnn", "digits_mlp", "digits_cnn", "lstm")
FOUR_BIT = ("htp 16a4w", "htp 16a4w_block", "htp 8a4w", "ref wo_int4")
BUDGET_S = 120.0  # AdaRound and SeqMSE on the 2-layer decoder, 2 cores


def bench(models: Sequence[str], configs: Sequence[str], sequential: bool | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in models:
        cased = case(name)
        ep, calibration, measure, refs = cased.program, cased.calibration, cased.measure, cased.refs
        results[name] = {}
        for config in configs:
            backend, options, eight = CONFIGS[config]
            extra = HTP if backend == "qnn_htp" else {}
            opts = {**extra, **options}
            run_once(ep, backend, opts, (), calibration, measure, refs, False)  # warm-up, not recorded
            row: dict[str, Any] = {
                "default": run_once(ep, backend, opts, (), calibration, measure, refs, False),
                "w8": run_once(ep, backend, {**extra, **eight}, (), calibration, measure, refs, False)[
                    "sqnr"
                ],
            }
            for algs in [(a,) for a in WEIGHT_ALGORITHMS] + list(COMBINATIONS):
                label = "+".join(algs)
                try:
                    specs: list[Any] = [
                        a if sequential is None else (a, {"sequential": sequential}) for a in algs
                    ]
                    row[label] = run_once(ep, backend, opts, specs, calibration, measure, refs, False)
                except Exception as exc:  # a row of the table, not the end of the bench
                    row[label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                got = row[label]
                shown = (
                    f"{got['sqnr']:.2f} dB, +{got['total'] - row['default']['total']:.1f} s"
                    if "sqnr" in got
                    else got["error"]
                )
                print(
                    f"  {name} {config} {label}: {shown} (default {row['default']['sqnr']:.2f})", flush=True
                )
            results[name][config] = row
    return results


def table(results: dict[str, Any]) -> str:
    labels = ["+".join(a) for a in [(a,) for a in WEIGHT_ALGORITHMS] + list(COMBINATIONS)]
    head = ["model", "config", "default", *labels, "8-bit w", "best gain", "gap closed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, per_config in results.items():
        for config, row in per_config.items():
            default = row["default"]["sqnr"]
            got = {k: row[k]["sqnr"] for k in labels if "sqnr" in row.get(k, {})}
            best = max(got.values(), default=default)
            gap = row["w8"] - default
            closed = f"{100 * (best - default) / gap:.0f}%" if gap > 0.1 else "-"
            cells = [
                model,
                config,
                f"{default:.1f}",
                *(f"{got[k]:.1f}" if k in got else "err" for k in labels),
            ]
            cells += [f"{row['w8']:.1f}", f"{best - default:+.1f}", closed]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Runtime (s): calibration of the default run; each algorithm's added prepare+calibrate+convert:",
        "",
    ]
    lines += [
        "| model | config | calibration | " + " | ".join(labels) + " |",
        "|" + "---|" * (3 + len(labels)),
    ]
    for model, per_config in results.items():
        for config, row in per_config.items():
            base = row["default"]
            cells = [model, config, f"{base['calibrate']:.2f}"]
            cells += [
                f"{row[k]['total'] - base['total']:+.1f}" if "total" in row.get(k, {}) else "err"
                for k in labels
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def sequential_vs_float(sequential: dict[str, Any], floating: dict[str, Any]) -> str:
    """Per cell: the SQNR with sequential layer inputs minus the one with float inputs (dB)."""
    labels = ["+".join(a) for a in [(a,) for a in WEIGHT_ALGORITHMS] + list(COMBINATIONS)]
    lines = [
        "Sequential minus float layer inputs (dB; float: `algorithms_weights.md`):",
        "",
        "| model | config | " + " | ".join(labels) + " |",
        "|" + "---|" * (2 + len(labels)),
    ]
    deltas: list[float] = []
    for model, per_config in sequential.items():
        for config, row in per_config.items():
            other = floating.get(model, {}).get(config, {})
            cells = []
            for k in labels:
                a, b = row.get(k, {}).get("sqnr"), other.get(k, {}).get("sqnr")
                if a is None or b is None:
                    cells.append("-")
                    continue
                deltas.append(a - b)
                cells.append(f"{a - b:+.1f}")
            lines.append(f"| {model} | {config} | " + " | ".join(cells) + " |")
    if deltas:
        better = sum(d > 0.05 for d in deltas)
        worse = sum(d < -0.05 for d in deltas)
        lines += [
            "",
            f"{len(deltas)} cells: mean {sum(deltas) / len(deltas):+.2f} dB, better in {better}, worse in "
            f"{worse}, min {min(deltas):+.1f}, max {max(deltas):+.1f}.",
        ]
    return "\n".join(lines) + "\n"


def budget_check(results: dict[str, Any]) -> list[str]:
    """AdaRound and SeqMSE on the 2-layer decoder within 2 minutes (whole prepare+calibrate+convert)."""
    notes = []
    for config, row in results.get("llama", {}).items():
        for alg in ("adaround", "seq_mse"):
            run = row.get(alg, {})
            if "total" in run:
                verdict = "ok" if run["total"] <= BUDGET_S else "OVER BUDGET"
                notes.append(f"llama {config} {alg}: {run['total']:.1f} s of {BUDGET_S:.0f} s ({verdict})")
    return notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.algorithms_weights", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--configs", nargs="+", default=list(FOUR_BIT), choices=list(CONFIGS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="default: results/algorithms_weights[_sequential].md")
    parser.add_argument(
        "--sequential",
        choices=("default", "on", "off"),
        default="default",
        help="layer inputs of SeqMSE/AdaRound/GPTQ: the algorithms' default, sequential, or float",
    )
    args = parser.parse_args(argv)
    sequential = {"default": None, "on": True, "off": False}[args.sequential]
    if args.out is None:
        suffix = {"default": "", "on": "_sequential", "off": "_float"}[args.sequential]
        args.out = str(RESULTS / f"algorithms_weights{suffix}.md")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("quantplug").setLevel(logging.ERROR)
    started = time.perf_counter()
    results = bench(args.models, args.configs, sequential)
    notes = budget_check(results)
    header = (
        "# AdaRound, SeqMSE, GPTQ: output SQNR (dB) against float at 4-bit weights\n\n"
        f"`python -m bench.algorithms_weights {' '.join(sys.argv[1:] if argv is None else argv)}`".rstrip()
        + f" ({(time.perf_counter() - started) / 60:.1f} min, torch threads {args.threads}).\n"
        "Default options (adaround: 500 steps/layer; seq_mse: range fractions k/100 up to 1.5; "
        "gptq: act-order, 1% damp); "
        f"layer inputs: {dict(default='the default', on='sequential', off='float')[args.sequential]}.\n\n"
    )
    text = header + table(results) + ("\n" + "\n".join(f"- {n}" for n in notes) + "\n" if notes else "")
    floating = RESULTS / "algorithms_weights.json"
    if sequential and floating.exists():
        text += "\n" + sequential_vs_float(results, json.loads(floating.read_text()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
