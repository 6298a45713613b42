"""The model zoo: real architectures with seeded random weights and small inputs (no downloads).

Each :class:`ZooModel` builds a fresh float model in eval mode (weights drawn from a fixed seed,
so every machine builds the same numbers) and draws input tuples from a ``torch.Generator``, so
the example, the calibration batches and the held-out batches are the same everywhere. Inputs
are kept small (32x32 images, 12 tokens, hidden widths 32-64) to fit the suite's time budget.

Vision models get a data-dependent initialisation: a freshly initialised network's batch norms
(running mean 0, variance 1) normalise nothing, and the activations of a deep one (MobileNet,
EfficientNet) shrink to 1e-10 by the last layer, which no trained model does and no quantizer
can be judged on. Measuring the batch-norm statistics instead normalises every channel, the
nearly silent ones too, and makes the random network chaotic (1% of input noise leaves 6 dB
of SQNR at MobileNetV2's output). Scaling each layer to unit output variance (LSUV) keeps the
activations at a trained network's scale without either defect.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.torchvision_compat import ensure_importable

Inputs = tuple[torch.Tensor, ...]

IMAGE = (8, 3, 32, 32)
TOKENS = (8, 12)
VOCAB = 100
SEQUENCE = (8, 12, 16)


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: how to build it and how to draw its inputs."""

    name: str
    family: str  # "vision", "text" or "sequence": which input it takes
    make: Callable[[], nn.Module]
    needs: str | None = None  # the optional package it comes from

    def build(self, seed: int = 0) -> nn.Module:
        """The float model in eval mode, its weights drawn from ``seed`` (global RNG untouched)."""
        if self.needs is not None:
            ensure_importable()  # torchvision, or transformers (which imports torchvision)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = self.make()
            if self.family == "vision":
                _unit_variance_layers(model, self, torch.Generator().manual_seed(seed + 1))
        return model.eval()

    def draw(self, gen: torch.Generator, batch: int | None = None) -> Inputs:
        shape = {"vision": IMAGE, "text": TOKENS, "sequence": SEQUENCE}[self.family]
        if batch is not None:
            shape = (batch, *shape[1:])
        if self.family == "text":
            return (torch.randint(0, VOCAB, shape, generator=gen),)
        return (torch.randn(shape, generator=gen),)

    def available(self) -> bool:
        if self.needs is None:
            return True
        ensure_importable()  # transformers imports torchvision when it is installed
        return importlib.util.find_spec(self.needs) is not None


GATE_STD = 0.1


def _unit_variance_layers(model: nn.Module, zoo: ZooModel, gen: torch.Generator) -> None:
    """Scale each conv/linear layer so that its output has unit variance on random inputs (LSUV).

    One forward pass in eval mode: a hook measures each layer's output as the data reaches it,
    divides the layer's weight and bias by that standard deviation and passes the rescaled output
    on, so every later layer is measured on already normalised inputs.
    """
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear))]
    # squeeze-excitation gates start nearly constant: at unit variance before their sigmoid, the
    # sixteen gates of an EfficientNet multiply into per-image gains spanning 1000x
    gates = {id(m.fc2) for m in model.modules() if type(m).__name__ == "SqueezeExcitation"}

    def rescale(layer: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        std = float(output.std()) / (GATE_STD if id(layer) in gates else 1.0)
        if std <= 0.0:
            return output
        layer.weight.div_(std)
        if layer.bias is not None:
            layer.bias.div_(std)
        return output / std

    hooks = [layer.register_forward_hook(rescale) for layer in layers]
    try:
        with torch.no_grad():
            model.eval()(*zoo.draw(gen, batch=16))
    finally:
        for hook in hooks:
            hook.remove()


# --- torchvision ---------------------------------------------------------------------------------


def _torchvision(name: str, **kwargs: object) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(num_classes=10, **kwargs)  # type: ignore[no-any-return]

    return make


def _convnext_small() -> nn.Module:
    """ConvNeXt's blocks (depthwise 7x7, LayerNorm2d, inverted MLP, layer scale) at two narrow stages."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)], num_classes=10)


def _vit_small() -> nn.Module:
    """torchvision's VisionTransformer: 8x8 patches of a 32x32 image, 2 layers of width 32."""
    from torchvision.models import VisionTransformer

    vit = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    )
    # torchvision zero-initialises the head (its output would be all zeros); issue 16.4's tests
    # cover all-zero weights, the zoo needs an output to compare
    nn.init.normal_(vit.heads.head.weight, std=0.1)
    return vit


# --- transformers --------------------------------------------------------------------------------


