"""Where a mixture-of-experts model's int4 error comes from: its experts' weights or its routes.

    python -m bench.experts_error                     # the zoo's Mixtral
    python -m bench.experts_error mixtral qwen2_moe

Since the experts became weight-algorithm layers (``quantplug/algorithms/experts.py``), GPTQ
chooses each expert's rows with that expert's own Hessian. On the zoo's random-weight MoE models
the output barely moved, so this measures, at ``reference`` weight_only_int4, on one held-out
batch:

- the SQNR of each experts product (``bmm``) against float, by default and with GPTQ, the guard
  off (``compare``, per node);
- the share of tokens the quantized router sends to another set of experts than float's (each
  ``topk``'s indices, compared as sets).

Prints one line per product and per router; nothing is written.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node

import quantplug
from _quantplug.debug.compare import compare
from tests.zoo.harness import float_case, quantizer, quiet, run


class _Routes(Interpreter):
    """Runs a program and keeps every ``topk``'s indices, by node name."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self.routes: dict[str, torch.Tensor] = {}

    def run_node(self, n: Node) -> Any:
        result = super().run_node(n)
        if n.op == "call_function" and n.target == torch.ops.aten.topk.default:
            self.routes[n.name] = result[1].sort(-1).values
        return result


def _routes(gm: GraphModule, batch: tuple[Any, ...]) -> dict[str, torch.Tensor]:
    interpreter = _Routes(gm)
    with torch.no_grad():
        interpreter.run(*batch)
    return interpreter.routes


def measure(name: str) -> None:
    case = float_case(name)
    q = quantizer("reference", "weight_only_int4")
    products: dict[str, dict[str, float | None]] = {}
    converted = {}
    for label, algorithms in (("default", None), ("gptq", ["gptq"])):
        with quiet():
            prepared = quantplug.prepare(
                case.program,
                q,
                algorithms=quantplug.Algorithms(algorithms, guard=False, calibration=case.calibration),
            )
            run(prepared, case.calibration)
            converted[label] = quantplug.convert(prepared)
        report = compare(case.program, converted[label], case.held_out)
        for node in report.nodes:
            if node.node.startswith("bmm"):
                products.setdefault(node.node, {})[label] = node.sqnr_db
    for product, sqnr in products.items():
        cells = " ".join(f"{label} {value:.2f}" for label, value in sqnr.items() if value is not None)
        print(f"{name:12} {product:8} SQNR against float (dB): {cells}", flush=True)
    batch = case.held_out[0]
    float_routes = _routes(case.program.module(), batch)
    quantized_routes = _routes(converted["default"], batch)
    for router, chosen in float_routes.items():
        if router in quantized_routes:
            moved = (chosen != quantized_routes[router]).any(-1).float().mean()
            print(f"{name:12} {router:8} tokens sent to another set of experts: {float(moved):.1%}")


def main(argv: list[str]) -> int:
    torch.set_num_threads(2)
    for name in argv or ["mixtral"]:
        measure(name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
