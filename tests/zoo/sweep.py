"""Sweep architectures the zoo lacks through quantplug's public API and print what fails where.

The zoo (``tests/zoo/models.py``) is what the suite asserts on; this script is how new
architectures are tried before one is worth a permanent place there: each model is built with
random weights from a small config (no downloads), exported (with a dynamic batch where
``torch.export`` allows it), and for each preset prepared, calibrated on two batches, converted,
lowered (``qnn_htp`` strictly: every ONNX tensor of a quantized op encoded) and saved; for the
``reference`` backend the ONNX Runtime artifact is run and compared with the Q/DQ program (in
steps of the output's grid) and with float (SQNR); a ``qnn_htp`` ``model.onnx`` must be pure Q/DQ
(``tests/zoo/pure_qdq.py``) and, run by ONNX Runtime as Q/DQ arithmetic, within 1 dB of the
program (``onnx -0.01dB``: the ONNX model's SQNR against the program's).

    .venv/bin/python -m tests.zoo.sweep                  # every model, one at a time
    .venv/bin/python -m tests.zoo.sweep swin_t maxvit    # some of them

One table row per model and preset: ``ok`` with the program's SQNR (and the artifact's, and its
distance from the program in output steps), or the exception's type and first line.
"""

from __future__ import annotations

import copy
import functools
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
import torch.nn.functional as F
from torch import nn

import quantplug
from tests.zoo import pure_qdq
from tests.zoo.harness import quantizer, quiet, run, sqnr
from tests.zoo.models import VOCAB, ZooModel
from tests.zoo.models import hugging_face as _hf

PRESETS: tuple[tuple[str, str], ...] = (
    ("reference", "int8"),
    ("reference", "weight_only_int4"),
    ("qnn_htp", "8a8w"),
    ("qnn_htp", "16a8w"),
    ("qnn_htp", "16a4w_block"),
)


@dataclass(frozen=True)
class SweepModel:
    """A model to try: how to build it and the shape (and kind) of its one input."""

    name: str
    make: Callable[[], nn.Module]
    shape: tuple[int, ...]
    kind: str = "float"  # "float" (randn), "tokens" (int ids below VOCAB), "vision" (randn + LSUV)

    def build(self) -> nn.Module:
        family = "vision" if self.kind == "vision" else "sequence"
        zoo = ZooModel(self.name, family, self.make, needs="torchvision")  # imports it (and transformers)
        if self.kind == "vision":
            # the zoo's LSUV initialisation draws IMAGE-shaped inputs; draw ours instead
            object.__setattr__(zoo, "draw", lambda gen, batch=None: self.draw(gen, batch))
        return zoo.build()

    def draw(self, gen: torch.Generator, batch: int | None = None) -> tuple[torch.Tensor, ...]:
        """One input of the model's shape, with ``batch`` samples if given."""
        shape = self.shape if batch is None else (batch, *self.shape[1:])
        if self.kind == "tokens":
            return (torch.randint(0, VOCAB, shape, generator=gen),)
        return (torch.randn(shape, generator=gen),)


# --- torchvision ---------------------------------------------------------------------------------


def _tv(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(num_classes=10, **kwargs)  # type: ignore[no-any-return]

    return make


def _densenet() -> nn.Module:
    from torchvision.models import DenseNet

    return DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, bn_size=2, num_classes=10)


def _resnext() -> nn.Module:
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, groups=4, width_per_group=8)


def _wide_resnet() -> nn.Module:
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, width_per_group=128)


def _efficientnet_v2() -> nn.Module:
    from functools import partial

    from torchvision.models.efficientnet import EfficientNet, FusedMBConvConfig, MBConvConfig

    settings = [
        FusedMBConvConfig(1, 3, 1, 16, 16, 1),
        FusedMBConvConfig(4, 3, 2, 16, 24, 1),
        MBConvConfig(4, 3, 2, 24, 32, 1, width_mult=1.0, depth_mult=1.0),
    ]
    return EfficientNet(
        settings, dropout=0.0, num_classes=10, norm_layer=partial(nn.BatchNorm2d, eps=1e-3), last_channel=64
    )


def _swin() -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        patch_size=[4, 4],
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=[3, 3],
        stochastic_depth_prob=0.0,
        num_classes=10,
    )


def _maxvit() -> nn.Module:
    from torchvision.models.maxvit import MaxVit

    return MaxVit(
        input_size=(32, 32),
        stem_channels=8,
        partition_size=2,
        block_channels=[16, 32],
        block_layers=[1, 1],
        head_dim=8,
        stochastic_depth_prob=0.0,
        num_classes=10,
    )


