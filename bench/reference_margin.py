"""`reference` a16w8: what the 16-bit activations' scale floor and range margin do on the zoo.

    python -m bench.reference_margin            # the zoo's 17 models, about 6 minutes on 2 cores

Each variant sets the two module constants ``build_config`` reads
(``quantplug_reference.configs.ACTIVATION_EPS`` and ``ACTIVATION_MARGIN_16BIT``) and quantizes
every zoo model at ``a16w8`` as ``tests/zoo`` does (calibrated on its 2 batches, the program's
SQNR against float on its 4 held-out batches):

* ``floor 2**-12``: the scale floored at ``2**-12`` (XNNPACK's), no margin: what a16w8 did until
  the margin replaced it (a 16-bit tensor's range was at least 65535 * 2**-12 = 16, whatever
  calibration saw: a margin by accident, and too coarse a grid for narrow tensors);
* ``margin k``: float32's eps as the floor, the grid covering ``k`` times the calibrated range.

Writes ``bench/results/reference_margin.md``.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
#: (label, activation eps, 16-bit range margin)
VARIANTS: tuple[tuple[str, float, float], ...] = (
    ("floor 2**-12", 2**-12, 1.0),
    ("margin 1", float(torch.finfo(torch.float32).eps), 1.0),
    ("margin 2", float(torch.finfo(torch.float32).eps), 2.0),
    ("margin 4 (default)", float(torch.finfo(torch.float32).eps), 4.0),
    ("margin 16", float(torch.finfo(torch.float32).eps), 16.0),
)


def measure(name: str, eps: float, margin: float) -> float:
    import quantplug
    import quantplug_reference.configs as configs
    from tests.zoo.harness import float_case, quantizer, run, sqnr

    configs.ACTIVATION_EPS, configs.ACTIVATION_MARGIN_16BIT = eps, margin
    case = float_case(name)
    prepared = quantplug.prepare(case.program, quantizer("reference", "a16w8"))
    run(prepared, case.calibration)
    return sqnr(case.reference, run(quantplug.convert(prepared), case.held_out))


def main(argv: list[str] | None = None) -> int:
    from tests.zoo.models import MODELS

    parser = argparse.ArgumentParser(prog="python -m bench.reference_margin")
    parser.add_argument("models", nargs="*", default=list(MODELS))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)  # as the zoo runs
    started = time.perf_counter()
    table: dict[str, list[float]] = {}
    for name in args.models:
        table[name] = [measure(name, eps, margin) for _, eps, margin in VARIANTS]
        print(name, [f"{v:.2f}" for v in table[name]], flush=True)
    lines = [
        "# `reference` a16w8: the 16-bit activations' scale floor and range margin on the zoo\n",
        f"`python -m bench.reference_margin` ({(time.perf_counter() - started) / 60:.1f} min, one torch "
        "thread). SQNR (dB) of the a16w8 program against float on the zoo's held-out batches, calibrated "
        "on its 2 batches; variants in the module's docstring.\n",
        "| model | " + " | ".join(label for label, _, _ in VARIANTS) + " |",
        "|---|" + "---|" * len(VARIANTS),
    ]
    for name, values in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    base = [values[0] for values in table.values()]
    for index, (label, _, _) in enumerate(VARIANTS[1:], start=1):
        diff = [values[index] - b for values, b in zip(table.values(), base, strict=True)]
        lines.append(
            f"\n{label} against the floor: {sum(d > 0.05 for d in diff)} better, "
            f"{sum(d < -0.05 for d in diff)} worse (by more than 0.05 dB), from {min(diff):+.2f} to "
            f"{max(diff):+.2f} dB."
        )
    (RESULTS / "reference_margin.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
