"""The best codes a short layer can have on its grid, found by exhaustive search, and what they give.

    python -m bench.exhaustive_rounding                                  # digits_cnn at qnn_htp 16a4w(_block)
    python -m bench.exhaustive_rounding --models digits_cnn --configs "htp 16a4w"

Where a layer's rows are short (a first convolution on one channel: 9 weights a filter), the best
codes on the backend's grid are not a matter of approximation: for each output channel and each of
``--scales`` factors of its range (0.3 to 1.6), a sphere decoder (Schnorr-Euchner enumeration,
:func:`closest_codes`) finds the integer codes in ``[quant_min, quant_max]`` that minimise the
layer's output error ``(w - s q)^T H (w - s q)`` on the calibration Hessian; the best factor's scale
goes through the backend's own observer (:meth:`WeightGrid.observe`), and the codes are searched
again on the scale it gives. No rounding algorithm on that grid, SeqMSE, AdaRound or GPTQ, can
leave less error at the layer (up to the factors tried).

For each model and config it prints the output SQNR, held out, of ``gptq(scale_search=20) +
bias_correction`` (the best combination of ``bench/results/algorithms.md`` on the digits CNN), the
same with the short layers' exhaustive codes chosen between the two, and the same with the short
layers kept float, and the layer SQNR of GPTQ's codes and of the exhaustive ones. Writes
``bench/results/exhaustive_rounding.md``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

import quantplug
from _quantplug.algorithms.spec import WeightChoice, WeightGrid, WeightSite
from _quantplug.algorithms.weight_layers import matrix_and_hessian
from bench.algorithm_models import build
from bench.algorithms import CONFIGS, HTP, RESULTS, sqnr
from bench.weight_bounds import OnGPTQHessians

#: rows at most this long are searched exhaustively
SHORT_ROW = 12
#: the best combination on the digits CNN (bench/results/algorithms.md)
BEST = [("gptq", {"scale_search": 20}), "bias_correction"]


def closest_codes(
    factor: torch.Tensor, target: torch.Tensor, low: int, high: int, start: torch.Tensor, node_limit: int
) -> tuple[torch.Tensor, float, bool]:
    """Integer ``q`` in ``[low, high]^n`` minimising ``|R (q - target)|^2`` (``R`` upper triangular).

    Depth-first from the last coordinate, candidates in order of distance from each one's
    centre, pruned by the best so far (which ``start`` seeds). Returns the codes, their error and
    whether the search finished (False: ``node_limit`` nodes were visited first).
    """
    n = target.numel()
    r = factor.tolist()
    y = target.tolist()
    q = [0] * n

    def centre(k: int) -> float:
        """Where coordinate ``k``'s error is least, given the coordinates after it in ``q``."""
        return y[k] - sum(r[k][j] * (q[j] - y[j]) for j in range(k + 1, n)) / r[k][k]

    for k in range(n - 1, -1, -1):  # Babai's nearest plane: a tighter first bound than ``start``
        q[k] = min(max(round(centre(k)), low), high)
    seeds = [[int(v) for v in start.tolist()], list(q)]
    errors = [float((factor @ (torch.tensor(c, dtype=torch.float64) - target)).pow(2).sum()) for c in seeds]
    best: list[Any] = [min(errors), seeds[errors.index(min(errors))]]
    visited = [0]

    def descend(k: int, partial: float) -> None:
        visited[0] += 1
        if visited[0] > node_limit:
            return
        c = centre(k)
        for v in sorted(range(low, high + 1), key=lambda v: abs(v - c)):
            total = partial + (r[k][k] * (v - c)) ** 2
            if total >= best[0]:
                break
            q[k] = v
            if k == 0:
                best[0], best[1] = total, list(q)
            else:
                descend(k - 1, total)

    descend(n - 1, 0.0)
    return torch.tensor(best[1], dtype=torch.float64), best[0], visited[0] <= node_limit