class _Out(nn.Module):
    """A segmentation model's ``out`` entry as one tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)["out"]  # type: ignore[no-any-return]


def _deeplab() -> nn.Module:
    from torchvision.models.segmentation.deeplabv3 import DeepLabHead

    return _Segmentation(DeepLabHead(16, 3))


def _fcn() -> nn.Module:
    from torchvision.models.segmentation.fcn import FCNHead

    return _Segmentation(FCNHead(16, 3))


class _Segmentation(nn.Module):
    """A small strided backbone, a torchvision segmentation head, bilinear upsampling to the input."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, 2, 1)
        )
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(F.relu(self.backbone(x)))
        return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)


# --- transformers --------------------------------------------------------------------------------


class _First(nn.Module):
    """A Hugging Face model called with keyword ``key`` returning its first output as one tensor."""

    def __init__(self, model: nn.Module, key: str = "input_ids") -> None:
        super().__init__()
        self.model = model
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.key: x})[0]  # type: ignore[no-any-return]


class _Seq2Seq(nn.Module):
    """An encoder-decoder called with the same ids as encoder and decoder input."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, decoder_input_ids=ids)[0]  # type: ignore[no-any-return]


class _Padded(nn.Module):
    """A model called with an attention mask it builds from the ids: those below 4 are padding
    (about one position in 25), so the model's own masking code runs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=(ids > 3).long())[0]  # type: ignore[no-any-return]


SMALL: dict[str, Any] = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
_PIXELS = functools.partial(_First, key="pixel_values")
_AUDIO = functools.partial(_First, key="input_values")
#: the small convolutional feature extractor and positional convolution of the speech encoders
_AUDIO_FRONT: dict[str, Any] = dict(
    conv_dim=(16, 16),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
)


def _whisper() -> nn.Module:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=2,
        decoder_layers=1,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=8,
        max_target_positions=16,
    )
    return _First(WhisperEncoder(config), "input_features")


def _hf_vit() -> nn.Module:
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(image_size=32, patch_size=8, num_channels=3, **SMALL)
    return _First(ViTModel(config, add_pooling_layer=False), "pixel_values")


# --- torch.nn ------------------------------------------------------------------------------------


class Conv1dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(16, 32, 3, padding=1)
        self.gn = nn.GroupNorm(4, 32)
        self.c2 = nn.Conv1d(32, 16, 5, padding=2, groups=4)
        self.inorm = nn.InstanceNorm1d(16, affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inorm(self.c2(F.relu(self.gn(self.c1(x.transpose(1, 2)))))).transpose(1, 2)  # type: ignore[no-any-return]


class DecoderNet(nn.Module):
    """ConvTranspose2d, GroupNorm, InstanceNorm2d, PixelShuffle, tanh-GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, 2, 1)
        self.gn = nn.GroupNorm(4, 16)
        self.up = nn.ConvTranspose2d(16, 8, 4, 2, 1)
        self.inorm = nn.InstanceNorm2d(8)
        self.c2 = nn.Conv2d(8, 12, 3, padding=1)
        self.ps = nn.PixelShuffle(2)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.gn(self.c1(x)))
        y = F.relu(self.inorm(self.up(y)))
        return self.ps(self.c2(y))  # type: ignore[no-any-return]


class EmbeddingNet(nn.Module):
    """Embedding + EmbeddingBag (mean), LayerNorm without affine, SiLU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.bag = nn.EmbeddingBag(VOCAB, 16, mode="mean")
        self.norm = nn.LayerNorm(16, elementwise_affine=False)
        self.fc = nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = self.emb(ids) + self.bag(ids).unsqueeze(1)
        return self.fc(F.silu(self.norm(tokens)))  # type: ignore[no-any-return]


# --- tried first by the algorithm sweep (stop 28): 3-D convolutions, weight-normed and state-space
# layers, soft-capped attention, a projected LSTM, a weight computed from a low-rank update


def _r3d() -> nn.Module:
    import torchvision

    return torchvision.models.video.r3d_18(num_classes=10)  # type: ignore[no-any-return]


_wav2vec2 = _hf(
    "Wav2Vec2Model",
    "Wav2Vec2Config",
    functools.partial(_First, key="input_values"),
    **_AUDIO_FRONT,
    vocab_size=VOCAB,
    **SMALL,
)
_mamba = _hf(
    "MambaModel",
    "MambaConfig",
    _First,
    vocab_size=VOCAB,
    hidden_size=32,
    state_size=8,
    num_hidden_layers=2,
    expand=2,
    conv_kernel=4,
)
_gemma2 = _hf(
    "Gemma2Model",
    "Gemma2Config",
    _First,
    vocab_size=VOCAB,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=32,
    sliding_window=8,
    **SMALL,
)


def _mobilevit() -> nn.Module:
    from transformers import MobileViTConfig, MobileViTModel

    config = MobileViTConfig(
        image_size=64, hidden_sizes=[32, 40, 48], neck_hidden_sizes=[8, 8, 16, 24, 32, 40, 80]
    )
    return _First(MobileViTModel(config, expand_output=False), "pixel_values")


_segformer = _hf(
    "SegformerModel",
    "SegformerConfig",
    functools.partial(_First, key="pixel_values"),
    num_encoder_blocks=2,
    depths=[1, 1],
    sr_ratios=[2, 1],
    hidden_sizes=[16, 32],
    patch_sizes=[7, 3],
    strides=[4, 2],
    num_attention_heads=[1, 2],
    mlp_ratios=[2, 2],
)
_convnextv2 = _hf(
    "ConvNextV2Model",
    "ConvNextV2Config",
    functools.partial(_First, key="pixel_values"),
    hidden_sizes=[16, 32],
    depths=[1, 1],
    num_stages=2,
)


class WeightNormNet(nn.Module):
    """Weights computed from weight_norm's parametrization (``g * v / |v|``) at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(16, 32, 5, padding=2))
        self.fc = nn.utils.parametrizations.weight_norm(nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.gelu(self.conv(x.transpose(1, 2))).transpose(1, 2))  # type: ignore[no-any-return]


class ProjectedLSTM(nn.Module):
    """A 2-layer bidirectional LSTM with ``proj_size`` (its hidden state projected by weight_hr)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 32, num_layers=2, bidirectional=True, proj_size=8, batch_first=True)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(x)[0])  # type: ignore[no-any-return]


