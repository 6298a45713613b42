"""How much can a weight algorithm gain at all? Bounds at 4-bit weights, at the layers and the output.

    python -m bench.weight_bounds                       # llama, encoder, cnn, digits, lstm; 4-bit configs
    python -m bench.weight_bounds --models llama --configs "htp 16a4w"

For every linear/conv layer (and recurrent weight matrix: an LSTM's ``weight_ih``/``weight_hh``),
on the backend's own grid and the layer's calibration Hessian
``H = E[x x^T]`` (8 batches, as in :mod:`bench.algorithms_weights`), with output error
``tr(D H D^T)`` (``D`` the weight error):

* ``rtn``: round to nearest on the backend's encoding (the default);
* ``clip``: the best clipping of each scale group (SeqMSE's search, 20 candidates): what any
  choice of encoding on this grid reaches with nearest rounding;
* ``gptq``: what GPTQ with its scale search (``gptq(scale_search=20)``, the best single weight
  algorithm of ``bench/results/algorithms_weights.md``) reaches on the same objective: how much of
  the bound an algorithm takes at the layer, before errors compound through the model;
* ``feedback``: the most error feedback (GPTQ, AdaRound) can take off on top, in the high-rate
  model of rounding noise: ``AM/GM`` of the eigenvalues of ``H`` (1 % dampening, as GPTQ). RTN's
  error is ``n * AM * step^2 / 12``; sequential rounding with optimal feedback leaves
  ``sum_j L_jj^2 * step^2 / 12 >= n * GM * step^2 / 12`` (``H = L L^T``). Near-isotropic
  inputs (AM/GM near 1, random models) leave feedback nothing to exploit.

* ``shannon``: the rate-distortion bound (:func:`shannon_bound`): the least error any code of
  the weight's bits leaves on average -- its codes' ``log2(levels)`` bits plus 32 for every scale
  and zero point -- whoever chooses it: no rounding, scale search, error feedback or vector
  quantizer gets below it. Unlike ``feedback``, it needs no high-rate or noise model: it holds for
  weights drawn independently from one distribution (a randomly initialised model: all here but
  the trained digits models, for which it is indicative only), through the Shannon lower bound
  with the weights' entropy power (Vasicek's estimate).

Each layer's SQNR is ``tr(W H W^T) / error``; the first table gives the layers' mean SQNR for
each. The second carries the bound to the model's output: every layer's weight is given the error
its Shannon-bound code leaves (the test channel: independent Gaussian components of variance
``min(theta / l_i, var)`` along ``H``'s eigenvectors) and the float model is measured held out
(:func:`ideal_code_sqnr`), then with 1.53 dB more error (``CUBE_LOSS``: what a code on an integer
grid loses to the bound at high rate), each joined with what the 8-bit-weight run of the config
loses elsewhere. Where that is below the issue's goal, no code chosen layer by layer reaches it.
Writes ``bench/results/weight_bounds.md``/``.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

import quantplug
from _quantplug.algorithms.gptq import GPTQ
from _quantplug.algorithms.seq_mse import SeqMSE
from _quantplug.algorithms.spec import Algorithm, WeightChoice, WeightGrid, WeightSite
from _quantplug.algorithms.weight_layers import LayerHessian, layer_kind, matrix_and_hessian
from _quantplug.algorithms.weight_matrix import dampened, from_matrix, output_error, to_matrix
from bench.algorithm_models import build
from bench.algorithms import CONFIGS, HTP, RESULTS

MODELS = ("llama", "encoder", "cnn", "digits_mlp", "digits_cnn", "lstm")
FOUR_BIT = ("htp 16a4w", "htp 16a4w_block", "htp 8a4w", "ref wo_int4")


class OnGPTQHessians(Algorithm):
    """A measurement on the layers' calibration Hessians, collected as GPTQ collects them."""

    def __init__(self) -> None:
        self._gptq = GPTQ(scale_search=20, sequential=False)  # on the float Hessian, as the bounds

    def collector(self, site: WeightSite) -> LayerHessian | None:
        # GPTQ's own collector (the same LayerHessian), so that its scale search recognises it
        return self._gptq.collector(site) if layer_kind(site) is not None else None