class ExhaustiveRounding(OnGPTQHessians):
    """The exhaustive codes (and scales) of layers whose rows are at most ``SHORT_ROW`` long."""

    name = "exhaustive_rounding"

    def __init__(self, scales: int, node_limit: int) -> None:
        super().__init__()
        self.scales = scales
        self.node_limit = node_limit
        self.rows: list[dict[str, Any]] = []

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        found = matrix_and_hessian(site, grid, collected)
        if found is None or site.shared_with or grid.granularity != "channel":
            return None
        matrix, hessian = found
        if hessian.dim() != 2 or matrix.weight.shape[1] > SHORT_ROW:
            return None
        h = hessian.to(torch.float64)
        factor = torch.linalg.cholesky(
            h + 1e-12 * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
        ).T
        w = matrix.weight
        low, high = grid.quant_min, grid.quant_max
        shape = site.weight.shape

        def scales_for(factor_: torch.Tensor) -> torch.Tensor:
            """The per-row scales the backend's observer gives the weight's rows times ``factor_``
            (a factor under 1 narrows the row's range, over 1 widens it)."""
            scale, _ = grid.observe((w * factor_.unsqueeze(1)).reshape(shape).to(site.weight.dtype))
            return grid.expand(scale.to(torch.float64), shape).reshape(w.shape)[:, 0]

        def search(row: int, s: float) -> tuple[torch.Tensor, float, bool]:
            target = w[row] / s
            q, error, done = closest_codes(
                factor, target, low, high, target.round().clamp(low, high), self.node_limit
            )
            return q, error * s * s, done

        complete = True
        best = torch.full((w.shape[0],), math.inf, dtype=torch.float64)
        clip = torch.ones(w.shape[0], dtype=torch.float64)
        for f in torch.linspace(0.3, 1.6, self.scales, dtype=torch.float64).tolist():
            candidate = scales_for(torch.full((w.shape[0],), f, dtype=torch.float64))
            for row in range(w.shape[0]):
                _, error, done = search(row, float(candidate[row]))
                complete &= done
                if error < best[row]:
                    best[row], clip[row] = error, f
        scale, _ = grid.observe((w * clip.unsqueeze(1)).reshape(shape).to(site.weight.dtype))
        expanded = grid.expand(scale.to(torch.float64), shape).reshape(w.shape)
        chosen = torch.empty_like(w)
        for row in range(w.shape[0]):
            chosen[row], _, done = search(row, float(expanded[row, 0]))
            complete &= done

        def layer_db(q: torch.Tensor, s: torch.Tensor) -> float:
            delta = w - q * s
            return 10 * math.log10(float((w @ h * w).sum()) / float((delta @ h * delta).sum()))

        self.rows.append(
            {
                "layer": site.node,
                "shape": list(shape),
                "before_db": layer_db(matrix.matrix_of(codes.to(torch.float64)), matrix.scale),
                "exhaustive_db": layer_db(chosen, expanded),
                "complete": complete,
            }
        )
        return WeightChoice(codes=chosen.reshape(site.weight.shape).to(torch.int64), scale=scale)


def run(name: str, config: str, scales: int, node_limit: int) -> dict[str, Any]:
    model, batches = build(name)
    calibration, measure = batches[:8], batches[8:]
    ep = torch.export.export(model, calibration[0])
    with torch.no_grad():
        refs = [model(*batch) for batch in measure]
    backend, options, _ = CONFIGS[config]
    opts = {**(HTP if backend == "qnn_htp" else {}), **options}
    exhaustive = ExhaustiveRounding(scales, node_limit)

    def output(algorithms: Sequence[Any], keep_float: Sequence[str] = ()) -> float:
        quantizer = quantplug.get_quantizer(backend, **opts)
        for node in keep_float:
            quantizer.set_node_name(node, None)
        prepared = quantplug.prepare(
            ep, quantizer, algorithms=quantplug.Algorithms(list(algorithms), guard=False)
        )
        with torch.no_grad():
            for batch in calibration:
                prepared(*batch)
        converted = quantplug.convert(prepared)
        with torch.no_grad():
            return sqnr(refs, [converted(*batch) for batch in measure])

    with_exhaustive = output([*BEST[:1], exhaustive, *BEST[1:]])
    short = [row["layer"] for row in exhaustive.rows]
    return {
        "layers": exhaustive.rows,
        "best_combination": output(BEST),
        "with_exhaustive": with_exhaustive,
        "short_layers_float": output(BEST, short) if short else math.nan,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.exhaustive_rounding")
    parser.add_argument("--models", nargs="+", default=["digits_cnn"])
    parser.add_argument(
        "--configs", nargs="+", default=["htp 16a4w", "htp 16a4w_block"], choices=list(CONFIGS)
    )
    parser.add_argument(
        "--scales",
        type=int,
        default=36,
        help="range factors tried per channel (0.3 to 1.6)",
    )
    parser.add_argument("--node-limit", type=int, default=200_000, help="search nodes per channel and factor")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows: list[str] = []
    for name in args.models:
        for config in args.configs:
            found = run(name, config, args.scales, args.node_limit)
            for row in found["layers"]:
                rows.append(
                    f"| {name} | {config} | {found['best_combination']:.1f} | "
                    f"{found['with_exhaustive']:.1f} | {found['short_layers_float']:.1f} | "
                    f"{row['layer']} {row['shape']} | {row['before_db']:.1f} | {row['exhaustive_db']:.1f} | "
                    f"{'yes' if row['complete'] else 'no'} |"
                )
                print(rows[-1], flush=True)
    lines = [
        "# The best codes of short layers on their grid (exhaustive search), and what they give\n",
        f"`python -m bench.exhaustive_rounding {' '.join(sys.argv[1:] if argv is None else argv)}` "
        f"({(time.perf_counter() - started) / 60:.1f} min); method in the module's docstring.\n",
        "Output SQNR (dB, held out) with `gptq(scale_search=20) + bias_correction` (the best "
        "combination), the same with the short layers' exhaustive codes and scales between the two, "
        "and with the short layers float; layer SQNR on the calibration Hessian.\n",
        "| model | config | best combination | with exhaustive codes | short layers float | layer | "
        "gptq at the layer | exhaustive at the layer | search complete |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    (RESULTS / "exhaustive_rounding.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
