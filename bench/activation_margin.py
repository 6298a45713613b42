"""Activation ranges on the zoo: the scale floor, the range margin (observers' ``range_margin``) and
qnn_htp's activation observer.

    python -m bench.activation_margin            # the zoo's 17 models, about 5 minutes on 2 cores

Every zoo model quantized as ``tests/zoo`` does (calibrated on its 2 batches, the program's SQNR
against float on its 4 held-out batches, one torch thread):

1. ``reference`` a16w8. Each variant sets the two module constants ``build_config`` reads
   (``quantplug_reference.configs.ACTIVATION_EPS`` and ``ACTIVATION_MARGIN_16BIT``):

   * ``floor 2**-12``: the scale floored at ``2**-12`` (XNNPACK's), no margin: what a16w8 did until
     the margin replaced it (a 16-bit tensor's range was at least 65535 * 2**-12 = 16, whatever
     calibration saw: a margin by accident, and too coarse a grid for narrow tensors);
   * ``margin k``: float32's eps as the floor, the grid covering ``k`` times the calibrated range.

2. ``qnn_htp`` with the ``act_observer`` and ``act_range_margin`` options: ExecuTorch's
   defaults (``moving_average``, margin 1), each change alone, and qnn_htp's defaults
   (``minmax``, margin 4), at 16a8w and 16a4w; at 8a8w and 8a4w (no margin on 8-bit grids) the
   two observers.

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
#: ``qnn_htp`` (act_observer, act_range_margin) variants per preset; the first is ExecuTorch's
_SIXTEEN_BIT = (
    ("moving_average", 1.0),
    ("moving_average", 4.0),
    ("minmax", 1.0),
    ("minmax", 4.0),
    ("minmax", 8.0),
)
_EIGHT_BIT = (("moving_average", 1.0), ("minmax", 1.0))
QNN_VARIANTS: dict[str, tuple[tuple[str, float], ...]] = {
    "16a8w": _SIXTEEN_BIT,
    "16a4w": _SIXTEEN_BIT,
    "8a8w": _EIGHT_BIT,
    "8a4w": _EIGHT_BIT,
}


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


def _label(observer: str, margin: float, preset: str) -> str:
    from quantplug_qnn_htp.configs import DEFAULT_ACT_OBSERVER, DEFAULT_ACT_RANGE_MARGIN

    sixteen = preset.startswith("16a")
    label = f"{observer}, margin {margin:g}" if sixteen else observer
    if (observer, margin) == ("moving_average", 1.0):
        return label + " (ExecuTorch's)"
    if observer == DEFAULT_ACT_OBSERVER and (margin == DEFAULT_ACT_RANGE_MARGIN or not sixteen):
        return label + " (default)"
    return label


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
            name: [_measure(name, "qnn_htp", preset, act_observer=o, act_range_margin=m) for o, m in variants]
            for name in args.models
        }
        for preset, variants in QNN_VARIANTS.items()
    }
    lines = [
        "# Activation ranges on the zoo: the scale floor, the range margin and the observer\n",
        f"`python -m bench.activation_margin` ({(time.perf_counter() - started) / 60:.1f} min, one torch "
        "thread). SQNR (dB) of the program against float on the zoo's held-out batches, calibrated on "
        "its 2 batches; variants in the module's docstring.\n",
        *table("`reference` a16w8", [label for label, _, _ in REFERENCE_VARIANTS], reference),
    ]
    for preset, rows in qnn.items():
        labels = [_label(o, m, preset) for o, m in QNN_VARIANTS[preset]]
        lines += table(f"`qnn_htp` {preset}", labels, rows)
    (RESULTS / "activation_margin.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