class LayerBounds(OnGPTQHessians):
    """Measures, per layer, RTN's, the best clipping's and the feedback bound's output error."""

    name = "layer_bounds"

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []
        #: per weight (its attribute path): its shape, and draws of the error an ideal code at the
        #: Shannon bound leaves (as its matrix)
        self.ideal_errors: dict[str, tuple[tuple[int, ...], Callable[[torch.Generator], torch.Tensor]]] = {}
        self._seq_mse = SeqMSE()

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        found = matrix_and_hessian(site, grid, collected)
        if found is None:
            return None
        matrix, hessian = found
        h = hessian.to(torch.float64)
        w = matrix.weight
        signal = float(output_error(w, h).sum())

        def loss(g: WeightGrid) -> float:
            deq = to_matrix(g.dequantize(g.quantize(site.weight)).to(torch.float64))
            return float(output_error(w - deq, h).sum())

        rtn = loss(grid)
        clip = rtn
        if not site.shared_with:
            choice = self._seq_mse.choose_weight(site, grid, codes, hessian)
            if choice is not None and choice.scale is not None:
                zp = grid.zero_point if choice.zero_point is None else choice.zero_point
                clip = min(rtn, loss(grid.with_encoding(choice.scale, zp)))
        chosen = self._gptq.choose_weight(site, grid, codes, collected)
        gptq = rtn
        if chosen is not None and chosen.codes is not None:
            deq = grid.dequantize(chosen.codes, chosen.scale, chosen.zero_point)
            gptq = min(rtn, float(output_error(w - to_matrix(deq.to(torch.float64)), h).sum()))
        # a grouped convolution's H is block-diagonal: its eigenvalues are its groups'
        blocks = h if h.dim() == 3 else h.unsqueeze(0)
        eig = torch.cat([_eigenvalues(block) for block in blocks])
        am_gm = float(eig.mean()) / math.exp(float(eig.log().mean()))
        shannon = shannon_bound(w, blocks, grid)
        if shannon.draw_error is not None and not site.in_out:
            self.ideal_errors[site.name] = (tuple(site.weight.shape), shannon.draw_error)
        self.rows.append(
            {
                "layer": site.node,
                "shape": list(site.weight.shape),
                "rtn_db": 10 * math.log10(signal / rtn) if rtn > 0 else math.inf,
                "clip_db": 10 * math.log10(signal / clip) if clip > 0 else math.inf,
                "gptq_db": 10 * math.log10(signal / gptq) if gptq > 0 else math.inf,
                "feedback_db": 10 * math.log10(am_gm),
                "shannon_db": 10 * math.log10(signal / shannon.error) if shannon.error > 0 else math.inf,
                "bits_per_weight": shannon.bits,
                "source_db": shannon.source_db,
            }
        )
        return None


def _eigenvalues(h: torch.Tensor) -> torch.Tensor:
    live = torch.diagonal(h) > 0  # inputs no sample reached: no error there to feed back
    return torch.linalg.eigvalsh(dampened(h[live][:, live], 0.01)).clamp(min=1e-30)


#: bits a stored scale or zero point may carry (a float32): the most side information a code gets
SIDE_BITS = 32
#: how much more error a code whose reconstructions lie on a (skewed) integer lattice leaves than
#: the Shannon bound, at high rate: its cells' second moment, 1/12, over a sphere's, 1/(2 pi e)
#: (1.53 dB). Rounding on the backend's grid, with or without error feedback, is such a code.
CUBE_LOSS = 2 * math.pi * math.e / 12


class ShannonBound(NamedTuple):
    """The least output error any code of the layer's size can leave, and what it is made of."""

    error: float  # a lower bound on tr(D H D^T), in expectation over the weights' draw
    bits: float  # per weight: the grid's code bits plus the scales' and zero points' share
    source_db: float  # 10 log10(variance / entropy power) of the weights' values (0 for a Gaussian)
    #: draws the error the ideal code leaves (the rate-distortion test channel), ``[O, I]``
    draw_error: Callable[[torch.Generator], torch.Tensor] | None


