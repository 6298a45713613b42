"""What ``qnn_htp``'s unrolled recurrent layers cost and give, against leaving them float.

    python -m bench.recurrent_unroll

For LSTMs of a speech-model size, at ``qnn_htp`` 16a4w and 16a8w: prepare, calibration, convert
and lowering time, the ONNX file and encodings sizes, the unrolled graph's nodes and the held-out
SQNR, with ``unroll_recurrent=True`` (the default: every weight and gate quantized) and ``False``
(ExecuTorch's QnnQuantizer's behaviour: the recurrent op stays float). Writes
``bench/results/recurrent_unroll.md``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import quantplug

RESULTS = Path(__file__).parent / "results"
#: (name, layers, hidden, steps)
MODELS = (("2 x 256, 100 steps", 2, 256, 100), ("1 x 64, 500 steps", 1, 64, 500))
PRECISIONS = ("16a4w", "16a8w")


class Speech(nn.Module):
    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(40, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def measure(layers: int, hidden: int, steps: int, precision: str, unroll: bool) -> dict[str, float]:
    torch.manual_seed(0)
    model = Speech(layers, hidden).eval()
    gen = torch.Generator().manual_seed(1)
    calibration = [torch.randn(4, steps, 40, generator=gen) for _ in range(4)]
    held_out = [torch.randn(4, steps, 40, generator=gen) for _ in range(2)]
    program = torch.export.export(model, (calibration[0],))
    quantizer = quantplug.get_quantizer(
        "qnn_htp", soc_model="SM8650", precision=precision, unroll_recurrent=unroll
    )
    t0 = time.perf_counter()
    prepared = quantplug.prepare(program, quantizer)
    t1 = time.perf_counter()
    with torch.no_grad():
        for batch in calibration:
            prepared(batch)
    t2 = time.perf_counter()
    converted = quantplug.convert(prepared)
    t3 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        quantplug.lower(converted, quantizer).save(out)
        t4 = time.perf_counter()
        onnx_mb = (Path(out) / "model.onnx").stat().st_size / 2**20
        encodings_kb = (Path(out) / "model.encodings").stat().st_size / 2**10
    with torch.no_grad():
        sqnr = _sqnr(torch.cat([model(b) for b in held_out]), torch.cat([converted(b) for b in held_out]))
    return {
        "nodes": float(len(converted.graph.nodes)),
        "prepare": t1 - t0,
        "calibrate": (t2 - t1) / len(calibration),
        "convert": t3 - t2,
        "lower": t4 - t3,
        "onnx_mb": onnx_mb,
        "encodings_kb": encodings_kb,
        "sqnr": sqnr,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "recurrent_unroll.md"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    start = time.perf_counter()
    lines = [
        "| LSTM | precision | unroll_recurrent | nodes | prepare (s) | calibrate (s/batch) | convert (s) "
        "| lower (s) | ONNX (MiB) | encodings (KiB) | SQNR held out (dB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, layers, hidden, steps in MODELS:
        for precision in PRECISIONS:
            for unroll in (False, True):
                r = measure(layers, hidden, steps, precision, unroll)
                lines.append(
                    f"| {name} | {precision} | {unroll} | {r['nodes']:.0f} | {r['prepare']:.1f} | "
                    f"{r['calibrate']:.2f} | {r['convert']:.1f} | {r['lower']:.1f} | {r['onnx_mb']:.1f} | "
                    f"{r['encodings_kb']:.0f} | {r['sqnr']:.1f} |"
                )
                print(lines[-1], flush=True)
    minutes = (time.perf_counter() - start) / 60
    text = "\n".join(
        [
            "# qnn_htp's unrolled recurrent layers against float ones",
            "",
            f"`python -m bench.recurrent_unroll` ({minutes:.1f} min, torch threads 2). "
            + " ".join(__doc__.split("\n\n")[2].split()),
            "With `False` the LSTM's weights ship as float32 and run outside the quantized graph; "
            "with `True` they are 4- or 8-bit and every gate has an encoding. The unrolled ONNX "
            "file is mostly its graph: a Q/DQ pair on every tensor of every step, their names and "
            "each node's module path (lowering drops the exporter's other per-node notes, stack "
            "traces and FX text, which made the 100-step file 14.7 MiB).",
            "",
            *lines,
            "",
        ]
    )
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
