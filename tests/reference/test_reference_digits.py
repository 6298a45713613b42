"""Accuracy on real data: small models trained on scikit-learn's bundled digits (8x8 images, no
download) keep their test accuracy within one point after int8 quantization, both as the Q/DQ
program and as the ONNX Runtime artifact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantplug

datasets = pytest.importorskip("sklearn.datasets")
pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TEST_SIZE = 360


@pytest.fixture(scope="module")
def digits() -> dict[str, torch.Tensor]:
    data = datasets.load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return {
        "x_train": x[:-TEST_SIZE],
        "y_train": y[:-TEST_SIZE],
        "x_test": x[-TEST_SIZE:],
        "y_test": y[-TEST_SIZE:],
    }


class DigitsMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 1, 8, 8)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int) -> nn.Module:
    """A second or two of Adam. One thread: tiny ops gain nothing from more, and on a busy
    machine several threads per op slow training down by an order of magnitude."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    gen = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(epochs):
            order = torch.randperm(len(y), generator=gen)
            for i in range(0, len(y), 64):
                batch = order[i : i + 64]
                loss = F.cross_entropy(model(x[batch]), y[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return 100.0 * float((logits.argmax(dim=-1) == y).float().mean())


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
