"""Which int4 weight-only grid a trained model wants (issue 45.3): ``python -m bench.trained.int4_grid``.

The weight-only program computes the float model with dequantized weights, so each grid is
simulated exactly by quantizing the weights in place: per group of ``group`` inputs, symmetric
(``[-8, 7]``, scale = max|w| / 7.5, torch's symmetric observer; or ``[-7, 7]``, max|w| / 7) or
asymmetric (``[-8, 7]`` with a zero point per group), with or without a clipping search (each
group's range shrunk to the fraction of ``CLIP`` with the smallest squared error), and the
embedding tables float, int8 per row or at the linears' int4 grid. Measured: test perplexity of
the trained language models (:mod:`bench.trained.tasks`). Writes ``bench/results/trained_int4_grid.md``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from bench.trained.tasks import Task, metrics, task

RESULTS = Path(__file__).resolve().parent.parent / "results"
#: clipping fractions the search tries (1.0 = min-max)
CLIP = torch.linspace(0.5, 1.0, 21)


def quantize_groups(w: torch.Tensor, group: int, scheme: str, search: bool) -> torch.Tensor:
    """``w`` [out, in] dequantized from its int4 grid, per group of ``group`` inputs."""
    out, inp = w.shape
    group = group if inp % group == 0 else inp  # a group that does not divide: per channel, as the preset
    g = w.reshape(out, inp // group, group)
    fractions = CLIP if search else torch.ones(1)
    best, best_err = g, torch.full(g.shape[:2], float("inf"))
    for r in fractions.tolist():
        if scheme == "asym":
            lo = (g.amin(-1, keepdim=True) * r).clamp(max=0)
            hi = (g.amax(-1, keepdim=True) * r).clamp(min=0)
            scale = ((hi - lo) / 15).clamp(min=1e-12)
            zero = (-8 - torch.round(lo / scale)).clamp(-8, 7)
            q = (torch.round(g / scale) + zero).clamp(-8, 7)
            deq = (q - zero) * scale
        else:
            top = g.abs().amax(-1, keepdim=True) * r
            scale = (top / (7.5 if scheme == "sym8" else 7.0)).clamp(min=1e-12)
            deq = torch.round(g / scale).clamp(-8 if scheme == "sym8" else -7, 7) * scale
        err = (deq - g).pow(2).sum(-1)
        take = err < best_err
        best = torch.where(take.unsqueeze(-1), deq, best)
        best_err = torch.where(take, err, best_err)
    return best.reshape(out, inp)


def simulated(t: Task, group: int, scheme: str, search: bool, embedding: str) -> float:
    model = copy.deepcopy(t.model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(quantize_groups(module.weight, group, scheme, search))
            elif isinstance(module, nn.LSTM):
                for name, p in module.named_parameters():
                    if name.startswith("weight"):
                        p.copy_(quantize_groups(p, group, scheme, search))
            elif isinstance(module, nn.Embedding) and embedding != "float":
                w = module.weight
                if embedding == "int8":
                    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
                    w.copy_(torch.round(w / scale).clamp(-127, 127) * scale)
                elif w.shape[1] % group == 0:
                    w.copy_(quantize_groups(w, group, scheme, search))
        logits = [model(*b) for b in t.test]
    return metrics(t, logits)["ppl"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.trained.int4_grid", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--models", nargs="+", default=["char_gpt", "lstm_lm"])
    parser.add_argument("--groups", nargs="+", type=int, default=[32, 64, 128])
    parser.add_argument("--out", default=str(RESULTS / "trained_int4_grid.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lines = [
        "# int4 weight-only grids on the trained language models\n",
        "`python -m bench.trained.int4_grid` (simulated: weights quantized in place, which is what the "
        "weight-only program computes). Δ test perplexity against float; sym8 = symmetric [-8, 7] "
        "(scale max|w|/7.5), sym7 = symmetric [-7, 7], asym = [-8, 7] with a zero point per group; "
        "search = each group's range clipped to the fraction (0.5 to 1) of least squared error.\n",
    ]
    for name in args.models:
        t = task(name)
        base = metrics(t, t.reference)["ppl"]
        lines += [
            f"## {name}: float perplexity {base:.4f}\n",
            "| group | scheme | search | emb float | emb int8 | emb int4 |",
            "|---|---|---|---|---|---|",
        ]
        for group, scheme, search in itertools.product(args.groups, ("sym8", "sym7", "asym"), (False, True)):
            cells = [
                f"{simulated(t, group, scheme, search, emb) - base:+.4f}" for emb in ("float", "int8", "int4")
            ]
            lines.append(f"| {group} | {scheme} | {'yes' if search else 'no'} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
        lines.append("")
    text = "\n".join(lines)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