def entropy_power(values: torch.Tensor) -> float:
    """``exp(2 h) / (2 pi e)`` of the values' distribution, ``h`` by Vasicek's m-spacing estimate.

    Equal to the variance for a Gaussian and 1.53 dB below it for a uniform draw (PyTorch's
    default initialisation); 0 when values repeat (a distribution with atoms: no bound)."""
    x = values.detach().to(torch.float64).flatten()
    if x.numel() > 200_000:  # a deterministic thinning: the estimate needs the shape, not every value
        x = x[:: math.ceil(x.numel() / 200_000)]
    x = x.sort().values
    n = x.numel()
    m = max(1, round(math.sqrt(n) / 2))
    index = torch.arange(n)
    spacing = x[(index + m).clamp(max=n - 1)] - x[(index - m).clamp(min=0)]
    if bool((spacing <= 0).any()):
        return 0.0
    h = float(torch.log(spacing * n / (2 * m)).mean())
    return math.exp(2 * h) / (2 * math.pi * math.e)


def shannon_bound(matrix: torch.Tensor, blocks: torch.Tensor, grid: WeightGrid) -> ShannonBound:
    """The rate-distortion bound on ``tr(D H D^T)`` for a weight coded in the grid's bits.

    A weight stored as codes of ``log2(levels)`` bits plus its scales and zero points (at most
    ``SIDE_BITS`` each) is a code of ``R`` bits per weight, whatever algorithm picks them. For
    weights drawn independently from one distribution (a randomly initialised model; for
    trained weights, as the digits models', it is indicative only), the Shannon lower bound on
    the rate-distortion function of the error weighted by ``H`` (eigenvalues ``l_i``, on the
    ``k`` inputs the data reaches; the ``n - k`` others cost bits and matter to no output) is, per
    row and Hessian block,
    ``k * GM(l) * N * 2^(-2 R n / k)``: ``N`` the entropy power of the weights' values, ``GM``
    the geometric mean. No rounding, scale search, error feedback or vector quantizer on those
    bits leaves less error on average. The ideal code's error is the test channel's: independent
    Gaussian components of variance ``min(theta / l_i, var)`` along ``H``'s eigenvectors.
    """
    levels = grid.quant_max - grid.quant_min + 1
    side = grid.scale.numel() + (0 if grid.symmetric else grid.zero_point.numel())
    bits = math.log2(levels) + SIDE_BITS * side / max(matrix.numel(), 1)
    variance = float(matrix.pow(2).mean())
    power = entropy_power(matrix)
    if power <= 0 or variance <= 0:
        return ShannonBound(0.0, bits, math.inf, None)
    source_db = 10 * math.log10(variance / power)
    rows = matrix.shape[0] // blocks.shape[0]
    error, channels = 0.0, []  # per block: each live component's error spread, and its direction
    for block in blocks:
        values, vectors = torch.linalg.eigh(block.to(torch.float64))
        live = values > values.max().clamp(min=0) * 1e-12
        k = int(live.sum())
        values, vectors = values[live], vectors[:, live]
        if k:
            theta = math.exp(float(values.log().mean())) * power * 2 ** (-2 * bits * block.shape[0] / k)
            error += rows * k * theta
            values = torch.minimum(theta / values, torch.tensor(variance, dtype=torch.float64))
        channels.append((values.sqrt(), vectors))

    def draw_error(generator: torch.Generator) -> torch.Tensor:
        return torch.cat(
            [
                (torch.randn(rows, len(spread), generator=generator, dtype=torch.float64) * spread)
                @ vectors.T
                for spread, vectors in channels
            ]
        )

    return ShannonBound(error, bits, source_db, draw_error)


