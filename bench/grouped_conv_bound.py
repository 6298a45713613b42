"""What per-group Hessians add, and what is left: grouped and depthwise convolutions under GPTQ.

    python -m bench.grouped_conv_bound                                # six zoo CNNs with grouped convs
    python -m bench.grouped_conv_bound shufflenet_v2 regnet_x_400mf

A grouped convolution has one ``H`` per group of output channels; SeqMSE, AdaRound and GPTQ
collect that stack (``[G, I, I]``) and choose each group's rows on its own. Before, they left
such weights rounded to nearest. Per model: the default, GPTQ with the grouped convolutions left
to nearest rounding (a GPTQ that collects nothing for them: the old behaviour), GPTQ on every
layer, and each with the grouped convolutions kept float (``quantizer.set_filter(..., None)``),
which bounds what choosing their weights could add. Zoo models (random weights, LSUV-scaled), the
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
from _quantplug.algorithms.gptq import GPTQ
from _quantplug.algorithms.spec import WeightSite
from _quantplug.algorithms.weight_layers import LayerHessian
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


class DenseOnlyGPTQ(GPTQ):
    """GPTQ that collects nothing for grouped convolutions: they keep nearest rounding."""

    def __init__(self, grouped_nodes: frozenset[str]) -> None:
        super().__init__()
        self.grouped_nodes = grouped_nodes

    def collector(self, site: WeightSite) -> LayerHessian | None:
        return None if site.node in self.grouped_nodes else super().collector(site)


def held_out(name: str, backend: str, preset: str, gptq: str | None, grouped_float: bool) -> float:
    """SQNR held out: no algorithm, GPTQ (``"all"``) or GPTQ on the dense layers only (``"dense"``)."""
    case = harness.float_case(name)
    quantizer = harness.quantizer(backend, preset)
    if grouped_float:
        quantizer.set_filter(grouped, None)
    nodes = frozenset(n.name for n in case.program.graph.nodes if grouped(n))
    algorithm = {None: None, "all": GPTQ(), "dense": DenseOnlyGPTQ(nodes)}[gptq]
    with harness.quiet():
        prepared = quantplug.prepare(
            case.program,
            quantizer,
            algorithms=None
            if algorithm is None
            else quantplug.Algorithms([algorithm], calibration=case.calibration),
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
            cells = [
                held_out(name, backend, preset, gptq, grouped_float)
                for gptq, grouped_float in (
                    (None, False),
                    (None, True),
                    ("dense", False),
                    ("all", False),
                    ("all", True),
                )
            ]
            rows.append(
                f"| {name} | {backend} {preset} | {count} | {cells[0]:.2f} | {cells[1] - cells[0]:+.2f} "
                f"| {cells[2]:.2f} | {cells[3]:.2f} | {cells[3] - cells[2]:+.2f} "
                f"| {cells[4] - cells[3]:+.2f} |"
            )
            print(rows[-1], flush=True)
    minutes = (time.perf_counter() - started) / 60
    RESULTS.write_text(
        "# Grouped convolutions under GPTQ: what per-group Hessians add, and what is left\n\n"
        f"`python -m bench.grouped_conv_bound {' '.join(args.models)}` ({minutes:.1f} min, 2 threads). "
        "See the module's docstring for the method. SQNR in dB held out. 'GPTQ, grouped nearest': "
        "GPTQ on the dense layers only, the grouped convolutions rounded to nearest (as before "
        "per-group Hessians); 'GPTQ': on every layer, each group of a grouped convolution with its "
        "own H; 'per-group gain' is the difference. Each 'grouped float' column is the gain of "
        "keeping the grouped convolutions float over the column it follows: the most that choosing "
        "their weights could add to the default, and what is left on top of GPTQ.\n\n"
        "| model | config | grouped convs | default | grouped float | GPTQ, grouped nearest | GPTQ "
        "| per-group gain | grouped float |\n"
        "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n",
        encoding="utf-8",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
