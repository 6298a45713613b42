"""Models that made lowering lose tensors, and the quantize/lower helpers the lowering tests share.

Each builder returns a fresh eval-mode model with seeded random weights; ``quantize`` runs a
backend's prepare/calibrate/convert on it. The models are small: the tests exercise structure
(what the exporter does to Q/DQ nodes), not accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

import quantplug

D = 32


class TransformerBlock(nn.Module):
    """Pre-norm block with two freshly initialised LayerNorms: equal parameters (ones, zeros),
    which ONNX exporters deduplicate into one initializer, then merge the DQ nodes reading it."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.ln2 = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def encoder(fast_path: bool) -> nn.Module:
    layer = nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.0, batch_first=True, norm_first=not fast_path)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=fast_path)


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = cell(16, D, batch_first=True)
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class ProjectedLSTM(nn.Module):
    """Two bidirectional layers whose state is projected (``proj_size``): torch's ONNX exporter
    mistranslates the op, so lowering decomposes it."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, D, num_layers=2, bidirectional=True, proj_size=8, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class Attention(nn.Module):
    """q/k/v projections and ``scaled_dot_product_attention`` with a causal mask."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, t, 4, d // 4).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True
        )
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Decomposed(nn.Module):
    """Ops torchlib has no translation for, which the exporter decomposes first (RMSNorm,
    hardshrink, square, var)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm(x))
        return self.fc2(F.hardshrink(h, 0.1) + torch.square(h)) * torch.var(h, dim=-1, keepdim=True)


class Constants(nn.Module):
    """Small quantized constants the exporter's optimizer folds: a tiny linear (16 weights),
    a zero bias, a float constant added to an activation, a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.tiny = nn.Linear(D, 4)
        self.zero_bias = nn.Linear(4, D)
        nn.init.zeros_(self.zero_bias.bias)
        self.register_buffer("offset", torch.linspace(-1, 1, D))
        self.register_buffer("mask", torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.zero_bias(torch.relu(self.tiny(x))) + self.offset
        s = (y @ y.transpose(-2, -1)) * (1.0 / math.sqrt(D))
        return torch.softmax(s.masked_fill(self.mask, float("-inf")), dim=-1) @ y


class InPlace(nn.Module):
    """In-place activations (``relu_``, ``hardswish_``): not functional, so the program is checked
    as torch.export's own IR and the exporter functionalizes it (a decomposition)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.Sequential(nn.ReLU(inplace=True), nn.Hardswish(inplace=True))
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(self.bn(self.conv(x))).mean((2, 3)))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "transformer_block": (TransformerBlock, (2, 8, D)),
    "encoder_fast_path": (lambda: encoder(True), (2, 8, D)),
    "encoder_no_fast_path": (lambda: encoder(False), (2, 8, D)),
    "lstm": (lambda: Recurrent(nn.LSTM), (2, 8, 16)),
    "gru": (lambda: Recurrent(nn.GRU), (2, 8, 16)),
    "projected_lstm": (ProjectedLSTM, (2, 8, 16)),
    "sdpa": (Attention, (2, 8, D)),
    "decomposed": (Decomposed, (2, 8, D)),
    "constants": (Constants, (2, 8, D)),
    "in_place": (InPlace, (2, 3, 8, 8)),
}

#: (backend, options) of every preset the lowering tests run
PRESETS: list[tuple[str, dict[str, Any]]] = [
    ("reference", {"preset": "int8"}),
    ("reference", {"preset": "a16w8"}),
    ("reference", {"preset": "dynamic_int8"}),
    ("reference", {"preset": "weight_only_int4"}),
    ("qnn_htp", {"precision": "8a8w"}),
    ("qnn_htp", {"precision": "16a8w"}),
    ("qnn_htp", {"precision": "16a4w"}),
    ("qnn_htp", {"precision": "16a4w_block", "block_size": 16}),
    ("qnn_htp", {"precision": "16a16w"}),
]


def preset_id(backend: str, options: dict[str, Any]) -> str:
    return f"{backend}-{options.get('preset') or options.get('precision')}"


def build(name: str, seed: int = 0) -> tuple[nn.Module, tuple[int, ...]]:
    ctor, shape = MODELS[name]
    torch.manual_seed(seed)
    return ctor().eval(), shape


def batches(shape: tuple[int, ...], n: int, seed: int) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen),) for _ in range(n)]


def quantize(
    program: torch.export.ExportedProgram,
    backend: str,
    options: dict[str, Any],
    calibration: list[tuple[torch.Tensor, ...]],
) -> tuple[quantplug.Quantizer, GraphModule]:
    quantizer = quantplug.get_quantizer(backend, **options)
    prepared = quantplug.prepare(program, quantizer)
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    return quantizer, quantplug.convert(prepared)