def ideal_code_sqnr(
    prepared: torch.nn.Module,
    errors: dict[str, tuple[tuple[int, ...], Callable[[torch.Generator], torch.Tensor]]],
    measure: Sequence[tuple[torch.Tensor, ...]],
    refs: Sequence[torch.Tensor],
    power: float = 1.0,
    draws: int = 3,
) -> float:
    """The model's output SQNR with every measured layer's weight off by its ideal code's error,
    activations in float and the other weights exact: what per-layer codes at the Shannon bound
    give at the output when nothing else is quantized (the observers only watch). ``power``
    scales the errors' power; noise powers are averaged over ``draws`` draws of the errors."""
    weights = {}
    for name in errors:
        *path, leaf = name.split(".")
        weights[name] = getattr(prepared.get_submodule(".".join(path)) if path else prepared, leaf)
    exact = {name: weight.detach().clone() for name, weight in weights.items()}
    generator = torch.Generator().manual_seed(0)
    signal, noise = 0.0, 0.0
    with torch.no_grad():
        for _ in range(draws):
            for name, (shape, draw_error) in errors.items():
                error = from_matrix(draw_error(generator), shape) * math.sqrt(power)
                weights[name].copy_(exact[name] + error.to(exact[name].dtype))
            outs = [prepared(*batch) for batch in measure]
            signal += sum(float(r.double().pow(2).sum()) for r in refs)
            noise += sum(float((r.double() - o.double()).pow(2).sum()) for r, o in zip(refs, outs))
        for name, weight in weights.items():
            weight.copy_(exact[name])
    return 10 * math.log10(signal / noise)


def bounds(name: str, config: str) -> dict[str, Any]:
    model, batches = build(name)
    calibration = batches[:8]
    ep = torch.export.export(model, calibration[0])
    backend, options, _ = CONFIGS[config]
    opts = {**(HTP if backend == "qnn_htp" else {}), **options}
    measure = LayerBounds()
    quantizer = quantplug.get_quantizer(backend, **opts)  # unguarded: it measures, it chooses nothing
    prepared = quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms([measure], guard=False))
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    quantplug.convert(prepared)
    held_out = batches[8:]
    with torch.no_grad():
        refs = [model(*batch) for batch in held_out]
    # the same rewrites (an algorithm given), so the weights have the names the sites gave
    float_twin = quantplug.prepare(
        ep, quantizer, algorithms=quantplug.Algorithms([LayerBounds()], guard=False)
    )
    ideal = ideal_code_sqnr(float_twin, measure.ideal_errors, held_out, refs)
    on_grid = ideal_code_sqnr(float_twin, measure.ideal_errors, held_out, refs, power=CUBE_LOSS)
    rows = [r for r in measure.rows if math.isfinite(r["rtn_db"])]
    if not rows:
        return {"layers": []}
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return {
        "layers": measure.rows,
        "rtn_db": mean("rtn_db"),
        "clip_db": mean("clip_db"),
        "gptq_db": mean("gptq_db"),
        "feedback_db": mean("feedback_db"),
        "bound_gain_db": mean("clip_db") + mean("feedback_db") - mean("rtn_db"),
        "shannon_db": mean("shannon_db"),
        "ideal_code_output_db": ideal,
        "ideal_grid_code_output_db": on_grid,
    }


