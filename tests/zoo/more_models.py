"""More architectures for the algorithm sweep: ten transformers language models, seven
torchvision families and four torch.nn patterns the zoo (:mod:`tests.zoo.models`) does not have.

Built the same way (seeded random weights, small widths, the zoo's inputs and its LSUV scaling of
vision models). They are swept by ``python -m tests.zoo.algorithms_sweep --more``, and
``tests/zoo/test_more_models.py`` checks that each quantizes at 16 bits to about what its float
numerics allow: the sweep of these models found OPT's float position ids (5 dB at 16a16w before
index arithmetic stayed float, 36.7 after).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.zoo.models import VOCAB, ZooModel, _torchvision, hugging_face

# --- transformers ----------------------------------------------------------------------------------

_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=32,
    use_cache=False,
)


_mistral = hugging_face(
    "MistralForCausalLM", "MistralConfig", **_SMALL, num_key_value_heads=2, sliding_window=None
)
_qwen2 = hugging_face("Qwen2ForCausalLM", "Qwen2Config", **_SMALL, num_key_value_heads=2)
_phi3 = hugging_face(
    "Phi3ForCausalLM",
    "Phi3Config",
    **_SMALL,
    num_key_value_heads=2,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
_opt = hugging_face(
    "OPTForCausalLM",
    "OPTConfig",
    vocab_size=VOCAB,
    hidden_size=32,
    ffn_dim=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=32,
    word_embed_proj_dim=32,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
_distilbert = hugging_face(
    "DistilBertModel",
    "DistilBertConfig",
    vocab_size=VOCAB,
    dim=32,
    hidden_dim=64,
    n_layers=2,
    n_heads=2,
    max_position_embeddings=32,
    pad_token_id=0,
)
_roberta = hugging_face(
    "RobertaModel",
    "RobertaConfig",
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=40,
    pad_token_id=1,
)
_t5 = hugging_face(
    "T5EncoderModel",
    "T5Config",
    vocab_size=VOCAB,
    d_model=32,
    d_kv=16,
    d_ff=64,
    num_layers=2,
    num_heads=2,
    use_cache=False,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)
_falcon = hugging_face(
    "FalconForCausalLM",
    "FalconConfig",
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=32,
    use_cache=False,
    bos_token_id=0,
    eos_token_id=0,
)
_bloom = hugging_face(
    "BloomForCausalLM",
    "BloomConfig",
    vocab_size=VOCAB,
    hidden_size=32,
    n_layer=2,
    n_head=4,
    use_cache=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
_neox = hugging_face(
    "GPTNeoXForCausalLM",
    "GPTNeoXConfig",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=32,
    use_cache=False,
    bos_token_id=0,
    eos_token_id=0,
)

# --- torchvision -----------------------------------------------------------------------------------


def _densenet_small() -> nn.Module:
    from torchvision.models import DenseNet

    return DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, num_classes=10)


def _resnext_small() -> nn.Module:
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, groups=4, width_per_group=8)


def _swin_small() -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    swin = SwinTransformer(
        patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4], num_classes=10
    )
    return swin


# --- torch.nn --------------------------------------------------------------------------------------


class TemporalConv(nn.Module):
    """Conv1d over the time axis (after a transpose), dilated second conv, linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(16, 32, 3, padding=1)
        self.c2 = nn.Conv1d(32, 16, 3, padding=2, dilation=2)
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c2(torch.relu(self.c1(x.transpose(1, 2)))).transpose(1, 2)
        return self.head(torch.relu(y))  # type: ignore[no-any-return]


class DecoderSelfMemory(nn.Module):
    """nn.TransformerDecoder (2 layers, width 16) whose memory is the input itself."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x, x)  # type: ignore[no-any-return]


class MhaModel(nn.Module):
    """nn.MultiheadAttention used directly (batch_first), a residual, LayerNorm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(self.norm(h + a))  # type: ignore[no-any-return]


class GluMlp(nn.Module):
    """Two gated (SwiGLU) MLP blocks with residuals, bias=False everywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "gate": nn.Linear(16, 48, bias=False),
                    "up": nn.Linear(16, 48, bias=False),
                    "down": nn.Linear(48, 16, bias=False),
                }
            )
            for _ in range(2)
        )
        self.head = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b["down"](F.silu(b["gate"](x)) * b["up"](x))
        return self.head(x)  # type: ignore[no-any-return]


MORE_MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel("mistral", "text", _mistral, "transformers"),
        ZooModel("qwen2", "text", _qwen2, "transformers"),
        ZooModel("phi3", "text", _phi3, "transformers"),
        ZooModel("opt", "text", _opt, "transformers"),
        ZooModel("distilbert", "text", _distilbert, "transformers"),
        ZooModel("roberta", "text", _roberta, "transformers"),
        ZooModel("t5_encoder", "text", _t5, "transformers"),
        ZooModel("falcon", "text", _falcon, "transformers"),
        ZooModel("bloom", "text", _bloom, "transformers"),
        ZooModel("gpt_neox", "text", _neox, "transformers"),
        ZooModel(
            "googlenet",
            "vision",
            _torchvision("googlenet", aux_logits=False, init_weights=True),
            "torchvision",
        ),
        ZooModel("densenet_small", "vision", _densenet_small, "torchvision"),
        ZooModel("mnasnet0_5", "vision", _torchvision("mnasnet0_5"), "torchvision"),
        ZooModel("regnet_y_400mf", "vision", _torchvision("regnet_y_400mf"), "torchvision"),
        ZooModel("resnext_small", "vision", _resnext_small, "torchvision"),
        ZooModel("mobilenet_v3_large", "vision", _torchvision("mobilenet_v3_large"), "torchvision"),
        ZooModel("swin_small", "vision", _swin_small, "torchvision"),
        ZooModel("temporal_conv", "sequence", TemporalConv),
        ZooModel("decoder_self_memory", "sequence", DecoderSelfMemory),
        ZooModel("mha", "sequence", MhaModel),
        ZooModel("glu_mlp", "sequence", GluMlp),
    )
}
