"""quantplug's GPTQ / SeqMSE / AdaRound side by side with NNCF 3.4 and AIMET 2.42 on the same models.

NNCF and AIMET do not share .venv (they may pull other packages; torch must stay 2.13.0), so this
runs in its own environment with torch pinned:

    python3.11 -m venv /tmp/oracles && V=/tmp/oracles/bin/python
    $V -m pip install torch==2.13.0 && $V -m pip install torchvision==0.28.0 --no-deps
    printf 'torch==2.13.0\ntorchvision==0.28.0\n' > /tmp/pins.txt
    $V -m pip install -c /tmp/pins.txt nncf==3.4.0 aimet-torch==2.42.0
    $V -m pip install torchao==0.18.0 --no-deps             # NNCF's TorchFX backend imports it
    $V -m pip install --no-deps -e . -e plugins/reference -e plugins/qnn_htp pluggy
    $V -m bench.algorithms_weights_oracles

Models: ``decoder`` (two Llama-style MLP blocks, LayerNorm + SwiGLU + residual, Gaussian weights,
inputs with a few outlier channels as LLM activations have) and ``digits`` (the MLP of
tests/reference/test_reference_digits.py, trained on scikit-learn's digits: real trained weights).
Same 8 calibration batches, SQNR on 4 others, in one run.

* NNCF ``compress_weights`` on the exported program (TorchFX; INT4_SYM, group 32, every layer,
  no backup precision) -- round to nearest, ``scale_estimation`` (its output-L2 scale search, the
  counterpart of SeqMSE), AWQ, and ``gptq`` (which NNCF 3.4 runs on OpenVINO models only) --
  against quantplug ``reference`` ``weight_only_int4`` (int4 symmetric, group 32): default,
  ``gptq``, ``seq_mse``, both.
* AIMET ``QuantizationSimModel`` (4-bit per-channel symmetric weights, 16-bit activations) -- its
  default, ``apply_seq_mse``, ``Adaround`` (500 steps per layer, as quantplug's default) -- against
  quantplug ``qnn_htp`` 16a4w: default, ``seq_mse``, ``adaround``.

The grids differ slightly (NNCF's int4 is [-8, 7] with scale max/8, ours [-8, 7] with max/7.5...):
compare each tool's gain over its own default as well as the absolute SQNR.
Writes ``bench/results/algorithms_weights_oracles.md``.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

import quantplug

RESULTS = Path(__file__).resolve().parent / "results"


class MlpBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)  # AIMET 2.42 has no quantized RMSNorm
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 192, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[MlpBlock(dim, hidden) for _ in range(layers)])
        self.head = nn.Linear(dim, 128, bias=False)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def build(name: str) -> tuple[nn.Module, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if name == "decoder":
        scale = torch.ones(64)
        scale[[3, 17, 40]] = 20.0  # outlier channels
        return Decoder().eval(), [torch.randn(4, 16, 64, generator=g) * scale for _ in range(12)]
    from bench.algorithms import build as bench_build

    model, batches = bench_build("digits_mlp")
    return model, [b[0] for b in batches]


def sqnr(refs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> float:
    signal = sum(float(r.double().pow(2).sum()) for r in refs)
    noise = sum(float((r.double() - o.double()).pow(2).sum()) for r, o in zip(refs, outs))
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def ours(
    model: nn.Module, batches: list[torch.Tensor], backend: str, algs: Sequence[str], **opts: Any
) -> float:
    calibration, measure = batches[:8], batches[8:]
    ep = torch.export.export(model, (calibration[0],))
    prepared = quantplug.prepare(ep, quantplug.get_quantizer(backend, **opts), algorithms=list(algs) or None)
    with torch.no_grad():
        for b in calibration:
            prepared(b)
        converted = quantplug.convert(prepared)
        return sqnr([model(b) for b in measure], [converted(b) for b in measure])


def nncf_run(model: nn.Module, batches: list[torch.Tensor], **flags: Any) -> float:
    import copy

    import nncf

    calibration, measure = batches[:8], batches[8:]
    # NNCF's data-aware algorithms run on TorchFX (its nn.Module backend takes no dataset options)
    program = torch.export.export(copy.deepcopy(model), (calibration[0],)).module()
    compressed = nncf.compress_weights(
        program,
        mode=nncf.CompressWeightsMode.INT4_SYM,
        ratio=1.0,
        group_size=32,
        all_layers=True,
        backup_mode=nncf.BackupMode.NONE,
        dataset=nncf.Dataset(calibration),
        subset_size=sum(b.shape[0] for b in calibration),
        **flags,
    )
    with torch.no_grad():
        return sqnr([model(b) for b in measure], [compressed(b) for b in measure])


def aimet_run(model: nn.Module, batches: list[torch.Tensor], algorithm: str) -> float:
    import copy

    from tests.torchvision_compat import ensure_importable

    ensure_importable()  # AIMET imports torchvision, whose CUDA wheel needs its op schemas here
    from aimet_common.defs import QuantScheme
    from aimet_torch.model_preparer import prepare_model
    from aimet_torch.quantsim import QuantizationSimModel

    calibration, measure = batches[:8], batches[8:]
    reference = model
    model = prepare_model(copy.deepcopy(model))  # functionals (silu, *, +) as modules, as AIMET requires
    dummy = calibration[0]

    def calibrate(m: nn.Module, _: Any = None) -> None:
        with torch.no_grad():
            for b in calibration:
                m(b)

    def make_sim(m: nn.Module) -> Any:
        return QuantizationSimModel(
            m,
            dummy_input=dummy,
            quant_scheme=QuantScheme.post_training_tf,
            default_param_bw=4,
            default_output_bw=16,
            config_file=_aimet_per_channel_config(),
        )

    if algorithm == "adaround":
        from aimet_torch.adaround.adaround_weight import Adaround, AdaroundParameters

        params = AdaroundParameters(  # quantplug's step count (AIMET's default 10,000: minutes per layer)
            data_loader=[(b, None) for b in calibration],
            num_batches=len(calibration),
            default_num_iterations=500,
        )
        with tempfile.TemporaryDirectory() as tmp:
            model = Adaround.apply_adaround(
                model,
                dummy,
                params,
                path=tmp,
                filename_prefix="ada",
                default_param_bw=4,
                default_quant_scheme=QuantScheme.post_training_tf,
                default_config_file=_aimet_per_channel_config(),
            )
            sim = make_sim(model)
            sim.set_and_freeze_param_encodings(encoding_path=str(Path(tmp) / "ada.encodings"))
    else:
        sim = make_sim(model)
        if algorithm == "seq_mse":
            from aimet_torch.seq_mse import SeqMseParams, apply_seq_mse

            apply_seq_mse(model, sim, [b for b in calibration], SeqMseParams(num_batches=len(calibration)))
    sim.compute_encodings(calibrate, None)
    with torch.no_grad():
        return sqnr([reference(b) for b in measure], [sim.model(b) for b in measure])


def _aimet_per_channel_config() -> str:
    import json

    path = Path(tempfile.gettempdir()) / "quantplug_aimet_per_channel.json"
    config = {
        "defaults": {
            "ops": {"is_output_quantized": "True"},
            "params": {"is_quantized": "True", "is_symmetric": "True"},
            "strict_symmetric": "False",
            "unsigned_symmetric": "False",
            "per_channel_quantization": "True",
        },
        "params": {"bias": {"is_quantized": "False"}},
        "op_type": {},
        "supergroups": [],
        "model_input": {"is_input_quantized": "True"},
        "model_output": {},
    }
    path.write_text(json.dumps(config))
    return str(path)


def attempt(label: str, fn: Callable[[], float], rows: list[tuple[str, str]]) -> None:
    started = time.perf_counter()
    try:
        value = f"{fn():.2f}"
    except Exception as exc:
        traceback.print_exc()
        value = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    rows.append((label, f"{value} ({time.perf_counter() - started:.1f} s)"))
    print(f"  {label}: {rows[-1][1]}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.algorithms_weights_oracles")
    parser.add_argument("--models", nargs="+", default=["decoder", "digits"], choices=["decoder", "digits"])
    parser.add_argument("--tools", nargs="+", default=["nncf", "aimet"], choices=["nncf", "aimet"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--aimet-adaround",
        action="store_true",
        help="also AIMET's Adaround (about 12 min on the decoder here, and the model it returns could "
        "not be wrapped in a QuantizationSimModel again: 'already contains quantizers')",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    text = "# quantplug's weight algorithms against NNCF and AIMET (SQNR dB vs float, held-out batches)\n\n"
    text += f"`python -m bench.algorithms_weights_oracles {' '.join(argv or [])}`".rstrip() + "\n"
    for name in args.models:
        model, batches = build(name)
        rows: list[tuple[str, str]] = []
        print(f"{name}:", flush=True)
        if "nncf" in args.tools:
            wo4 = {"preset": "weight_only_int4", "group_size": 32}
            for algs in ((), ("gptq",), ("seq_mse",), ("seq_mse", "gptq")):
                label = "quantplug reference wo_int4 g32 " + ("+".join(algs) or "default")
                attempt(label, partial(ours, model, batches, "reference", algs, **wo4), rows)
            for label, flags in (
                ("rtn", {}),
                ("scale_estimation", {"scale_estimation": True}),
                ("awq", {"awq": True}),
                ("awq+scale_estimation", {"awq": True, "scale_estimation": True}),
                ("gptq", {"gptq": True}),  # OpenVINO only in 3.4: recorded as the error it gives
            ):
                attempt(f"NNCF 3.4 INT4_SYM g32 {label}", partial(nncf_run, model, batches, **flags), rows)
        if "aimet" in args.tools:
            for algs in ((), ("seq_mse",), ("adaround",)):
                label = "quantplug qnn_htp 16a4w " + ("+".join(algs) or "default")
                attempt(label, partial(ours, model, batches, "qnn_htp", algs, precision="16a4w"), rows)
            for alg in ("default", "seq_mse", *(("adaround",) if args.aimet_adaround else ())):
                attempt(f"AIMET 2.42 W4 per-channel A16 {alg}", partial(aimet_run, model, batches, alg), rows)
        text += f"\n## {name}\n\n| run | SQNR (dB) (time) |\n|---|---|\n"
        text += "".join(f"| {label} | {value} |\n" for label, value in rows)
    out = RESULTS / "algorithms_weights_oracles.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
