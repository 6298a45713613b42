"""Real architectures for the qnn_htp tests: torchvision and transformers models, random weights.

Nothing is downloaded: torchvision models are built with ``weights=None``, transformers models
from small configs. The packages come from ``scripts/setup.sh --test``; a test skips when one is
missing.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from ..torchvision_compat import ensure_importable


def torchvision_models() -> ModuleType:
    """``torchvision.models`` (skips the test where torchvision is not installed)."""
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (scripts/setup.sh --test installs it)")
    ensure_importable()
    return importlib.import_module("torchvision.models")


def torchvision_model(name: str, **kwargs: Any) -> nn.Module:
    return getattr(torchvision_models(), name)(weights=None, **kwargs).eval()


def small_vit(num_classes: int = 10, hidden: int = 32, layers: int = 2) -> nn.Module:
    """torchvision's VisionTransformer on 32x32 images (class token: a ``cat``)."""
    vit = torchvision_models().vision_transformer
    return vit.VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=layers,
        num_heads=2,
        hidden_dim=hidden,
        mlp_dim=2 * hidden,
        num_classes=num_classes,
    ).eval()


def _transformers() -> ModuleType:
    ensure_importable()  # transformers imports torchvision where it is installed
    return pytest.importorskip("transformers")


class LogitsOnly(nn.Module):
    """A transformers causal LM called with token ids, returning only the logits tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def tiny_gpt2(n_embd: int = 32, n_layer: int = 2, n_head: int = 2, vocab: int = 64) -> nn.Module:
    """Hugging Face GPT-2 (``Conv1D``: ``addmm(bias, x.view(-1, d), W)``) from a tiny config."""
    tf = _transformers()
    config = tf.GPT2Config(
        vocab_size=vocab,
        n_positions=32,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    torch.manual_seed(0)
    return LogitsOnly(tf.GPT2LMHeadModel(config)).eval()


def tiny_llama(
    hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 64
) -> nn.Module:
    """Llama with grouped-query attention (``kv_heads < heads``: K/V heads repeated), tiny config."""
    tf = _transformers()
    config = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
        use_cache=False,
    )
    torch.manual_seed(0)
    return LogitsOnly(tf.LlamaForCausalLM(config)).eval()


def token_batches(vocab: int, shape: tuple[int, int], count: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, shape, generator=g) for _ in range(count)]
