"""Sweep every installed accuracy algorithm over the zoo's architectures at 4-bit weights.

The suite asserts on the bench's models (``bench/algorithms.py``) and on SqueezeNet
(``tests/algorithms/test_zoo_weight_algorithms.py``); this script is how the algorithms are tried
on everything the zoo builds, as a user would apply them: each algorithm alone on each model,
``qnn_htp`` 16a4w and ``reference`` weight_only_int4, calibrated on the zoo's 2 batches and
measured on its 4 held-out ones (``tests/zoo/harness.py``). AdaRound runs 100 steps per layer.

    .venv/bin/python -m tests.zoo.algorithms_sweep                    # every model
    .venv/bin/python -m tests.zoo.algorithms_sweep resnet18 convnext  # some of them
    .venv/bin/python -m tests.zoo.algorithms_sweep --held-out         # the guard judges on held-out data
    .venv/bin/python -m tests.zoo.algorithms_sweep --measure-last     # ... the same batches measure, guard
                                                                      # on calibration (to compare with)
    .venv/bin/python -m tests.zoo.algorithms_sweep --only gptq --option gptq.scale_search=20
    .venv/bin/python -m tests.zoo.algorithms_sweep rwkv --only gptq --calibration-batches 8
    .venv/bin/python -m tests.zoo.algorithms_sweep --more             # tests/zoo/more_models.py too
    .venv/bin/python -m tests.zoo.algorithms_sweep r3d_18 mobilevit   # tests/zoo/sweep.py's, by name
    .venv/bin/python -m tests.zoo.algorithms_sweep --together --only smoothquant --only gptq \
        --option gptq.scale_search=20 --only bias_correction           # one combination, in order

``--only NAME`` (repeatable) sweeps those algorithms only; ``--option NAME.KEY=VALUE`` (repeatable)
configures one, as ``quantize --algorithm-option`` does (values are read as JSON, else text).
``--together`` runs the ``--only`` algorithms as one combination, in the order given.

One line per model and configuration: the default's SQNR, then each algorithm's gain over it
(held out) and its run time, or the exception's type and first line. The exit status is 1 when
any algorithm raised. With ``--held-out`` the guard judges on the first :data:`JUDGED` held-out
batches (``quantplug.Algorithms(..., held_out=...)``) and every SQNR, the default's too, is measured on the
others only; ``--measure-last`` measures on those same batches, the guard judging on calibration.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

import torch

import quantplug
from tests.zoo.harness import CALIBRATION_BATCHES, float_case, quantizer, quiet, run, sqnr
from tests.zoo.models import MODELS
from tests.zoo.more_models import MORE_MODELS
from tests.zoo.sweep import SWEEP

CONFIGS: tuple[tuple[str, str], ...] = (("qnn_htp", "16a4w"), ("reference", "weight_only_int4"))
OPTIONS: dict[str, dict[str, Any]] = {"adaround": {"iterations": 100}}
#: calibration batches per model (--calibration-batches; the zoo's 2 by default)
CALIBRATION: dict[str, int] = {"batches": CALIBRATION_BATCHES}
#: with --held-out: the held-out batches the guard judges on (the rest measure)
JUDGED = 2


def held_out_sqnr(
    name: str, backend: str, preset: str, algorithms: list[Any], skipped: int = 0, judged: bool = False
) -> float:
    """The held-out SQNR past the first ``skipped`` batches (with ``judged``: the guard's)."""
    case = float_case(name, CALIBRATION["batches"])
    with quiet():
        prepared = quantplug.prepare(
            case.program,
            quantizer(backend, preset),
            algorithms=quantplug.Algorithms(
                algorithms,
                calibration=case.calibration if algorithms else None,
                held_out=case.held_out[:skipped] if judged and algorithms else None,
            ),
        )
        run(prepared, case.calibration)
        converted = quantplug.convert(prepared)
    return sqnr(case.reference[skipped:], run(converted, case.held_out[skipped:]))


def sweep(
    name: str, algorithms: list[str], skipped: int = 0, judged: bool = False, together: bool = False
) -> tuple[list[str], int]:
    lines, failed = [], 0
    runs = [algorithms] if together else [[a] for a in algorithms]
    for backend, preset in CONFIGS:
        default = held_out_sqnr(name, backend, preset, [], skipped)
        cells = []
        for combination in runs:
            label = "+".join(combination)
            started = time.perf_counter()
            try:
                chosen = [(algorithm, OPTIONS.get(algorithm, {})) for algorithm in combination]
                found = held_out_sqnr(name, backend, preset, chosen, skipped, judged)
            except Exception as error:  # the sweep reports every failure and goes on
                failed += 1
                first = (str(error).splitlines() or [""])[0][:160]
                cells.append(f"{label} FAIL {type(error).__name__}: {first}")
                continue
            gain = 0.0 if found == default else found - default  # both exact (inf): no change
            cells.append(f"{label} {gain:+.2f} ({time.perf_counter() - started:.0f} s)")
        lines.append(f"{name:18} {backend} {preset:17} default {default:6.2f} | " + " | ".join(cells))
    return lines, failed


def _option_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.zoo.algorithms_sweep")
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"default: all of {', '.join(MODELS)}")
    parser.add_argument(
        "--more", action="store_true", help=f"sweep tests/zoo/more_models.py too: {', '.join(MORE_MODELS)}"
    )
    parser.add_argument("--held-out", action="store_true", help="the guard judges on held-out batches")
    parser.add_argument("--measure-last", action="store_true", help="measure on those batches only")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="sweep this algorithm")
    parser.add_argument("--option", action="append", default=[], metavar="NAME.KEY=VALUE")
    parser.add_argument("--together", action="store_true", help="the --only algorithms as one combination")
    parser.add_argument(
        "--calibration-batches",
        type=int,
        default=CALIBRATION_BATCHES,
        metavar="N",
        help=f"calibrate on N batches (default {CALIBRATION_BATCHES}; the held-out ones stay the same)",
    )
    args = parser.parse_args(argv)
    known = {**SWEEP, **MODELS, **MORE_MODELS}
    strangers = [m for m in args.models if m not in known]
    if strangers:
        parser.error(f"no zoo model {', '.join(strangers)} (the zoo has: {', '.join(known)})")
    names = args.models or list(MODELS) + (list(MORE_MODELS) if args.more else [])
    judged = args.held_out
    skipped = JUDGED if judged or args.measure_last else 0
    installed = [entry.name for entry in quantplug.list_algorithms()]
    unknown = [a for a in args.only if a not in installed]
    if unknown:
        parser.error(f"no installed algorithm {', '.join(unknown)} (installed: {', '.join(installed)})")
    algorithms = args.only or installed
    if args.together and not args.only:
        parser.error("--together runs the --only algorithms as one combination: name them with --only")
    if args.calibration_batches < CALIBRATION_BATCHES:
        parser.error(f"--calibration-batches must be at least {CALIBRATION_BATCHES} (the zoo's own)")
    CALIBRATION["batches"] = args.calibration_batches
    for item in args.option:
        target, _, value = item.partition("=")
        algorithm, _, key = target.partition(".")
        if not (value and key and algorithm in installed):
            parser.error(
                f"--option {item!r}: expected NAME.KEY=VALUE with NAME one of {', '.join(installed)}"
            )
        OPTIONS.setdefault(algorithm, {})[key] = _option_value(value)
    torch.set_num_threads(2)
    # the zoo calibrates on 16 images or sequences by design: every late layer would be named
    logging.getLogger("quantplug.algorithms").setLevel(logging.ERROR)
    failed = 0
    for name in names:
        lines, failures = sweep(name, algorithms, skipped, judged, args.together)
        failed += failures
        for line in lines:
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
