"""Accuracy algorithms (issue 15): output SQNR against float, each algorithm and the best combination
against the default, with each algorithm's runtime against the calibration time.

    python -m bench.algorithms                     # every model, every config: about 15 minutes on 2 cores
    python -m bench.algorithms --models cnn lstm   # a subset
    python -m bench.algorithms --threads 2         # torch threads (default 2)

Models (random weights unless said): ``encoder`` (nn.TransformerEncoder, 2 layers, d=64), ``llama``
(transformers LlamaForCausalLM, 2 layers, hidden 64), ``lstm`` (2-layer nn.LSTM 32 -> 64 and a
head), ``cnn`` (conv-bn-relu x3, depthwise in the middle, BN statistics randomized), and the two
digits models trained on scikit-learn's digits (``digits_mlp``, ``digits_cnn``, as in
tests/reference/test_reference_digits.py; stored weights, ``bench.digits_weights``). Configs:
``qnn_htp`` 16a4w, 16a4w_block, 8a4w and ``reference`` weight_only_int4 and int8_per_tensor; the
8-bit-weight counterpart (16a8w, 16a8w, 8a8w, weight_only_int8, int8) is measured too, for the
"gap closed" column.

Calibration: 8 batches; SQNR measured on 4 other batches (the float model's output vs the
converted Q/DQ program's). Every installed algorithm runs alone (those needing data before
annotation get the calibration batches), then every combination in ``COMBINATIONS`` whose
algorithms are installed (a configured algorithm, ``("gptq", {"scale_search": 20})``, is named
``gptq(scale_search=20)``; tried alone it gets a column); "best" is the highest SQNR among them.
Time columns: prepare + calibrate + convert with the algorithm minus the same without it, against
the calibration time of the default run.

Writes ``bench/results/algorithms.md`` and ``algorithms.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import quantplug
from bench.algorithm_models import MODELS, case

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: config name -> (backend, options, its 8-bit-weight counterpart's options)
CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "htp 16a4w": ("qnn_htp", {"precision": "16a4w"}, {"precision": "16a8w"}),
    "htp 16a4w_block": ("qnn_htp", {"precision": "16a4w_block"}, {"precision": "16a8w"}),
    "htp 8a4w": ("qnn_htp", {"precision": "8a4w"}, {"precision": "8a8w"}),
    "ref wo_int4": ("reference", {"preset": "weight_only_int4"}, {"preset": "weight_only_int8"}),
    "ref int8_per_tensor": ("reference", {"preset": "int8_per_tensor"}, {"preset": "int8"}),
}
HTP = {"soc_model": "SM8650"}

#: an algorithm as prepare() takes it: a name, or a name and its options
Spec = str | tuple[str, dict[str, Any]]
#: GPTQ choosing each channel's range by the error it leaves (off by default: it multiplies
#: GPTQ's time by the candidates tried; see docs/weight-algorithms.md)
GPTQ_SCALE_SEARCH: Spec = ("gptq", {"scale_search": 20})

#: combinations tried for "best" (in application order); those with a missing algorithm are skipped
COMBINATIONS: tuple[tuple[Spec, ...], ...] = (
    ("cle", "bias_correction"),
    ("smoothquant", "bias_correction"),
    ("cle", "smoothquant", "bias_correction"),
    ("seq_mse", "bias_correction"),
    ("smoothquant", "seq_mse"),
    ("cle", "seq_mse", "bias_correction"),
    ("smoothquant", "seq_mse", "bias_correction"),
    ("seq_mse", "adaround"),
    ("smoothquant", "seq_mse", "adaround"),
    ("cle", "seq_mse", "adaround", "bias_correction"),
    ("smoothquant", "gptq"),
    ("cle", "gptq", "bias_correction"),
    ("smoothquant", "gptq", "bias_correction"),
    ("seq_mse", "gptq", "bias_correction"),
    (GPTQ_SCALE_SEARCH,),
    (GPTQ_SCALE_SEARCH, "bias_correction"),
    ("cle", GPTQ_SCALE_SEARCH, "bias_correction"),
    ("smoothquant", GPTQ_SCALE_SEARCH, "bias_correction"),
)


def spec_name(spec: Spec) -> str:
    return spec if isinstance(spec, str) else spec[0]


def spec_label(spec: Spec) -> str:
    """``gptq`` or ``gptq(scale_search=20)``: how the table names a (configured) algorithm."""
    if isinstance(spec, str):
        return spec
    name, options = spec
    return f"{name}({', '.join(f'{k}={v}' for k, v in options.items())})"


# -- measuring ----------------------------------------------------------------------------------


def sqnr(refs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> float:
    signal = sum(float(r.double().pow(2).sum()) for r in refs)
    noise = sum(float((r.double() - o.double()).pow(2).sum()) for r, o in zip(refs, outs))
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def run_once(
    ep: torch.export.ExportedProgram,
    backend: str,
    options: dict[str, Any],
    algorithms: Sequence[Spec],
    calibration: list[tuple[torch.Tensor, ...]],
    measure: list[tuple[torch.Tensor, ...]],
    refs: list[torch.Tensor],
    guard: bool = True,
) -> dict[str, Any]:
    """One prepare-calibrate-convert; ``guard``: ``Algorithms(..., guard=...)`` (the studies of one
    algorithm against another turn it off: they measure what each algorithm chooses)."""
    quantizer = quantplug.get_quantizer(backend, **options)
    t0 = time.perf_counter()
    prepared = quantplug.prepare(
        ep, quantizer, algorithms=quantplug.Algorithms(list(algorithms), calibration=calibration, guard=guard)
    )
    t1 = time.perf_counter()
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    t2 = time.perf_counter()
    converted = quantplug.convert(prepared)
    t3 = time.perf_counter()
    with torch.no_grad():
        outs = [converted(*b) for b in measure]
    return {
        "sqnr": sqnr(refs, outs),
        "prepare": t1 - t0,
        "calibrate": t2 - t1,
        "convert": t3 - t2,
        "total": t3 - t0,
    }


def _attempt(
    row: dict[str, Any],
    where: tuple[Any, ...],
    algs: Sequence[Spec],
    opts: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any] | None:
    """One run recorded in ``row`` (a failing algorithm is a row of the table, not the end of the bench)."""
    name, config, ep, backend, extra, calibration, measure, refs, guard = where
    label = "+".join(spec_label(a) for a in algs) or "default"
    try:
        found = run_once(ep, backend, {**extra, **opts}, algs, calibration, measure, refs, guard)
    except Exception as exc:
        row["runs"][label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        log(f"  {name} {config} {label}: FAILED {row['runs'][label]['error']}")
        return None
    row["runs"][label] = found
    log(f"  {name} {config} {label}: {found['sqnr']:.2f} dB, {found['total']:.2f} s")
    return found


def bench_model(
    name: str, algorithms: list[str], configs: list[str], log: Callable[[str], None], guard: bool = True
) -> dict[str, Any]:
    cased = case(name)
    ep, calibration, measure, refs = cased.program, cased.calibration, cased.measure, cased.refs
    backend, options, _ = CONFIGS[configs[0]]  # warm-up (first calls compile code), not timed
    run_once(
        ep, backend, {**(HTP if backend == "qnn_htp" else {}), **options}, (), calibration, measure, refs
    )
    results: dict[str, Any] = {}
    for config in configs:
        backend, options, eight = CONFIGS[config]
        extra = HTP if backend == "qnn_htp" else {}
        row: dict[str, Any] = {"runs": {}}
        where = (name, config, ep, backend, extra, calibration, measure, refs, guard)
        default = _attempt(row, where, (), options, log)
        row["w8"] = run_once(ep, backend, {**extra, **eight}, (), calibration, measure, refs)["sqnr"]
        if default is None:
            results[config] = row
            continue
        for alg in algorithms:
            _attempt(row, where, (alg,), options, log)
        for combo in COMBINATIONS:
            if all(spec_name(a) in algorithms for a in combo):
                _attempt(row, where, combo, options, log)
        results[config] = row
    return results


# -- table --------------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.1f}"


def table(all_results: dict[str, dict[str, Any]], installed: list[str]) -> str:
    # each algorithm alone, and each configured one tried alone (``gptq(scale_search=20)``)
    algorithms = installed + [
        spec_label(c[0])
        for c in COMBINATIONS
        if len(c) == 1 and not isinstance(c[0], str) and spec_name(c[0]) in installed
    ]
    head = [
        "model",
        "config",
        "default",
        *algorithms,
        "best combination",
        "best",
        "gain",
        "8-bit w",
        "gap closed",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    times: dict[str, list[float]] = {a: [] for a in algorithms}
    calib: list[float] = []
    for model, per_config in all_results.items():
        for config, row in per_config.items():
            runs = row["runs"]
            default = runs.get("default", {}).get("sqnr")
            cells = [model, config, _fmt(default)]
            for alg in algorithms:
                run = runs.get(alg, {})
                cells.append(_fmt(run.get("sqnr")) if "sqnr" in run else "err")
            ok = {k: v for k, v in runs.items() if "sqnr" in v}
            best_label = max(ok, key=lambda k: ok[k]["sqnr"]) if ok else "-"
            best = ok[best_label]["sqnr"] if ok else None
            gain = None if best is None or default is None else best - default
            w8 = row.get("w8")
            closed = None
            if default is not None and w8 is not None and best is not None and w8 > default + 0.1:
                closed = (best - default) / (w8 - default)
            cells += [
                best_label,
                _fmt(best),
                _fmt(gain),
                _fmt(w8),
                "-" if closed is None else f"{100 * closed:.0f}%",
            ]
            lines.append("| " + " | ".join(cells) + " |")
            if "default" in runs and "total" in runs["default"]:
                calib.append(runs["default"]["calibrate"])
                for alg in algorithms:
                    if "total" in runs.get(alg, {}):
                        times[alg].append(runs[alg]["total"] - runs["default"]["total"])
    out = "\n".join(lines)
    out += "\n\nRuntime (seconds; algorithm = prepare + calibrate + convert with it minus without it):\n\n"
    out += (
        "| model | config | calibration | "
        + " | ".join(algorithms)
        + " |\n|"
        + "---|" * (3 + len(algorithms))
        + "\n"
    )
    for model, per_config in all_results.items():
        for config, row in per_config.items():
            runs = row["runs"]
            if "total" not in runs.get("default", {}):
                continue
            base = runs["default"]
            cells = [model, config, f"{base['calibrate']:.2f}"]
            for alg in algorithms:
                run = runs.get(alg, {})
                cells.append(f"{run['total'] - base['total']:+.2f}" if "total" in run else "err")
            out += "| " + " | ".join(cells) + " |\n"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.algorithms", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--algorithms", nargs="+", default=None, help="default: every installed algorithm")
    parser.add_argument(
        "--register",
        nargs="+",
        default=[],
        metavar="NAME=MODULE:CLASS",
        help="algorithms to register in-process first (code not installed in this venv's metadata)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--no-guard",
        dest="guard",
        action="store_false",
        help="Algorithms(..., guard=False): every choice of the algorithms kept, as they make it",
    )
    parser.add_argument("--out", default=str(RESULTS / "algorithms.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("quantplug").setLevel(logging.ERROR)
    for item in args.register:
        name, _, target = item.partition("=")
        module, _, attr = target.partition(":")
        quantplug.register_algorithm(name, getattr(importlib.import_module(module), attr))
    algorithms = args.algorithms or [e.name for e in quantplug.list_algorithms()]
    results: dict[str, Any] = {}
    started = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        print(f"{model}:", flush=True)
        results[model] = bench_model(
            model, algorithms, args.configs, lambda s: print(s, flush=True), args.guard
        )
        out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))  # so far
    text = table(results, algorithms)
    elapsed = time.perf_counter() - started
    header = (
        "# Accuracy algorithms: output SQNR (dB) against float\n\n"
        f"`python -m bench.algorithms {' '.join(sys.argv[1:] if argv is None else argv)}`".rstrip()
        + f" ({elapsed / 60:.1f} min, torch threads {args.threads}).\n"
        "SQNR on 4 held-out batches after calibrating on 8; 'best' over every single algorithm and "
        "every combination tried; 'gap closed' = (best - default) / (8-bit weights - default). "
        + (
            "The algorithm guard is on (the default: a layer keeps the algorithms' choice only where "
            "the model does no worse on the calibration batches).\n\n"
            if args.guard
            else "Without the algorithm guard (`--no-guard`): every choice kept as made.\n\n"
        )
    )
    out.write_text(header + text)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    print(header + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
