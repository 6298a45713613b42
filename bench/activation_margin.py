"""16-bit activations on the zoo: the scale floor and the range margin (observers' ``range_margin``).

    python -m bench.activation_margin            # the zoo's 17 models, about 3 minutes on 2 cores

Every zoo model quantized as ``tests/zoo`` does (calibrated on its 2 batches, the program's SQNR
against float on its 4 held-out batches, one torch thread):

1. ``reference`` a16w8. Each variant sets the two module constants ``build_config`` reads
   (``quantplug_reference.configs.ACTIVATION_EPS`` and ``ACTIVATION_MARGIN_16BIT``):

   * ``floor 2**-12``: the scale floored at ``2**-12`` (XNNPACK's), no margin: what a16w8 did until
     the margin replaced it (a 16-bit tensor's range was at least 65535 * 2**-12 = 16, whatever
     calibration saw: a margin by accident, and too coarse a grid for narrow tensors);
   * ``margin k``: float32's eps as the floor, the grid covering ``k`` times the calibrated range.

2. ``qnn_htp`` 16a8w and 16a4w with the ``act_range_margin`` option (default 1, ExecuTorch's
   moving-average observer as it is).

Writes ``bench/results/activation_margin.md``.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
#: (label, activation eps, 16-bit range margin) of ``reference`` a16w8
REFERENCE_VARIANTS: tuple[tuple[str, float, float], ...] = (
    ("floor 2**-12", 2**-12, 1.0),
    ("margin 1", float(torch.finfo(torch.float32).eps), 1.0),
    ("margin 2", float(torch.finfo(torch.float32).eps), 2.0),
    ("margin 4 (default)", float(torch.finfo(torch.float32).eps), 4.0),
    ("margin 16", float(torch.finfo(torch.float32).eps), 16.0),
)
#: ``qnn_htp`` presets and ``act_range_margin`` values
QNN_PRESETS = ("16a8w", "16a4w")
QNN_MARGINS = (1.0, 2.0, 4.0, 8.0)


def _measure(name: str, backend: str, preset: str, **options: float) -> float:
    import quantplug
    from tests.zoo.harness import float_case, quantizer, run, sqnr

    case = float_case(name)
    prepared = quantplug.prepare(case.program, quantizer(backend, preset, **options))
    run(prepared, case.calibration)
    return sqnr(case.reference, run(quantplug.convert(prepared), case.held_out))


def reference_row(name: str) -> list[float]:
    import quantplug_reference.configs as configs

    kept = configs.ACTIVATION_EPS, configs.ACTIVATION_MARGIN_16BIT
    row = []
    try:
        for _, eps, margin in REFERENCE_VARIANTS:
            configs.ACTIVATION_EPS, configs.ACTIVATION_MARGIN_16BIT = eps, margin
            row.append(_measure(name, "reference", "a16w8"))
    finally:
        configs.ACTIVATION_EPS, configs.ACTIVATION_MARGIN_16BIT = kept
    return row


def table(title: str, labels: Sequence[str], rows: dict[str, list[float]]) -> list[str]:
    lines = [
        f"## {title}\n",
        "| model | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    lines += [f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |" for name, values in rows.items()]
    base = [values[0] for values in rows.values()]
    lines.append("")
    for index, label in enumerate(labels[1:], start=1):
        diff = [values[index] - b for values, b in zip(rows.values(), base, strict=True)]
        lines.append(
            f"- {label} against {labels[0]}: {sum(d > 0.05 for d in diff)} better, "
            f"{sum(d < -0.05 for d in diff)} worse (by more than 0.05 dB), from {min(diff):+.2f} to "
            f"{max(diff):+.2f} dB."
        )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    from tests.zoo.models import MODELS

    parser = argparse.ArgumentParser(prog="python -m bench.activation_margin")
    parser.add_argument("models", nargs="*", default=list(MODELS))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)  # as the zoo runs
    started = time.perf_counter()
    reference = {name: reference_row(name) for name in args.models}
    qnn = {
        preset: {
            name: [_measure(name, "qnn_htp", preset, act_range_margin=m) for m in QNN_MARGINS]
            for name in args.models
        }
        for preset in QNN_PRESETS
    }
    lines = [
        "# 16-bit activations: the scale floor and the range margin on the zoo\n",
        f"`python -m bench.activation_margin` ({(time.perf_counter() - started) / 60:.1f} min, one torch "
        "thread). SQNR (dB) of the program against float on the zoo's held-out batches, calibrated on "
        "its 2 batches; variants in the module's docstring.\n",
        *table("`reference` a16w8", [label for label, _, _ in REFERENCE_VARIANTS], reference),
    ]
    for preset, rows in qnn.items():
        labels = [f"act_range_margin={m:g}" + (" (default)" if m == 1.0 else "") for m in QNN_MARGINS]
        lines += table(f"`qnn_htp` {preset}", labels, rows)
    (RESULTS / "activation_margin.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
