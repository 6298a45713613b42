"""Accuracy on real data: small models trained on scikit-learn's bundled digits (8x8 images, no
download) keep their test accuracy within one point after int8 quantization, both as the Q/DQ
program and as the ONNX Runtime artifact."""

from __future__ import annotations

import pytest
import torch

import quantplug
from tests.reference.digits_models import HELD_OUT, DigitsCNN, DigitsMLP, accuracy, images, train

pytest.importorskip("sklearn.datasets")
pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TEST_SIZE = HELD_OUT


@pytest.fixture(scope="module")
def digits() -> dict[str, torch.Tensor]:
    x, y = images()
    return {
        "x_train": x[:-TEST_SIZE],
        "y_train": y[:-TEST_SIZE],
        "x_test": x[-TEST_SIZE:],
        "y_test": y[-TEST_SIZE:],
    }


@pytest.mark.parametrize(("ctor", "epochs"), [(DigitsMLP, 30), (DigitsCNN, 12)], ids=["mlp", "cnn"])
def test_int8_keeps_digits_accuracy_within_one_point(digits, ctor, epochs: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = train(ctor(), digits["x_train"], digits["y_train"], epochs)
    x_test, y_test = digits["x_test"], digits["y_test"]
    with torch.no_grad():
        float_acc = accuracy(model(x_test), y_test)
    assert float_acc > 93, float_acc  # the model learned the task

    # shapes are fixed at export: the program (and the ONNX model) take the whole test set at once
    ep = torch.export.export(model, (x_test,))
    quantizer = quantplug.get_quantizer("reference", preset="int8")
    prepared = quantplug.prepare(ep, quantizer)
    x_train = digits["x_train"]
    with torch.no_grad():
        for i in range(0, len(x_train) - TEST_SIZE + 1, TEST_SIZE):  # calibration: training images
            prepared(x_train[i : i + TEST_SIZE])
    quantized = quantplug.convert(prepared)
    artifact = quantplug.lower(quantized, quantizer)

    with torch.no_grad():
        qdq_acc = accuracy(quantized(x_test), y_test)
    ort_acc = accuracy(artifact.run(x_test), y_test)
    assert abs(qdq_acc - float_acc) <= 1.0, (float_acc, qdq_acc)
    assert abs(ort_acc - float_acc) <= 1.0, (float_acc, ort_acc)
