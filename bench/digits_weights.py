"""The trained digits models of the algorithm benchmarks, stored so every host measures the same ones.

Training is a few hundred Adam steps whose float kernels (summation order, SIMD width, thread
count) differ between CPUs: two hosts trained weights that differ in the last bits, and the
tables' digits rows moved by up to 1.1 dB between them. The trained weights are therefore data,
committed under ``bench/data/``; this module is how they were made and how they are read:

    python -m bench.digits_weights            # retrain both and overwrite bench/data/digits_*.pt
    python -m bench.digits_weights --check    # load them and print their test accuracy

The split is the tests' (``tests/reference/test_reference_digits.py``): scikit-learn's digits in
one seeded order, the last 360 images held out, the rest to train (and to calibrate on).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from tests.reference.digits_models import HELD_OUT, DigitsCNN, DigitsMLP, accuracy, images, train

DATA = Path(__file__).parent / "data"
# kind -> training epochs: the MLP needs more passes to converge than the CNN
EPOCHS = {"mlp": 30, "cnn": 15}


def _architecture(kind: str) -> nn.Module:
    if kind not in EPOCHS:
        raise SystemExit(f"unknown digits model {kind!r}: one of {', '.join(EPOCHS)}")
    return DigitsMLP() if kind == "mlp" else DigitsCNN()


def path(kind: str) -> Path:
    return DATA / f"digits_{kind}.pt"


def trained(kind: str) -> nn.Module:
    """The stored trained model, in eval mode (``weights_only``: the file holds tensors only)."""
    model = _architecture(kind)
    file = path(kind)
    if not file.is_file():
        raise SystemExit(f"{file} is missing: run `python -m bench.digits_weights` to train it")
    model.load_state_dict(torch.load(file, weights_only=True))
    return model.eval()


def train_and_store(kind: str) -> nn.Module:
    x, y = images()
    torch.manual_seed(0)
    model = train(_architecture(kind), x[:-HELD_OUT], y[:-HELD_OUT], EPOCHS[kind])
    DATA.mkdir(exist_ok=True)
    torch.save({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, path(kind))
    return model


def held_out_accuracy(model: nn.Module) -> float:
    x, y = images()
    with torch.no_grad():
        return accuracy(model(x[-HELD_OUT:]), y[-HELD_OUT:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="load the stored models, do not retrain")
    args = parser.parse_args()
    for kind in EPOCHS:
        model = trained(kind) if args.check else train_and_store(kind)
        print(f"digits_{kind}: {path(kind)}, test accuracy {held_out_accuracy(model):.2f} %")


if __name__ == "__main__":
    main()