def _with_error_of(sqnr_db: float, other_db: float) -> float:
    """The SQNR of two independent errors together (their powers add)."""
    return -10 * math.log10(10 ** (-sqnr_db / 10) + 10 ** (-other_db / 10))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.weight_bounds")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--configs", nargs="+", default=list(FOUR_BIT), choices=list(CONFIGS))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    measured_path = RESULTS / "algorithms.json"
    measured = json.loads(measured_path.read_text()) if measured_path.exists() else {}
    results: dict[str, Any] = {}
    for name in args.models:
        results[name] = {}
        for config in args.configs:
            results[name][config] = found = bounds(name, config)
            print(name, config, {k: round(v, 2) for k, v in found.items() if k != "layers"}, flush=True)
    lines = [
        "# Bounds on what weight algorithms can gain at 4-bit weights\n",
        f"`python -m bench.weight_bounds {' '.join(sys.argv[1:] if argv is None else argv)}` "
        f"({(time.perf_counter() - started) / 60:.1f} min); method in the module's docstring.\n",
        "## At the layers\n",
        "Layer SQNR = tr(W H W^T) / tr(D H D^T) on the calibration Hessian, mean over the model's "
        "linear/conv layers and recurrent weight matrices. rtn: the default; clip: best clipping per "
        "scale group (any encoding on this grid, nearest rounding); feedback: AM/GM of eig(H), the "
        "most error feedback (GPTQ/AdaRound) removes on top; high-rate bound = clip + feedback - rtn "
        "(1 % dampening, noise-like rounding); gptq: the layer SQNR gptq(scale_search=20) reaches on "
        "the same Hessian, and its share of that bound; Shannon: the rate-distortion bound, what no "
        "code of the weight's bits (codes, scales and zero points) beats on average, whatever "
        "chooses it. measured: the best model output gain of `bench/results/algorithms.md` (every "
        "algorithm and combination; same models and data).\n",
        "| model | config | layers | rtn | clip | feedback | high-rate bound on gain | gptq at the layers | "
        "Shannon | Shannon bound on gain | measured best gain | goal: max(3, half the gap to 8-bit w) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    output_lines = [
        "\n## At the output\n",
        "ideal code: the model's held-out output SQNR with every layer's weight off by the error of "
        "its Shannon-bound code (the rate-distortion test channel; noise power over 3 draws), "
        "activations float and nothing else quantized. with the 8-bit-weight run's error: that noise "
        "added to what the 8-bit-weight run of the same config loses (activations, embeddings; "
        "independent errors add). on the grid: the same with 1.53 dB more error, the least a code "
        "whose values lie on the backend's integer grid leaves (its cells are cubes, not spheres; "
        "high-rate). A code chosen layer by layer (SeqMSE, AdaRound, GPTQ and their combinations, "
        "float or sequential inputs) does no better on average; only errors made to cancel across "
        "layers could, and the sequential runs (`algorithms_weights_sequential.md`), which let a "
        "layer answer the error of those before it, gain no more than float inputs on these models. "
        "goal: the output SQNR the issue asks for, default + max(3, half the gap to 8-bit weights).\n",
        "| model | config | default | measured best | 8-bit w | goal | ideal code | ideal code, with the "
        "8-bit-weight run's error | the same on the grid (+1.53 dB error) | goal within reach of |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, per_config in results.items():
        for config, found in per_config.items():
            if not found["layers"]:
                continue
            runs = measured.get(name, {}).get(config, {})
            row = runs.get("runs") or {}
            default = row.get("default", {}).get("sqnr")
            best = max((v["sqnr"] for v in row.values() if isinstance(v, dict) and "sqnr" in v), default=None)
            w8 = runs.get("w8")
            goal_gain = (
                None if default is None or best is None or w8 is None else max(3.0, (w8 - default) / 2)
            )
            gain = "-" if goal_gain is None else f"{best - default:+.1f}"
            lines.append(
                f"| {name} | {config} | {len(found['layers'])} | {found['rtn_db']:.1f} | "
                f"{found['clip_db']:.1f} | +{found['feedback_db']:.1f} | "
                f"+{found['bound_gain_db']:.1f} | {found['gptq_db']:.1f} "
                f"({(found['gptq_db'] - found['rtn_db']) / found['bound_gain_db']:.0%}) | "
                f"{found['shannon_db']:.1f} | +{found['shannon_db'] - found['rtn_db']:.1f} | {gain} | "
                + ("-" if goal_gain is None else f"+{goal_gain:.1f}")
                + " |"
            )
            if goal_gain is None:
                continue
            ideal = found["ideal_code_output_db"]
            with_w8 = _with_error_of(ideal, w8)
            on_grid = _with_error_of(found["ideal_grid_code_output_db"], w8)
            goal = default + goal_gain
            reach = (
                "a grid code"
                if on_grid >= goal
                else "only a code off the grid"
                if with_w8 >= goal
                else "no code"
            )
            output_lines.append(
                f"| {name} | {config} | {default:.1f} | {best:.1f} | {w8:.1f} | {goal:.1f} | {ideal:.1f} | "
                f"{with_w8:.1f} | {on_grid:.1f} | {reach} |"
            )
    lines += output_lines
    (RESULTS / "weight_bounds.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "weight_bounds.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
