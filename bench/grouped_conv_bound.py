"""How much could per-group Hessians add? Grouped and depthwise convolutions left float, measured.

    python -m bench.grouped_conv_bound                                # six zoo CNNs with grouped convs
    python -m bench.grouped_conv_bound shufflenet_v2 regnet_x_400mf

SeqMSE, AdaRound and GPTQ need one ``H`` per layer, and a grouped convolution has one per group:
they leave its weights rounded to nearest. Quantizing every other op as usual but keeping the
grouped convolutions float (``quantizer.set_filter(..., None)``) bounds what choosing their
weights could add, with and without GPTQ on the rest. Zoo models (random weights, LSUV-scaled), the
zoo's 2 calibration and 4 held-out batches, ``qnn_htp`` 16a4w and ``reference`` weight-only int4
(which leaves grouped convolutions float already); SQNR in dB, held out. At ``qnn_htp`` the float
convolutions also keep float activations, so the bound is loose by what 16-bit activations cost
there. Writes ``bench/results/grouped_conv_bound.md``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
from torch.fx import Node

import quantplug
from tests.zoo import harness
from tests.zoo.algorithms_sweep import CONFIGS

MODELS = (
    "mobilenet_v2",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "shufflenet_v2",
    "convnext",
    "regnet_x_400mf",
)
RESULTS = Path(__file__).parent / "results" / "grouped_conv_bound.md"


def grouped(node: Node) -> bool:
    """A convolution with more than one group (depthwise included)."""
    return (
        node.op == "call_function"
        and "conv" in str(node.target)
        and len(node.args) > 6
        and isinstance(node.args[6], int)
        and node.args[6] > 1
    )


def held_out(name: str, backend: str, preset: str, gptq: bool, grouped_float: bool) -> float:
    case = harness.float_case(name)
    quantizer = harness.quantizer(backend, preset)
    if grouped_float:
        quantizer.set_filter(grouped, None)
    with harness.quiet():
        prepared = quantplug.prepare(
            case.program,
            quantizer,
            algorithms=["gptq"] if gptq else None,
            calibration=case.calibration if gptq else None,
        )
        harness.run(prepared, case.calibration)
        converted = quantplug.convert(prepared)
    return harness.sqnr(case.reference, harness.run(converted, case.held_out))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grouped_conv_bound")
    parser.add_argument("models", nargs="*", default=list(MODELS))
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    logging.getLogger("quantplug.algorithms").setLevel(logging.ERROR)
    started = time.perf_counter()
    rows = []
    for name in args.models:
        count = sum(1 for n in harness.float_case(name).program.graph.nodes if grouped(n))
        for backend, preset in CONFIGS:
            cells = [held_out(name, backend, preset, g, f) for g in (False, True) for f in (False, True)]
            rows.append(
                f"| {name} | {backend} {preset} | {count} | {cells[0]:.2f} | {cells[1] - cells[0]:+.2f} "
                f"| {cells[2]:.2f} | {cells[3] - cells[2]:+.2f} |"
            )
            print(rows[-1], flush=True)
    minutes = (time.perf_counter() - started) / 60
    RESULTS.write_text(
        "# Grouped convolutions left float: what per-group Hessians could add\n\n"
        f"`python -m bench.grouped_conv_bound {' '.join(args.models)}` ({minutes:.1f} min, 2 threads). "
        "See the module's docstring for the method. SQNR in dB held out; each 'grouped float' "
        "column is the gain over the column before it: the most that choosing the grouped "
        "convolutions' weights could add to the default, and to GPTQ on the other layers.\n\n"
        "| model | config | grouped convs | default | grouped float | GPTQ | grouped float |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n",
        encoding="utf-8",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
