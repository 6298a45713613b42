"""The models of the algorithm benchmarks (torch only: ``bench.nncf_compare`` imports them in a
venv without quantplug). Random weights unless said; every batch seeded."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.b1 = nn.BatchNorm2d(32)
        self.c2 = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.b2 = nn.BatchNorm2d(32)
        self.c3 = nn.Conv2d(32, 64, 1)
        self.b3 = nn.BatchNorm2d(64)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        x = F.relu(self.b3(self.c3(x)))
        return self.fc(x.mean((2, 3)))


class LogitsOnly(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _randomize_bn(model: nn.Module) -> None:
    """Batch-norm statistics as a trained network has them: channels of very different scales."""
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.5)
            m.running_var.copy_(torch.rand(n, generator=g) * 4 + 0.05)
            with torch.no_grad():
                m.weight.copy_(torch.exp(torch.randn(n, generator=g)))
                m.bias.copy_(torch.randn(n, generator=g) * 0.5)


def _digits(kind: str) -> tuple[nn.Module, list[torch.Tensor]]:
    """The stored trained model (``bench.digits_weights``: trained once, so every host measures
    the same weights), calibrated on training images (unlabelled, as calibration data is in
    practice): 8 batches of 128, so the CNN's classifier (512 inputs) sees more rows than it has
    inputs; measured on 4 batches of 30 held-out test images."""
    from bench.digits_weights import trained
    from tests.reference.digits_models import images

    x, _ = images()
    calibration = [x[i : i + 128] for i in range(0, 1024, 128)]
    test = x[-120:]
    return trained(kind), calibration + [test[i : i + 30] for i in range(0, 120, 30)]


def build(name: str) -> tuple[nn.Module, list[tuple[torch.Tensor, ...]]]:
    """The model and 12 batches (8 calibrate, 4 measure). Every weight layer gets more
    calibration rows than it has inputs: with fewer, Hessian-based algorithms fit the calibration
    data (quantplug warns), and the table would measure the data's shortage, not the algorithm."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "encoder":
        return Encoder().eval(), [(torch.randn(4, 16, 64, generator=g),) for _ in range(12)]
    if name == "lstm":
        return Recurrent().eval(), [(torch.randn(4, 12, 32, generator=g),) for _ in range(12)]
    if name == "cnn":
        model = SmallCNN().eval()
        _randomize_bn(model)
        # batches of 16 calibrating: 128 rows at the classifier, which has 64 inputs
        return model, [(torch.randn(16 if i < 8 else 4, 3, 16, 16, generator=g),) for i in range(12)]
    if name == "llama":
        from tests.torchvision_compat import ensure_importable

        ensure_importable()  # transformers imports torchvision, whose CUDA wheel needs its op schemas
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            use_cache=False,
        )
        model = LogitsOnly(transformers.LlamaForCausalLM(config)).eval()
        return model, [(torch.randint(0, 128, (2, 16), generator=g),) for _ in range(12)]
    if name in ("digits_mlp", "digits_cnn"):
        model, batches = _digits(name.split("_")[1])
        return model, [(b,) for b in batches]
    raise SystemExit(f"unknown model {name!r}")


MODELS = ("encoder", "llama", "lstm", "cnn", "digits_mlp", "digits_cnn")


@dataclass(frozen=True)
class Case:
    """A bench model ready to quantize, split as every algorithm bench splits it: 8 batches to
    calibrate, 4 held out to measure, and the float model's outputs on those."""

    model: nn.Module
    program: torch.export.ExportedProgram
    calibration: list[tuple[torch.Tensor, ...]]
    measure: list[tuple[torch.Tensor, ...]]
    refs: list[torch.Tensor]


def batch_dynamic_shapes(batches: list[tuple[torch.Tensor, ...]]) -> tuple[dict[int, object], ...] | None:
    """``dynamic_shapes`` for ``torch.export`` leaving the batch dimension free when the batches
    differ in size (calibration and held-out batches of the digits models), else None. quantplug's
    converted programs take any batch size; a peer's ``program.module()`` checks the exported one."""
    if len({b[0].shape[0] for b in batches}) < 2:
        return None
    return tuple({0: torch.export.Dim.AUTO} for _ in batches[0])


def case(name: str) -> Case:
    model, batches = build(name)
    calibration, measure = batches[:8], batches[8:]
    with torch.no_grad():
        refs = [model(*b) for b in measure]
    return Case(model, torch.export.export(model, calibration[0]), calibration, measure, refs)