class LowRankUpdate(nn.Module):
    """A linear whose weight is computed, ``W + B A`` (a LoRA adapter left unmerged)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(32, 64)
        self.a = nn.Parameter(0.1 * torch.randn(4, 32))
        self.b = nn.Parameter(0.1 * torch.randn(64, 4))
        self.fc = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(F.linear(x, self.base.weight + self.b @ self.a, self.base.bias)))  # type: ignore[no-any-return]


def _beit() -> nn.Module:
    """BEiT with relative position bias: the attention output's ``contiguous()`` before a
    ``view`` failed inside torch's ONNX exporter with a dynamic batch (weight-only presets)."""
    from transformers import BeitConfig, BeitModel

    config = BeitConfig(image_size=32, patch_size=8, use_relative_position_bias=True, **SMALL)
    return _First(BeitModel(config, add_pooling_layer=False), "pixel_values")


def _swinv2() -> nn.Module:
    """Swin V2: its continuous position bias is an MLP over a constant coordinate table."""
    from transformers import Swinv2Config, Swinv2Model

    config = Swinv2Config(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4
    )
    return _First(Swinv2Model(config), "pixel_values")


def _moe(
    model_cls: str, config_cls: str, experts_implementation: str | None = "batched_mm", **config: Any
) -> Callable[[], nn.Module]:
    """A mixture-of-experts decoder (2 experts per token) whose experts are batched matmuls:
    transformers' default kernel on CPU (``experts_implementation=None``) is a custom op looping
    over the experts, which no ONNX form can express (lowering says so and names the option)."""
    return _hf(
        model_cls,
        config_cls,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        use_cache=False,
        num_experts_per_tok=2,
        num_key_value_heads=1,
        experts_implementation=experts_implementation,
        **config,
        **SMALL,
    )


#: RWKV-4 (transformers' PyTorch path): each step's output written into ``zeros_like`` in place, a
#: running maximum that starts at ``zeros - 1e38``, embeddings of about +-1e-4 before a layer norm,
#: and output weights divided in place by ``2 ** (layer // rescale_every)`` on the first forward
#: (exported before it: at every call of the program)
_rwkv = _hf(
    "RwkvModel",
    "RwkvConfig",
    _First,
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    attention_hidden_size=32,
    intermediate_size=64,
    context_length=32,
    rescale_every=1,
    use_cache=False,
)
#: ConvBERT: span-based dynamic convolution through ``nn.Unfold`` (``im2col``)
_convbert = _hf(
    "ConvBertModel",
    "ConvBertConfig",
    _First,
    vocab_size=VOCAB,
    max_position_embeddings=32,
    embedding_size=32,
    **SMALL,
)

