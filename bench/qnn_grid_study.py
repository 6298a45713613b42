"""Why quantplug's qnn_htp 16a4w scores below AIMET's W4 A16 on the decoder: the grids differ.

    python -m bench.qnn_grid_study

``bench/results/algorithms_weights_oracles.md`` has quantplug ``qnn_htp`` 16a4w at 15.0 dB on the
decoder and AIMET 2.42 (4-bit per-channel symmetric weights, 16-bit activations, min-max "tf"
encodings) at 20.3. That row runs the preset on ExecuTorch's QnnQuantizer grid: linear weights
per tensor (``per_channel_linear=False``, still qnn_htp's default) and moving-average min-max
activation observers (``act_observer="moving_average"``, ``act_range_margin=1``; qnn_htp's defaults
are now min-max with 16-bit grids 4 times as wide). Every run here has AIMET's
``act_range_margin=1`` unless its row says otherwise. This study measures, on the same decoder
and data:

1. per layer: each linear alone at 8-bit weights (the rest 16a4w), and each alone at 4-bit (the
   rest 16a8w): which tensor loses the most;
2. the numeric debugger's SQNR of the model input and the last linear's output;
3. the two grid options, alone and together, with and without SeqMSE (and SeqMSE+GPTQ);
4. the head's output SQNR with float inputs and round-to-nearest per-channel 4-bit weights (no
   activation quantization): the bound AIMET's default sits on.

Writes ``bench/results/qnn_grid_study.md``.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from typing import Any

import torch

import quantplug
from _quantplug.debug.compare import compare
from bench.algorithms import RESULTS
from bench.algorithms_weights_oracles import build, sqnr

HTP = {"soc_model": "SM8650"}


def main() -> int:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(2)
    started = time.perf_counter()
    model, batches = build("decoder")
    calibration, measure = batches[:8], batches[8:]
    ep = torch.export.export(model, (calibration[0],))
    with torch.no_grad():
        refs = [model(b) for b in measure]

    def quantized(
        precision: str, overrides: dict[str, str] | None = None, algs: tuple[Any, ...] = (), **o: Any
    ) -> Any:
        o = {"act_range_margin": 1.0, **o}  # AIMET's grid ends at the calibrated range
        quantizer = quantplug.get_quantizer("qnn_htp", **HTP, precision=precision, **o)
        for module, preset in (overrides or {}).items():
            config = quantplug.get_quantizer("qnn_htp", **HTP, precision=preset, **o).global_config
            quantizer.set_module_name(module, config)
        prepared = quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms(list(algs), guard=False))
        with torch.no_grad():
            for b in calibration:
                prepared(b)
        return prepared, quantplug.convert(prepared)

    def score(*args: Any, **kwargs: Any) -> float:
        _, converted = quantized(*args, **kwargs)
        with torch.no_grad():
            return sqnr(refs, [converted(b) for b in measure])

    lines = [
        "# qnn_htp 16a4w vs AIMET W4 A16 on the decoder: a grid difference\n",
        "`python -m bench.qnn_grid_study` ({minutes} min, 2 torch threads). Decoder and data of "
        "`bench/algorithms_weights_oracles.py` (8 calibration batches, SQNR dB on 4 others). AIMET 2.42 "
        "there: default 20.29, seq_mse 24.85 (4-bit per-channel symmetric weights, 16-bit min-max "
        "activations).\n",
        "## 1. Which layer loses the most (ExecuTorch's grid: per-tensor linear weights, moving average)\n",
        "| layer | only this layer at 8-bit w (rest 16a4w) | only this layer at 4-bit w (rest 16a8w) |",
        "|---|---|---|",
    ]
    layers = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    executorch = {"act_observer": "moving_average"}
    lines.append(f"| (none) | {score('16a4w', **executorch):.2f} | {score('16a8w', **executorch):.2f} |")
    for layer in layers:
        up = score("16a4w", {layer: "16a8w"}, **executorch)
        down = score("16a8w", {layer: "16a4w"}, **executorch)
        lines.append(f"| {layer} | {up:.2f} | {down:.2f} |")
        print(layer, up, down, flush=True)

    lines += [
        "\n## 2. Numeric debugger (16a8w, per node SQNR dB)\n",
        "| act_observer | model input | last linear (head) output |",
        "|---|---|---|",
    ]
    for observer in ("moving_average", "minmax"):
        prepared, converted = quantized("16a8w", act_observer=observer)
        report = compare(ep, converted, [(b,) for b in measure], prepared=prepared)
        nodes = list(report.nodes)
        first = next(n for n in nodes if n.op == "input")
        last = [n for n in nodes if n.op == "aten.linear.default"][-1]
        lines.append(f"| {observer} | {first.sqnr_db:.1f} | {last.sqnr_db:.1f} |")

    lines += [
        "\n## 3. The grid options (16a4w)\n",
        "| per_channel_linear | act_observer | act_range_margin | default | seq_mse | seq_mse+gptq | 16a8w "
        "(same options) |",
        "|---|---|---|---|---|---|---|",
    ]
    grids = [(pc, observer, 1.0) for pc in (False, True) for observer in ("moving_average", "minmax")]
    for per_channel, observer, margin in [*grids, (False, "minmax", 4.0)]:  # the last: qnn_htp's defaults
        o = {"per_channel_linear": per_channel, "act_observer": observer, "act_range_margin": margin}
        row = [
            score("16a4w", **o),
            score("16a4w", algs=("seq_mse",), **o),
            score("16a4w", algs=("seq_mse", "gptq"), **o),
            score("16a8w", **o),
        ]
        cells = " | ".join(f"{v:.2f}" for v in row)
        lines.append(f"| {per_channel} | {observer} | {margin:g} | {cells} |")
        print(o, row, flush=True)

    with torch.no_grad():
        hidden = torch.cat([model.blocks(b).reshape(-1, 64) for b in measure])
    weight = model.head.weight.detach()
    scale = weight.abs().amax(1, keepdim=True) / 7
    error = hidden @ (torch.clamp(torch.round(weight / scale), -7, 7) * scale - weight).t()
    ref = hidden @ weight.t()
    head = 10 * math.log10(float(ref.pow(2).mean() / error.pow(2).mean()))
    lines += [
        "\n## 4. The bound\n",
        f"The head alone, float inputs, round-to-nearest 4-bit per-channel weights: **{head:.2f} dB** "
        "(AIMET's default: 20.29). With the same grid as AIMET (per-channel linear weights, min-max "
        "activations) quantplug's default matches AIMET's and its SeqMSE is ahead of AIMET's 24.85 (table "
        "3; on the same [-7,7] grid AIMET's SeqMSE gives 24.54: `algorithms_weights_oracles.md`). "
        "On ExecuTorch's grid the head's 4-bit weights are per tensor (table 1: the head alone at "
        "8-bit recovers almost everything), and the moving-average observer clips the model input's "
        "outlier channels on new data (table 2), which caps 16a8w. qnn_htp's default observer is "
        "min-max since (table 3's last row, with its 16-bit margin); its linear weights stay per "
        "tensor, ExecuTorch's: `per_channel_linear=True` gives AIMET's grid, and mixed precision "
        "(lm head at 8-bit) closes the rest.\n",
    ]
    text = "\n".join(lines).replace("{minutes}", f"{(time.perf_counter() - started) / 60:.1f}")
    (RESULTS / "qnn_grid_study.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