class _LogitsOf(nn.Module):
    """A Hugging Face model called on ``input_ids`` returning its first output as one tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids)
        return out[0]  # type: ignore[no-any-return]


def hugging_face(
    model_cls: str, config_cls: str, wrap: Callable[[nn.Module], nn.Module] = _LogitsOf, **config: Any
) -> Callable[[], nn.Module]:
    """A builder of ``transformers.<model_cls>(<config_cls>(**config))``, wrapped (by default to
    take ``input_ids`` and return the first output); imported only when built."""

    def make() -> nn.Module:
        import transformers

        return wrap(getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config)))

    return make


def _bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return _LogitsOf(BertModel(config, add_pooling_layer=False))


def _gpt2() -> nn.Module:
    """GPT-2 with its tied LM head (the embedding table is also the head's weight); Conv1D = addmm."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, use_cache=False, bos_token_id=0
    )
    config.eos_token_id = 0
    return _LogitsOf(GPT2LMHeadModel(config))


def _llama() -> nn.Module:
    """Llama: RMSNorm, rotary embeddings, grouped-query attention (4 heads, 2 key/value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )
    return _LogitsOf(LlamaForCausalLM(config))


# --- torch.nn ------------------------------------------------------------------------------------


def _encoder(fast_path: bool) -> Callable[[], nn.Module]:
    """``nn.TransformerEncoder`` of 2 layers, width 16.

    ``fast_path=True`` meets every condition of the layer's fused inference path in eager mode
    (batch_first, even head count, relu, equal norm eps, eval), so its float reference runs
    ``_transformer_encoder_layer_fwd``; ``torch.export`` always records the decomposed path.
    ``fast_path=False`` breaks those conditions (sequence-first, pre-norm, GELU).
    """

    def make() -> nn.Module:
        if fast_path:
            layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation="gelu", norm_first=True)
        return _SequenceFirst(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))

    return make


class _SequenceFirst(nn.Module):
    """Runs a sequence-first module on batch-first inputs (so every sequence model takes one shape)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.transpose(0, 1)).transpose(0, 1)  # type: ignore[no-any-return]


class LstmModel(nn.Module):
    """Two stacked LSTM layers and a linear head over every step."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out)  # type: ignore[no-any-return]


class GruModel(nn.Module):
    """A linear stem, a bidirectional GRU and a linear head over every step."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 24)
        self.gru = nn.GRU(24, 16, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(torch.relu(self.stem(x)))
        return self.head(out)  # type: ignore[no-any-return]


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1),
    )


class TinyUNet(nn.Module):
    """Two-level U-Net: conv blocks, max-pool down, transposed-conv and bilinear up, skip ``cat``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1 = _conv_block(3, 8)
        self.enc2 = _conv_block(8, 16)
        self.mid = _conv_block(16, 32)
        self.up2 = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.dec2 = _conv_block(32, 16)
        self.up1 = nn.Conv2d(16, 8, 1)
        self.dec1 = _conv_block(16, 8)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = F.relu(self.enc1(x))
        e2 = F.relu(self.enc2(F.max_pool2d(e1, 2)))
        m = F.relu(self.mid(F.max_pool2d(e2, 2)))
        d2 = F.relu(self.dec2(torch.cat([self.up2(m), e2], dim=1)))
        up = F.interpolate(self.up1(d2), scale_factor=2, mode="bilinear", align_corners=False)
        d1 = F.relu(self.dec1(torch.cat([up, e1], dim=1)))
        return self.out(d1)  # type: ignore[no-any-return]


MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel("resnet18", "vision", _torchvision("resnet18"), "torchvision"),
        ZooModel("mobilenet_v2", "vision", _torchvision("mobilenet_v2"), "torchvision"),
        ZooModel("mobilenet_v3_small", "vision", _torchvision("mobilenet_v3_small"), "torchvision"),
        ZooModel("efficientnet_b0", "vision", _torchvision("efficientnet_b0"), "torchvision"),
        ZooModel("shufflenet_v2", "vision", _torchvision("shufflenet_v2_x0_5"), "torchvision"),
        ZooModel("squeezenet", "vision", _torchvision("squeezenet1_1"), "torchvision"),
        ZooModel("regnet_x_400mf", "vision", _torchvision("regnet_x_400mf"), "torchvision"),
        ZooModel("convnext", "vision", _convnext_small, "torchvision"),
        ZooModel("vit", "vision", _vit_small, "torchvision"),
        ZooModel("bert", "text", _bert, "transformers"),
        ZooModel("gpt2", "text", _gpt2, "transformers"),
        ZooModel("llama", "text", _llama, "transformers"),
        ZooModel("encoder_fast_path", "sequence", _encoder(fast_path=True)),
        ZooModel("encoder", "sequence", _encoder(fast_path=False)),
        ZooModel("lstm", "sequence", LstmModel),
        ZooModel("gru", "sequence", GruModel),
        ZooModel("unet", "vision", TinyUNet),
    )
}