#: RecurrentGemma: RG-LRU recurrences reset by a boolean mask (``reset + ~reset * a``), a conv1d
#: and local attention
_recurrent_gemma = _hf(
    "RecurrentGemmaModel",
    "RecurrentGemmaConfig",
    _First,
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    lru_width=32,
    attention_window_size=8,
    conv1d_width=4,
    use_cache=False,
)


TEXT = (4, 12)
IMG = (4, 3, 32, 32)

SWEEP: dict[str, SweepModel] = {
    m.name: m
    for m in (
        SweepModel("alexnet", _tv("alexnet"), (4, 3, 64, 64), "vision"),
        SweepModel("vgg11_bn", _tv("vgg11_bn"), IMG, "vision"),
        SweepModel("googlenet", _tv("googlenet", aux_logits=False, init_weights=True), IMG, "vision"),
        SweepModel(
            "inception_v3", _tv("inception_v3", aux_logits=False, init_weights=True), (2, 3, 75, 75), "vision"
        ),
        SweepModel("densenet", _densenet, IMG, "vision"),
        SweepModel("mnasnet0_5", _tv("mnasnet0_5"), IMG, "vision"),
        SweepModel("resnext", _resnext, IMG, "vision"),
        SweepModel("wide_resnet", _wide_resnet, IMG, "vision"),
        SweepModel("regnet_y_400mf", _tv("regnet_y_400mf"), IMG, "vision"),
        SweepModel("efficientnet_v2", _efficientnet_v2, IMG, "vision"),
        SweepModel("mobilenet_v3_large", _tv("mobilenet_v3_large"), IMG, "vision"),
        SweepModel("swin_t", _swin, IMG, "vision"),
        SweepModel("maxvit", _maxvit, IMG, "vision"),
        SweepModel("deeplabv3", _deeplab, IMG, "vision"),
        SweepModel("fcn", _fcn, IMG, "vision"),
        SweepModel(
            "distilbert",
            _hf(
                "DistilBertModel",
                "DistilBertConfig",
                vocab_size=VOCAB,
                dim=32,
                n_layers=2,
                n_heads=2,
                hidden_dim=64,
                max_position_embeddings=32,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "roberta",
            _hf("RobertaModel", "RobertaConfig", vocab_size=VOCAB, max_position_embeddings=40, **SMALL),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "albert",
            _hf(
                "AlbertModel",
                "AlbertConfig",
                vocab_size=VOCAB,
                embedding_size=16,
                max_position_embeddings=32,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "t5_encoder",
            _hf(
                "T5EncoderModel",
                "T5Config",
                vocab_size=VOCAB,
                d_model=32,
                d_kv=16,
                d_ff=64,
                num_layers=2,
                num_heads=2,
                use_cache=False,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "t5",
            _hf(
                "T5Model",
                "T5Config",
                _Seq2Seq,
                vocab_size=VOCAB,
                d_model=32,
                d_kv=16,
                d_ff=64,
                num_layers=1,
                num_decoder_layers=1,
                num_heads=2,
                use_cache=False,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "mistral",
            _hf(
                "MistralForCausalLM",
                "MistralConfig",
                vocab_size=VOCAB,
                num_key_value_heads=1,
                max_position_embeddings=32,
                sliding_window=4,
                use_cache=False,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "qwen2",
            _hf(
                "Qwen2ForCausalLM",
                "Qwen2Config",
                vocab_size=VOCAB,
                num_key_value_heads=1,
                max_position_embeddings=32,
                use_cache=False,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "phi",
            _hf(
                "PhiForCausalLM",
                "PhiConfig",
                vocab_size=VOCAB,
                max_position_embeddings=32,
                use_cache=False,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "gpt_neox",
            _hf(
                "GPTNeoXForCausalLM",
                "GPTNeoXConfig",
                vocab_size=VOCAB,
                max_position_embeddings=32,
                use_cache=False,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel("whisper_encoder", _whisper, (2, 8, 16)),
        SweepModel("hf_vit", _hf_vit, IMG),
        SweepModel(
            "clip_text",
            _hf("CLIPTextModel", "CLIPTextConfig", vocab_size=VOCAB, max_position_embeddings=32, **SMALL),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "bart",
            _hf(
                "BartModel",
                "BartConfig",
                vocab_size=VOCAB,
                d_model=32,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=32,
                use_cache=False,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel("conv1d", Conv1dNet, (4, 12, 16)),
        SweepModel("decoder", DecoderNet, IMG),
        SweepModel("embedding", EmbeddingNet, TEXT, "tokens"),
        SweepModel("r3d_18", _r3d, (4, 3, 4, 32, 32), "vision"),
        SweepModel("wav2vec2", _wav2vec2, (4, 400)),
        SweepModel("mamba", _mamba, TEXT, "tokens"),
        SweepModel("gemma2", _gemma2, TEXT, "tokens"),
        SweepModel("mobilevit", _mobilevit, (4, 3, 64, 64), "vision"),
        SweepModel("segformer", _segformer, IMG, "vision"),
        SweepModel("convnextv2", _convnextv2, IMG, "vision"),
        SweepModel("weight_norm", WeightNormNet, (4, 12, 16)),
        SweepModel("projected_lstm", ProjectedLSTM, (4, 12, 16)),
        SweepModel("low_rank_update", LowRankUpdate, (4, 12, 32)),
        SweepModel("beit", _beit, IMG, "vision"),
        SweepModel("swinv2", _swinv2, IMG, "vision"),
        SweepModel(
            "mixtral", _moe("MixtralForCausalLM", "MixtralConfig", num_local_experts=4), TEXT, "tokens"
        ),
        SweepModel(
            "qwen2_moe",
            _moe(
                "Qwen2MoeForCausalLM",
                "Qwen2MoeConfig",
                num_experts=4,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
            ),
            TEXT,
            "tokens",
        ),
        # experts stored [experts, in, out] and read as bmm(x, W[ids]), biases gathered beside
        # them, attention sinks, a clamped SwiGLU (tried on 2026-11-26: lowered at every preset)
        SweepModel(
            "gpt_oss",
            _moe("GptOssForCausalLM", "GptOssConfig", num_local_experts=4, head_dim=16),
            TEXT,
            "tokens",
        ),
        SweepModel("rwkv", _rwkv, (4, 6), "tokens"),
        SweepModel("convbert", _convbert, TEXT, "tokens"),
        SweepModel("recurrent_gemma", _recurrent_gemma, TEXT, "tokens"),
        # tried on 2026-11-26 and lowered at every preset as they were: FFT token mixing, funnel
        # pooling, bottlenecks, two-stream attention, multi-query attention, Mamba 2, Mamba plus
        # experts, rotary and relative positions, subsampling attention with biases, pooling
        # mixers, weight-standardized convs, focal modulation, additive attention, audio encoders
        SweepModel(
            "fnet",
            _hf(
                "FNetModel",
                "FNetConfig",
                vocab_size=VOCAB,
                max_position_embeddings=32,
                use_tpu_fourier_optimizations=False,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "funnel",
            _hf(
                "FunnelModel",
                "FunnelConfig",
                vocab_size=VOCAB,
                block_sizes=[1, 1],
                d_model=32,
                n_head=2,
                d_head=16,
                d_inner=64,
            ),
            (4, 16),
            "tokens",
        ),
        SweepModel(
            "mobilebert",
            _hf(
                "MobileBertModel",
                "MobileBertConfig",
                vocab_size=VOCAB,
                max_position_embeddings=32,
                embedding_size=16,
                intra_bottleneck_size=16,
                true_hidden_size=16,
                num_feedforward_networks=2,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=32,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "xlnet",
            _hf(
                "XLNetModel",
                "XLNetConfig",
                vocab_size=VOCAB,
                d_model=32,
                n_layer=2,
                n_head=2,
                d_inner=64,
                use_mems_eval=False,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "gpt_bigcode",
            _hf(
                "GPTBigCodeModel",
                "GPTBigCodeConfig",
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=2,
                n_positions=32,
                multi_query=True,
                use_cache=False,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "mamba2",
            _hf(
                "Mamba2Model",
                "Mamba2Config",
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                state_size=8,
                expand=2,
                conv_kernel=4,
                num_heads=4,
                head_dim=16,
                n_groups=1,
                chunk_size=4,
                use_cache=False,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "jamba",
            _hf(
                "JambaModel",
                "JambaConfig",
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                intermediate_size=64,
                num_experts=2,
                num_experts_per_tok=1,
                expert_layer_period=2,
                expert_layer_offset=1,
                attn_layer_period=2,
                attn_layer_offset=1,
                mamba_d_state=8,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_dt_rank=4,
                use_mamba_kernels=False,
                use_cache=False,
                experts_implementation="batched_mm",
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "clip_vision",
            _hf("CLIPVisionModel", "CLIPVisionConfig", _PIXELS, image_size=32, patch_size=8, **SMALL),
            IMG,
            "vision",
        ),
        SweepModel(
            "levit",
            _hf(
                "LevitModel",
                "LevitConfig",
                _PIXELS,
                image_size=64,
                hidden_sizes=[32, 48, 64],
                num_attention_heads=[1, 2, 2],
                depths=[1, 1, 1],
                key_dim=[8, 8, 8],
                mlp_ratio=[2, 2, 2],
                attention_ratio=[2, 2, 2],
                down_ops=[["Subsample", 8, 32 // 8, 4, 2, 2], ["Subsample", 8, 48 // 8, 4, 2, 2]],
            ),
            (4, 3, 64, 64),
            "vision",
        ),
        SweepModel(
            "pvt",
            _hf(
                "PvtModel",
                "PvtConfig",
                _PIXELS,
                image_size=32,
                num_encoder_blocks=2,
                depths=[1, 1],
                sequence_reduction_ratios=[2, 1],
                hidden_sizes=[16, 32],
                patch_sizes=[4, 2],
                strides=[4, 2],
                num_attention_heads=[1, 2],
                mlp_ratios=[2, 2],
            ),
            IMG,
            "vision",
        ),
        SweepModel(
            "poolformer",
            _hf(
                "PoolFormerModel",
                "PoolFormerConfig",
                _PIXELS,
                depths=[1, 1, 1, 1],
                hidden_sizes=[16, 24, 32, 48],
            ),
            IMG,
            "vision",
        ),
        SweepModel(
            "bit",
            _hf(
                "BitModel",
                "BitConfig",
                _PIXELS,
                embedding_size=16,
                hidden_sizes=[16, 32, 64, 128],
                depths=[1, 1, 1, 1],
                layer_type="preactivation",
                num_groups=4,
            ),
            IMG,
            "vision",
        ),
        SweepModel(
            "focalnet",
            _hf(
                "FocalNetModel",
                "FocalNetConfig",
                _PIXELS,
                image_size=32,
                patch_size=4,
                embed_dim=16,
                depths=[1, 1],
                focal_levels=[2, 2],
                focal_windows=[3, 3],
            ),
            IMG,
            "vision",
        ),
        SweepModel(
            "swiftformer",
            _hf(
                "SwiftFormerModel",
                "SwiftFormerConfig",
                _PIXELS,
                depths=[1, 1, 1, 1],
                embed_dims=[16, 24, 32, 48],
            ),
            IMG,
            "vision",
        ),
        SweepModel(
            "wavlm",
            _hf(
                "WavLMModel",
                "WavLMConfig",
                _AUDIO,
                **_AUDIO_FRONT,
                num_buckets=32,
                max_bucket_distance=64,
                vocab_size=VOCAB,
                **SMALL,
            ),
            (4, 400),
        ),
        SweepModel(
            "hubert",
            _hf(
                "HubertModel",
                "HubertConfig",
                _AUDIO,
                **_AUDIO_FRONT,
                vocab_size=VOCAB,
                **SMALL,
            ),
            (4, 400),
        ),
        SweepModel(
            "squeezebert",
            _hf(
                "SqueezeBertModel",
                "SqueezeBertConfig",
                vocab_size=VOCAB,
                max_position_embeddings=32,
                embedding_size=32,
                q_groups=2,
                k_groups=2,
                v_groups=2,
                post_attention_groups=2,
                intermediate_groups=2,
                output_groups=2,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "roformer",
            _hf(
                "RoFormerModel",
                "RoFormerConfig",
                vocab_size=VOCAB,
                max_position_embeddings=32,
                embedding_size=32,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "esm",
            _hf(
                "EsmModel",
                "EsmConfig",
                vocab_size=VOCAB,
                max_position_embeddings=40,
                position_embedding_type="rotary",
                pad_token_id=1,
                mask_token_id=32,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "olmoe",
            _hf(
                "OlmoeForCausalLM",
                "OlmoeConfig",
                vocab_size=VOCAB,
                max_position_embeddings=32,
                use_cache=False,
                num_experts=4,
                num_experts_per_tok=2,
                num_key_value_heads=1,
                experts_implementation="batched_mm",
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        # tried on 2026-11-26: Falcon's multi-query attention with a dynamic batch failed in
        # qnn_htp's attention decomposition (a SymInt in an argument list); the others lowered as
        # they were: disentangled and ALiBi attention, parallel blocks, squared ReLU, QK norms,
        # interleaved local/global attention, conformer convolutions, video tubelets, detection
        # tokens, patched time series
        SweepModel(
            "deberta_v2",
            _hf(
                "DebertaV2Model",
                "DebertaV2Config",
                vocab_size=VOCAB,
                max_position_embeddings=32,
                relative_attention=True,
                position_buckets=8,
                pos_att_type=["p2c", "c2p"],
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "bloom",
            _hf(
                "BloomModel",
                "BloomConfig",
                vocab_size=VOCAB,
                hidden_size=32,
                n_layer=2,
                n_head=2,
                use_cache=False,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(  # masks with -1e4: w * b + -1e4 * (1 - b)
            "openai_gpt",
            _hf(
                "OpenAIGPTModel",
                "OpenAIGPTConfig",
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=2,
                n_positions=32,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(  # masks padding with (1 - mask) * -10000
            "markuplm",
            _hf(
                "MarkupLMModel",
                "MarkupLMConfig",
                _Padded,
                vocab_size=VOCAB,
                max_position_embeddings=64,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "mpt",
            _hf(
                "MptModel",
                "MptConfig",
                vocab_size=VOCAB,
                d_model=32,
                n_layers=2,
                n_heads=2,
                max_seq_len=32,
                use_cache=False,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "falcon",
            _hf(
                "FalconModel",
                "FalconConfig",
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                parallel_attn=True,
                new_decoder_architecture=False,
                alibi=False,
                use_cache=False,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "dinov2",
            _hf("Dinov2Model", "Dinov2Config", _PIXELS, image_size=32, patch_size=8, **SMALL),
            (4, 3, 40, 40),
            "vision",
        ),
        SweepModel(
            "w2v2_conformer",
            _hf(
                "Wav2Vec2ConformerModel",
                "Wav2Vec2ConformerConfig",
                _AUDIO,
                **_AUDIO_FRONT,
                conv_depthwise_kernel_size=3,
                position_embeddings_type="rotary",
                vocab_size=VOCAB,
                **SMALL,
            ),
            (4, 400),
        ),
        SweepModel(
            "nemotron",
            _hf(
                "NemotronModel",
                "NemotronConfig",
                vocab_size=VOCAB,
                max_position_embeddings=32,
                num_key_value_heads=1,
                use_cache=False,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "persimmon",
            _hf(
                "PersimmonModel",
                "PersimmonConfig",
                vocab_size=VOCAB,
                max_position_embeddings=32,
                use_cache=False,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "opt",
            _hf(
                "OPTModel",
                "OPTConfig",
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                ffn_dim=64,
                word_embed_proj_dim=16,
                max_position_embeddings=32,
                use_cache=False,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "cohere",
            _hf(
                "CohereModel",
                "CohereConfig",
                vocab_size=VOCAB,
                max_position_embeddings=32,
                num_key_value_heads=1,
                use_qk_norm=True,
                use_cache=False,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "gemma3",
            _hf(
                "Gemma3TextModel",
                "Gemma3TextConfig",
                vocab_size=VOCAB,
                max_position_embeddings=32,
                num_key_value_heads=1,
                head_dim=16,
                sliding_window=4,
                use_cache=False,
                **SMALL,
            ),
            TEXT,
            "tokens",
        ),
        SweepModel(
            "data2vec_vision",
            _hf(
                "Data2VecVisionModel",
                "Data2VecVisionConfig",
                _PIXELS,
                image_size=32,
                patch_size=8,
                use_relative_position_bias=True,
                **SMALL,
            ),
            IMG,
            "vision",
        ),
        SweepModel(
            "videomae",
            _hf(
                "VideoMAEModel",
                "VideoMAEConfig",
                _PIXELS,
                image_size=32,
                patch_size=8,
                num_frames=4,
                tubelet_size=2,
                **SMALL,
            ),
            (4, 4, 3, 32, 32),
            "vision",
        ),
        SweepModel(
            "sew",
            _hf(
                "SEWModel",
                "SEWConfig",
                _AUDIO,
                **_AUDIO_FRONT,
                squeeze_factor=2,
                vocab_size=VOCAB,
                **SMALL,
            ),
            (4, 400),
        ),
        SweepModel(
            "yolos",
            _hf(
                "YolosModel",
                "YolosConfig",
                _PIXELS,
                image_size=[32, 32],
                patch_size=8,
                num_detection_tokens=4,
                **SMALL,
            ),
            IMG,
            "vision",
        ),
        SweepModel(
            "patchtst",
            _hf(
                "PatchTSTModel",
                "PatchTSTConfig",
                functools.partial(_First, key="past_values"),
                num_input_channels=3,
                context_length=32,
                patch_length=8,
                patch_stride=8,
                d_model=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                ffn_dim=64,
            ),
            (4, 32, 3),
        ),
    )
}


def export(model: nn.Module, example: tuple[torch.Tensor, ...]) -> tuple[torch.export.ExportedProgram, str]:
    """Export with a dynamic batch if torch.export allows it, else static."""
    batch = torch.export.Dim("batch", min=1, max=64)
    try:
        return torch.export.export(model, example, dynamic_shapes=({0: batch},)), "dyn"
    except Exception:
        return torch.export.export(model, example), "static"


def steps(program_out: list[Any], artifact_out: list[Any]) -> float:
    """The largest artifact-vs-program difference in steps of an 8-bit grid over the output's range."""
    worst = 0.0
    for p, a in zip(program_out, artifact_out, strict=True):
        p64, a64 = torch.as_tensor(p).double(), torch.as_tensor(a).double()
        step = float(p64.max() - p64.min()) / 255 or 1.0
        worst = max(worst, float((p64 - a64).abs().max()) / step)
    return worst


def _model_bytes(path: Path) -> bytes:
    """A saved ONNX model as one serialized proto, its external data (``model.onnx.data``, written
    for large models) read in."""
    import onnx

    return bytes(onnx.load(str(path)).SerializeToString())


def one_case(
    program: torch.export.ExportedProgram,
    backend: str,
    preset: str,
    calibration: list[Any],
    held_out: list[Any],
    reference: list[Any],
) -> str:
    q = quantizer(backend, preset)
    prepared = quantplug.prepare(program, q)
    run(prepared, calibration)
    converted = quantplug.convert(prepared)
    program_out = run(converted, held_out)
    result = f"ok {sqnr(reference, program_out):.1f}"
    artifact = quantplug.lower(converted, q)
    with tempfile.TemporaryDirectory() as out:
        artifact.save(out)
        model = _model_bytes(Path(out) / "model.onnx")
    if backend == "qnn_htp":  # pure Q/DQ, and as Q/DQ arithmetic within 1 dB of the program
        offenders = pure_qdq.integer_domain_ops(onnx.load_from_string(model))
        if offenders:
            raise AssertionError(
                f"model.onnx is not pure Q/DQ: {offenders[0]} (and {len(offenders) - 1} more)"
            )
        onnx_out = pure_qdq.run_without_optimizations(model, held_out)
        gap = pure_qdq.decibels_below(reference, program_out, onnx_out)
        if gap > 1.0:
            raise AssertionError(f"model.onnx run as Q/DQ arithmetic is {gap:.2f} dB below the program")
        result += f" onnx {-gap:+.2f}dB"
    runner = getattr(artifact, "run", None)
    if callable(runner):
        artifact_out = [runner(*batch) for batch in held_out]
        result += f" art {sqnr(reference, artifact_out):.1f} d{steps(program_out, artifact_out):.1f}"
    return result


def failure(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"FAIL {type(exc).__name__}: {first[:160]}"


def sweep(name: str, presets: tuple[tuple[str, str], ...] = PRESETS, verbose: bool = False) -> dict[str, str]:
    spec = SWEEP[name]
    gen = torch.Generator().manual_seed(1234)
    rows: dict[str, str] = {}
    try:
        with quiet():
            model = spec.build()
            example = spec.draw(gen)
            program, how = export(model, example)
    except Exception as exc:
        return {"export": failure(exc)}
    rows["export"] = how
    calibration = [spec.draw(gen) for _ in range(2)]
    held_out = [spec.draw(gen) for _ in range(2)]
    # on a copy: a model that writes its own weights on its first call (RWKV) would write the
    # program's too (they share tensors), and the program applies that write itself
    reference = run(copy.deepcopy(model), held_out)
    for backend, preset in presets:
        start = time.perf_counter()
        try:
            with quiet():
                rows[f"{backend}:{preset}"] = one_case(
                    program, backend, preset, calibration, held_out, reference
                )
        except Exception as exc:
            rows[f"{backend}:{preset}"] = failure(exc)
            if verbose:
                traceback.print_exc()
        rows[f"{backend}:{preset}"] += f" ({time.perf_counter() - start:.0f}s)"
    return rows


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    names = [a for a in argv if not a.startswith("-")] or list(SWEEP)
    torch.set_num_threads(1)
    failed = 0
    for name in names:
        rows = sweep(name, verbose=verbose)
        for case, result in rows.items():
            print(f"{name:18} {case:28} {result}", flush=True)
            failed += "FAIL" in result
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
