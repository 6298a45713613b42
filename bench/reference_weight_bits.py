"""Accuracy of the ``reference`` backend's two weight grids for integer products.

    python -m bench.reference_weight_bits           # about 10 minutes on 2 cores

``weight_bits=7`` (the default: weights on ``[-64, 64]``, ONNX Runtime's fast U8S8 kernels, exact
on every CPU) against ``weight_bits=8`` (``[-127, 127]`` stored as uint8: ORT's U8U8 kernels,
exact too, about half as fast): the output SQNR against float of the Q/DQ program and of the ORT
artifact, on the digits models (the stored ones of ``bench.digits_weights``, with their test
accuracy) and on random-weight models (the speed bench's MLP and decoder block,
``nn.TransformerEncoder``, torchvision's resnet18 and mobilenet_v2 when torchvision imports). Writes
``bench/results/reference_weight_bits.md``. The speed side is ``bench.reference_speed
--weight-bits 7|8``.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.models import DecoderBlock
from bench.reference_speed import MLP, _randomize_bn

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "reference_weight_bits.md"


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


def _torchvision() -> Any:
    """torchvision, or None. Its 0.28.0 wheel on PyPI is a CUDA build whose C ops do not load
    with the CPU torch; the models need none of them, so their fake registrations are skipped."""
    original = torch.library.register_fake
    torch.library.register_fake = lambda *a, **k: lambda f: f  # type: ignore[assignment]
    try:
        import torchvision

        return torchvision
    except Exception:  # any import failure: the models are left out
        return None
    finally:
        torch.library.register_fake = original  # type: ignore[assignment]


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum().clamp_min(1e-300)))


def _quantize(
    model: nn.Module, example: torch.Tensor, calibration: list[torch.Tensor], **options: Any
) -> Any:
    import quantplug

    quantizer = quantplug.get_quantizer("reference", **options)
    prepared = quantplug.prepare(torch.export.export(model, (example,)), quantizer)
    with torch.no_grad():
        for x in calibration:
            prepared(x)
    converted = quantplug.convert(prepared)
    return converted, quantplug.lower(converted, quantizer)


def random_models() -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], tuple[str, ...]]]:
    models: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], tuple[str, ...]]] = {
        "bench MLP 4x1024": (MLP, (32, 1024), ("int8", "dynamic_int8")),
        "bench decoder block 512": (
            lambda: DecoderBlock(512, 8, 2048, causal=True),
            (2, 64, 512),
            ("int8", "dynamic_int8"),
        ),
        "nn.TransformerEncoder 2x128": (Encoder, (4, 32, 128), ("int8", "dynamic_int8")),
    }
    tv = _torchvision()
    if tv is not None:
        models["torchvision resnet18 96x96"] = (
            lambda: _randomize_bn(tv.models.resnet18(num_classes=100)),
            (2, 3, 96, 96),
            ("int8",),
        )
        models["torchvision mobilenet_v2 96x96"] = (
            lambda: _randomize_bn(tv.models.mobilenet_v2(num_classes=100)),
            (2, 3, 96, 96),
            ("int8",),
        )
    return models


def measure_random(
    name: str, ctor: Callable[[], nn.Module], shape: tuple[int, ...], preset: str, bits: int
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ctor().eval()
    gen = torch.Generator().manual_seed(0)
    calibration = [torch.randn(shape, generator=gen) for _ in range(8)]
    converted, artifact = _quantize(model, calibration[0], calibration, preset=preset, weight_bits=bits)
    held_out = [torch.randn(shape, generator=torch.Generator().manual_seed(100 + i)) for i in range(3)]
    with torch.no_grad():
        ref = torch.cat([model(x).flatten() for x in held_out])
        program = torch.cat([converted(x).flatten() for x in held_out])
    shipped = torch.cat([artifact.run(x).flatten() for x in held_out])
    return {
        "model": name,
        "preset": preset,
        "bits": bits,
        "program": _sqnr(ref, program),
        "artifact": _sqnr(ref, shipped),
    }


def measure_digits(bits_list: tuple[int, ...]) -> list[dict[str, Any]]:
    from bench.digits_weights import trained
    from tests.reference.digits_models import HELD_OUT, accuracy, images

    x, y = images()
    x_train, x_test, y_test = x[:-HELD_OUT], x[-HELD_OUT:], y[-HELD_OUT:]
    rows = []
    for kind in ("mlp", "cnn"):
        model = trained(kind)
        with torch.no_grad():
            ref = model(x_test)
        calibration = [x_train[i : i + HELD_OUT] for i in range(0, len(x_train) - HELD_OUT + 1, HELD_OUT)]
        for bits in bits_list:
            converted, artifact = _quantize(model, x_test, calibration, preset="int8", weight_bits=bits)
            with torch.no_grad():
                program = converted(x_test)
            shipped = artifact.run(x_test)
            rows.append(
                {
                    "model": f"digits {type(model).__name__} (accuracy: float {accuracy(ref, y_test):.2f} %)",
                    "preset": "int8",
                    "bits": bits,
                    "program": _sqnr(ref, program),
                    "artifact": _sqnr(ref, shipped),
                    "program_acc": accuracy(program, y_test),
                    "artifact_acc": accuracy(shipped, y_test),
                }
            )
    return rows


def _format(rows: list[dict[str, Any]]) -> str:
    import datetime as _dt

    import onnxruntime

    lines = [
        "# reference backend: weight_bits=7 (default) vs weight_bits=8, accuracy",
        "",
        f"{_dt.datetime.now().isoformat(timespec='seconds')}: `python -m bench.reference_weight_bits`; "
        f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}. Output SQNR against float "
        "(3 held-out batches of N(0, 1) inputs after 8 calibration batches; the digits models: their "
        "test set, calibrated on the training images) of the Q/DQ program and of the ORT artifact.",
        "",
        "| model | preset | 8-bit program | 8-bit artifact | 7-bit program | 7-bit artifact "
        "| cost of 7-bit |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    keyed = {(r["model"], r["preset"], r["bits"]): r for r in rows}
    for model, preset in dict.fromkeys((r["model"], r["preset"]) for r in rows):
        w8, w7 = keyed[(model, preset, 8)], keyed[(model, preset, 7)]

        def cell(r: dict[str, Any], key: str) -> str:
            acc = r.get(f"{key}_acc")
            return f"{r[key]:.2f} dB" + (f" ({acc:.2f} %)" if acc is not None else "")

        lines.append(
            f"| {model} | {preset} | {cell(w8, 'program')} | {cell(w8, 'artifact')} | "
            f"{cell(w7, 'program')} | {cell(w7, 'artifact')} | {w8['program'] - w7['program']:.2f} dB |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    rows = measure_digits((8, 7))
    for name, (ctor, shape, presets) in random_models().items():
        for preset in presets:
            for bits in (8, 7):
                rows.append(measure_random(name, ctor, shape, preset, bits))
                print(rows[-1], flush=True)
    text = _format(rows)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
