"""``python -m bench.trained``: quantization judged by task metrics on models trained here.

    python -m bench.trained                  # every model, preset, algorithm and peer (~40 min on 2 cores)
    python -m bench.trained --train          # retrain the language models (bench/data/trained_*.pt) first
    python -m bench.trained --models char_gpt --configs "htp 16a4w" --no-peers   # a subset
    # the committed table: processes per model (presets and peers apart from the algorithms),
    # then the tables from their .json files (bench/results/trained.md names the commands)
    python -m bench.trained --models lstm_lm --algorithm-configs --out /tmp/lstm.md
    python -m bench.trained --models lstm_lm --configs "htp 16a4w_block" --no-peers --out /tmp/lstm_a.md
    python -m bench.trained --combine /tmp/lstm.json /tmp/lstm_a.json ... --out bench/results/trained.md

Models: ``char_gpt`` (byte-level GPT, 4 blocks, d=128, context 64) and ``lstm_lm`` (byte-level
2-layer LSTM, 256 hidden) trained on the Python standard library's source
(:mod:`bench.trained.text`, :mod:`bench.trained.weights`), and the digits CNN
(``bench.digits_weights``). Every preset of both backends runs on the program (the converted Q/DQ
module) and, for ``reference``, on the shipped artifact (``model.onnx`` in ONNX Runtime); the
4-bit configs also run with each installed algorithm and the combinations of
:data:`bench.trained.flows.COMBINATIONS` (guard on, as users get it). Peers run on the same program
and data (:data:`bench.trained.flows.PEERS`).

Writes ``bench/results/trained.md`` and ``trained.json``.
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
from bench.trained import flows
from bench.trained.tasks import MODELS, Task, metrics, task

RESULTS = Path(__file__).resolve().parent.parent / "results"
NNCF_SIDE = RESULTS / "trained_nncf.json"


def primary(kind: str) -> str:
    """The metric the gap and the comparisons are taken on: perplexity, or cross-entropy (nats)
    for the classifier, whose accuracy on 360 images moves in steps of 0.28 %."""
    return "ppl" if kind == "lm" else "nll"


def _try(log: Any, what: str, fn: Any) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        found = fn()
    except Exception as exc:  # a failing flow is a row of the table, not the end of the bench
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        log(f"  {what}: FAILED {message}")
        return {"error": message}
    found["seconds"] = round(time.perf_counter() - started, 2)
    return found


def bench_model(
    t: Task,
    configs: Sequence[str],
    algorithms: Sequence[str],
    peers: bool,
    log: Any,
    algorithm_configs: Sequence[str] | None = None,
    held_out: str | None = None,
    save: Any = None,
    guard_loss: bool = False,
) -> dict[str, Any]:
    """Every run of ``t``; ``save(results so far)`` after each (a long run stopped keeps its cells)."""
    key = primary(t.kind)
    out: dict[str, Any] = {"float": metrics(t, t.reference), "presets": {}, "algorithms": {}, "peers": {}}
    log(f"  float: {key} {out['float'][key]:.4f}")

    def measured(logits: dict[str, Any]) -> dict[str, Any]:
        return {where: metrics(t, outs) for where, outs in logits.items()}

    for config in configs:
        backend, options = flows.PRESETS[config]

        def run(config: str = config, backend: str = backend, options: dict[str, Any] = options) -> Any:
            return measured(flows.quantplug_flow(t, backend, options, artifact=backend == "reference"))

        found = out["presets"][config] = _try(log, config, run)
        if save is not None:
            save(out)
        if "program" in found:
            art = f", artifact {found['artifact'][key]:.4f}" if "artifact" in found else ""
            log(f"  {config}: {key} {found['program'][key]:.4f}{art} ({found['seconds']} s)")
    chosen = flows.FOUR_BIT if algorithm_configs is None else algorithm_configs
    for config in [c for c in configs if c in flows.FOUR_BIT and c in chosen]:
        backend, options = flows.PRESETS[config]
        runs: dict[str, Any] = {}
        tried: list[Sequence[flows.Spec]] = [(a,) for a in algorithms]
        tried += [
            c for c in flows.COMBINATIONS if all((s if isinstance(s, str) else s[0]) in algorithms for s in c)
        ]
        for algs in tried:
            name = flows.label(algs) + {
                "calibration": " (guard on calibration)",
                "spare": " (guard on spare text)",
            }.get(held_out or "", "")
            name += " (guard on next-byte loss)" if guard_loss else ""

            def run_alg(
                algs: Sequence[flows.Spec] = algs, backend: str = backend, options: dict[str, Any] = options
            ) -> Any:
                loss = flows.next_byte_loss if guard_loss else None
                return measured(
                    flows.quantplug_flow(
                        t,
                        backend,
                        options,
                        algs,
                        held_out=t.spare if held_out == "spare" else held_out,
                        guard_loss=loss,
                    )
                )

            out["algorithms"][config] = runs
            found = runs[name] = _try(log, f"{config} {name}", run_alg)
            if save is not None:
                save(out)
            if "program" in found:
                log(f"  {config} {name}: {key} {found['program'][key]:.4f} ({found['seconds']} s)")
        out["algorithms"][config] = runs
    if peers:
        for name, (beside, flow) in flows.PEERS.items():
            if beside not in configs:
                continue
            found = out["peers"][name] = _try(log, name, lambda flow=flow: {"program": metrics(t, flow(t))})
            if "program" in found:
                log(f"  {name}: {key} {found['program'][key]:.4f} ({found['seconds']} s)")
            found["beside"] = beside
    return out


# -- tables ------------------------------------------------------------------------------------


def _cell(found: dict[str, Any] | None, where: str, key: str, base: float) -> str:
    if not found:
        return "-"
    if "error" in found:
        return "err"
    value = found.get(where, {}).get(key)
    return "-" if value is None else f"{value - base:+.4f}"


def _plain(found: dict[str, Any] | None, where: str, key: str) -> str:
    value = (found or {}).get(where, {}).get(key)
    return "-" if value is None else f"{value:.2f}"


def presets_table(model: str, kind: str, res: dict[str, Any]) -> str:
    key = primary(kind)
    base = res["float"][key]
    fl = res["float"]
    head = [
        "config / flow",
        f"Δ{key} program",
        f"Δ{key} artifact (ORT)",
        *(["bits/byte"] if kind == "lm" else []),
        "accuracy %",
        "flips %",
    ]
    lines = [
        f"### {model}: float {key} {base:.4f}"
        + (f", {fl['bpb']:.4f} bits/byte" if kind == "lm" else "")
        + f", accuracy {fl['accuracy']:.2f} %\n",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    rows = [(c, f) for c, f in res["presets"].items()]
    rows += [(f"{name} (peer)", f) for name, f in res["peers"].items()]
    for name, found in rows:
        cells = [name, _cell(found, "program", key, base), _cell(found, "artifact", key, base)]
        if kind == "lm":
            cells.append(_plain(found, "program", "bpb"))
        cells += [_plain(found, "program", "accuracy"), _plain(found, "program", "flips")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def algorithms_table(results: dict[str, Any], tasks: dict[str, str]) -> str:
    names: list[str] = []
    for res in results.values():
        for runs in res["algorithms"].values():
            names += [n for n in runs if n not in names]
    head = ["model", "config", "default", *names, "best", "best Δ", "8-bit w", "gap closed", "best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, res in results.items():
        key = primary(tasks[model])
        base = res["float"][key]
        for config, runs in res["algorithms"].items():
            default = res["presets"].get(config, {}).get("program", {}).get(key)
            eight = res["presets"].get(flows.FOUR_BIT[config], {}).get("program", {}).get(key)
            cells = [model, config, "-" if default is None else f"{default - base:+.4f}"]
            cells += [_cell(runs.get(n), "program", key, base) for n in names]
            ok = {n: f["program"][key] for n, f in runs.items() if "program" in f}
            if default is not None:
                ok["default"] = default
            best = min(ok, key=lambda n: ok[n]) if ok else None
            closed = "-"
            if best is not None and default is not None and eight is not None and default - eight > 1e-4:
                closed = f"{100 * (default - ok[best]) / (default - eight):.0f}%"
            peer = [
                f["program"][key]
                for f in res["peers"].values()
                if f.get("beside") == config and "program" in f
            ]
            cells += [
                best or "-",
                "-" if best is None else f"{ok[best] - base:+.4f}",
                "-" if eight is None else f"{eight - base:+.4f}",
                closed,
                f"{min(peer) - base:+.4f}" if peer else "-",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def nncf_versions() -> str:
    if not NNCF_SIDE.is_file():
        return "not run"
    found = json.loads(NNCF_SIDE.read_text())
    return f"NNCF {found['nncf']}, torch {found['torch']}"


def with_nncf(results: dict[str, Any]) -> dict[str, Any]:
    """NNCF's INT4 rows (run in its own venv by :mod:`bench.trained.nncf_side`) as peers beside
    ``ref weight_only_int4``, for the models both runs have."""
    if not NNCF_SIDE.is_file():
        return results
    for model, rows in json.loads(NNCF_SIDE.read_text())["models"].items():
        if model in results:
            for flow, found in rows.items():
                results[model]["peers"][flow] = {**found, "beside": "ref weight_only_int4"}
    return results


def render(results: dict[str, Any], kinds: dict[str, str], argv: Sequence[str], minutes: float) -> str:
    text = [
        "# Quantization on trained models: task metrics\n",
        f"`python -m bench.trained {' '.join(argv)}`".replace(" `", "`")
        + f" ({minutes:.0f} min; torch {torch.__version__}, quantplug {quantplug.__version__}).\n",
        "Δ = quantized minus float on the test text (language models: perplexity per byte on 128 "
        "windows of 64 bytes from stdlib modules never trained or calibrated on) or the 360 held-out "
        "digits (cross-entropy, nats). Program: the converted Q/DQ module; artifact: `reference`'s "
        "`model.onnx` in ONNX Runtime (graph optimizations on, as shipped). Flips: % of predictions whose "
        "top-1 differs from the float model's. NNCF's rows come from its own venv "
        "(`bench/trained/nncf_side.py`, `bench/results/trained_nncf.json`: " + nncf_versions() + ").\n",
        "## Every preset, and the peers\n",
    ]
    for model, res in results.items():
        text += [presets_table(model, kinds[model], res), ""]
    text += [
        "## Algorithms at 4-bit weights (guard on)\n",
        "Δ against float of each algorithm alone and of the combinations; 'gap closed' = (default - "
        "best) / (default - 8-bit weights); 'best peer' = the best peer flow beside that config.\n",
        algorithms_table(results, kinds),
        "",
    ]
    return "\n".join(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trained", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--configs", nargs="+", default=list(flows.PRESETS), choices=list(flows.PRESETS))
    parser.add_argument("--algorithms", nargs="*", default=None, help="default: every installed algorithm")
    parser.add_argument("--no-peers", dest="peers", action="store_false")
    parser.add_argument(
        "--algorithm-configs",
        nargs="*",
        default=None,
        choices=list(flows.FOUR_BIT),
        help="the 4-bit configs that get the algorithms (default: every one in --configs)",
    )
    parser.add_argument("--test-batches", type=int, default=None, help="default: every stored test batch")
    parser.add_argument(
        "--guard-on-calibration",
        dest="held_out",
        action="store_const",
        const="calibration",
        default=None,
        help='Algorithms(..., held_out="calibration"): the guard judges on the batches the algorithms fitted',
    )
    parser.add_argument(
        "--guard-on-spare",
        dest="held_out",
        action="store_const",
        const="spare",
        help="Algorithms(..., held_out=...): the guard judges on the calibration text left over (4 "
        "batches the model is not calibrated on) instead of a split of the calibration batches",
    )
    parser.add_argument(
        "--guard-loss",
        action="store_true",
        help="Algorithms(..., guard_loss=next-byte cross-entropy): the guard minimises the language "
        "model's own loss on its held-out batches instead of the output error",
    )
    parser.add_argument("--train", action="store_true", help="retrain and store the language models first")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "trained.md"))
    parser.add_argument(
        "--combine",
        nargs="+",
        metavar="JSON",
        help="only write --out from the .json files of earlier runs (one per model, run in parallel)",
    )
    args = parser.parse_args(argv)
    shown = list(sys.argv[1:] if argv is None else argv)
    if args.combine:
        results: dict[str, Any] = {}
        for file in args.combine:  # runs of one model (presets apart from algorithms) merge
            for model, found in json.loads(Path(file).read_text()).items():
                into = results.setdefault(model, {"presets": {}, "algorithms": {}, "peers": {}})
                if len(found.get("float", {})) >= len(into.get("float", {})):  # the fullest record
                    into["float"] = found["float"]
                into["minutes"] = float(into.get("minutes", 0)) + float(found.get("minutes", 0))
                for part in ("presets", "peers"):
                    into[part].update(found.get(part, {}))
                for config, runs in found.get("algorithms", {}).items():
                    into["algorithms"].setdefault(config, {}).update(runs)
        kinds = {k: "lm" if "ppl" in v["float"] else "classify" for k, v in results.items()}
        minutes = sum(float(v.get("minutes", 0)) for v in results.values())
        Path(args.out).write_text(render(with_nncf(results), kinds, shown, minutes))
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
        return 0
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("quantplug").setLevel(logging.ERROR)
    if args.train:
        from bench.trained import weights

        for name in ("char_gpt", "lstm_lm"):
            weights.store(weights.train(name), name)
    algorithms = (
        args.algorithms if args.algorithms is not None else [e.name for e in quantplug.list_algorithms()]
    )
    started = time.perf_counter()
    results = {}
    kinds: dict[str, str] = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        print(f"{model}:", flush=True)
        begun = time.perf_counter()
        t = task(model, test_batches=args.test_batches)
        kinds[model] = t.kind
        results[model] = bench_model(
            t,
            args.configs,
            algorithms,
            args.peers,
            lambda s: print(s, flush=True),
            args.algorithm_configs,
            args.held_out,
            lambda so_far, model=model: out.with_suffix(".json").write_text(
                json.dumps({**results, model: so_far}, indent=1)
            ),
            args.guard_loss and t.kind == "lm",
        )
        results[model]["minutes"] = round((time.perf_counter() - begun) / 60, 1)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    text = render(with_nncf(results), kinds, shown, (time.perf_counter() - started) / 60)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
