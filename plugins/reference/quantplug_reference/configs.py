"""The reference backend's presets, as QuantizationConfigs built from the options.

Static presets quantize activations (measured during calibration), weights and biases. The
weight-only presets quantize only the weights of linear layers and embedding tables (activations
stay float). ``dynamic_int8`` quantizes each linear layer's input at run time, one scale and zero
point per token (row), with int8 per-channel weights.

The weights of integer products (convolutions and linears whose input is 8-bit) sit on the
``[-64, 64]`` grid by default (``weight_bits=7``): ONNX Runtime multiplies them with its U8S8
kernels, whose AVX2 / AVX-512BW form (VPMADDUBSW) adds two u8 x s8 products in a saturating
int16; with |w| <= 64 that sum is at most 2 * 255 * 64 = 32640 and never saturates, so the
artifact is exact on every CPU at full speed. ``weight_bits=8`` keeps ``[-127, 127]``; the
lowering then stores those weights as uint8 (``w + 128``, zero point 128) so that ORT runs its
U8U8 kernels, exact everywhere but about half as fast on CPUs with VNNI. Depthwise convolutions
(whose kernels widen to 16 bits on every CPU) and embedding tables (no products) always keep
``[-127, 127]``. See the plugin README for the measured costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from quantplug.backend import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    ObserverFactory,
    OptionError,
    PerChannelMinMaxObserver,
    QuantizationConfig,
    QuantizationSpec,
    derived_bias_spec,
)
from quantplug_reference.peers.accumulation import SATURATION_FREE_WEIGHT_MAX

PRESETS: dict[str, str] = {
    "int8": "uint8/int8 asymmetric activations, int8 per-channel symmetric weights, int32 bias",
    "int8_per_tensor": "as int8, with one weight scale per tensor",
    "a16w8": "16-bit asymmetric activations, int8 per-channel weights, int32 bias",
    "weight_only_int8": "int8 symmetric weights of linear/embedding/LSTM/GRU/RNN/mixture-of-experts "
    "(per channel, or per group with group_size); activations stay float",
    "weight_only_int4": "int4 symmetric weights of linear/LSTM/GRU/RNN/mixture-of-experts, per group "
    "of group_size inputs (default 32), each group's range clipped to its least squared error; "
    "embedding tables int8 per row; activations stay float",
    "dynamic_int8": "linear inputs quantized at run time to int8 per token (row), int8 per-channel "
    "weights, float bias and outputs; mixture-of-experts weights int8 per expert row",
}
#: presets that measure activations during calibration (the others need no calibration data)
STATIC_PRESETS = ("int8", "int8_per_tensor", "a16w8")
WEIGHT_ONLY_PRESETS = ("weight_only_int8", "weight_only_int4")
ACTIVATION_OBSERVERS = ("minmax", "moving_average", "histogram")
GROUP_SIZES = (0, 16, 32, 64, 128, 256)
DEFAULT_INT4_GROUP = 32
#: the smallest scale of weights (XNNPACK's)
EPS = 2**-12
#: the smallest scale of activations: float32's eps, torch's observers' default. 2**-12 there gave
#: every 8-bit tensor narrower than 255 * 2**-12 = 0.062 fewer than 255 steps (Gemma 2's soft-capped
#: logits, about +-0.00025 with random weights, landed on 0 or 1 step: 4.7 dB at int8, now 17.7),
#: and every 16-bit one narrower than 16 a coarse grid (the zoo's Llama at a16w8: 20.3 dB, now 41.7)
ACTIVATION_EPS = float(torch.finfo(torch.float32).eps)
#: the smallest scale of weights no integer product reads (weight-only presets' weights, embedding
#: tables, gathered expert weights): they dequantize to float, so XNNPACK's floor buys nothing and
#: an absolute floor cuts a table of small values (RWKV's embeddings: standard deviation 1e-4 with
#: its own initialisation, before a layer norm) to a step or two per row: the zoo's RWKV program at
#: weight_only_int8 1.8 dB, 35.7 with this floor
DEQUANTIZED_WEIGHT_EPS = ACTIVATION_EPS
#: 16-bit activations cover 4 times their calibrated range (``range_margin``): held-out values
#: beyond a few calibration batches' range (and the tails the histogram observer clips, which
#: 65535 steps can afford to keep) fall inside, at the cost of 2 of 16 bits. On the zoo's 17
#: models at a16w8 (held out), against the 2**-12 floor: 14 better (up to +23.6 dB), 2 within
#: 0.05, ViT -0.2; a margin of 2 gives EfficientNet-B0 13 dB less, 16 costs ViT 5.8
#: (``bench/results/activation_margin.md``)
ACTIVATION_MARGIN_16BIT = 4.0
#: presets whose linears/convs multiply 8-bit integers in ORT (weight_bits applies to them)
INTEGER_PRODUCT_PRESETS = ("int8", "int8_per_tensor", "dynamic_int8")
WEIGHT_BITS = (7, 8)
INT8_WEIGHT_MAX = 127


def activation_observer(name: str, margin: float = 1.0) -> ObserverFactory:
    if name == "minmax":
        return MinMaxObserver.with_args(eps=ACTIVATION_EPS, range_margin=margin)
    if name == "moving_average":
        return MovingAverageMinMaxObserver.with_args(eps=ACTIVATION_EPS, range_margin=margin)
    if name == "histogram":
        from quantplug.backend import HistogramObserver

        return HistogramObserver.with_args(eps=ACTIVATION_EPS, range_margin=margin)
    raise OptionError(f"unknown activation_observer {name!r}; valid: {', '.join(ACTIVATION_OBSERVERS)}")


def per_channel_weight(
    dtype: torch.dtype = torch.int8, int8_max: int = INT8_WEIGHT_MAX, eps: float = EPS
) -> QuantizationSpec:
    """Symmetric weights, one scale per output channel (axis 0); int8 ones on ``[-int8_max, int8_max]``."""
    qmin, qmax = (-int8_max, int8_max) if dtype == torch.int8 else (-8, 7)
    return QuantizationSpec(
        dtype=dtype,
        quant_min=qmin,
        quant_max=qmax,
        qscheme=torch.per_channel_symmetric,
        ch_axis=0,
        observer_or_fake_quant_ctr=PerChannelMinMaxObserver.with_args(eps=eps),
    )


def per_group_weight(dtype: torch.dtype, group: int, eps: float = EPS) -> QuantizationSpec:
    """Symmetric weights, one scale per output channel and group of ``group`` inputs; 4-bit
    groups clipped to their range of least squared error (``observers``), 8-bit ones min-max."""
    from quantplug.backend import PerBlockMinMaxObserver
    from quantplug_reference.observers import ClippedPerBlockObserver

    observer = PerBlockMinMaxObserver if dtype == torch.int8 else ClippedPerBlockObserver

    qmin, qmax = (-127, 127) if dtype == torch.int8 else (-8, 7)
    return QuantizationSpec(
        dtype=dtype,
        quant_min=qmin,
        quant_max=qmax,
        qscheme=torch.per_channel_symmetric,
        block_size=(1, group),
        observer_or_fake_quant_ctr=observer.with_args(eps=eps),
    )


def weight_only_spec(preset: str, group_size: int) -> QuantizationSpec:
    int4: torch.dtype = torch.int4  # type: ignore[attr-defined]
    dtype = int4 if preset == "weight_only_int4" else torch.int8
    if dtype == int4 and not group_size:
        group_size = DEFAULT_INT4_GROUP
    if group_size:
        return per_group_weight(dtype, group_size, eps=DEQUANTIZED_WEIGHT_EPS)
    return per_channel_weight(dtype, eps=DEQUANTIZED_WEIGHT_EPS)


def dynamic_token_spec() -> QuantizationSpec:
    """int8, asymmetric, scale and zero point computed per token (last dim) at run time."""
    return QuantizationSpec(
        dtype=torch.int8,
        qscheme=torch.per_channel_affine,
        ch_axis=-1,
        is_dynamic=True,
    )


def full_int8_range(spec: Any) -> Any:
    """``spec`` on the whole symmetric int8 grid ``[-127, 127]`` (for weights that feed no
    saturating product: depthwise convolutions, embedding tables); other specs unchanged."""
    if isinstance(spec, QuantizationSpec) and spec.dtype == torch.int8 and spec.quant_max != INT8_WEIGHT_MAX:
        return dataclasses.replace(spec, quant_min=-INT8_WEIGHT_MAX, quant_max=INT8_WEIGHT_MAX)
    return spec


def embedding_table_spec(spec: Any) -> Any:
    """An embedding table's spec under a config whose weight spec is ``spec``: the lookup table
    spec, but int8 per row where the weights are 4-bit. A table multiplies nothing, so its bytes
    are all that 4 bits save, and they cost: the trained char-level GPT of ``bench/trained`` at
    ``weight_only_int4`` lost 0.0055 more test perplexity with int4 tables than int8 ones
    (``bench/results/trained_int4_grid.md``; torchao and NNCF keep them float or int8)."""
    if isinstance(spec, QuantizationSpec) and spec.dtype not in (torch.int8, torch.uint8):
        spec = per_channel_weight(torch.int8, eps=weight_eps(spec))
    return lookup_table_spec(spec)


def weight_eps(spec: Any) -> float:
    """The scale floor ``spec``'s observer was made with (:data:`EPS` when it names none)."""
    ctr = getattr(spec, "observer_or_fake_quant_ctr", None)
    return float(getattr(ctr, "kwargs", {}).get("eps", EPS))


def lookup_table_spec(spec: Any) -> Any:
    """``spec`` for a table that is looked up and dequantized, never multiplied as integers
    (embedding tables, gathered expert weights): the whole int8 grid, floored at
    :data:`DEQUANTIZED_WEIGHT_EPS`."""
    spec = full_int8_range(spec)
    ctr = getattr(spec, "observer_or_fake_quant_ctr", None)
    if isinstance(spec, QuantizationSpec) and isinstance(ctr, ObserverFactory):
        spec = dataclasses.replace(spec, observer_or_fake_quant_ctr=ctr.with_args(eps=DEQUANTIZED_WEIGHT_EPS))
    return spec


def integer_product_weight_max(options: Mapping[str, Any]) -> int:
    """Largest |weight| of a conv/linear that ORT runs as an integer product (``weight_bits``)."""
    bits = int(options.get("weight_bits") or 7)
    if bits not in WEIGHT_BITS:
        raise OptionError(f"weight_bits must be one of {WEIGHT_BITS}, got {bits}")
    return SATURATION_FREE_WEIGHT_MAX if bits == 7 else INT8_WEIGHT_MAX


def build_config(preset: str, options: Mapping[str, Any]) -> QuantizationConfig:
    """The global config of a preset (see PRESETS)."""
    if preset in WEIGHT_ONLY_PRESETS:
        weight = weight_only_spec(preset, int(options.get("group_size") or 0))
        return QuantizationConfig(input_activation=None, output_activation=None, weight=weight, bias=None)
    if preset == "dynamic_int8":
        return QuantizationConfig(
            input_activation=dynamic_token_spec(),
            output_activation=None,
            weight=per_channel_weight(int8_max=integer_product_weight_max(options)),
            bias=None,
        )
    if preset not in STATIC_PRESETS:
        raise OptionError(f"reference backend has no preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    act_dtype = (
        torch.uint16 if preset == "a16w8" else getattr(torch, options.get("activation_dtype") or "uint8")
    )
    if preset == "a16w8" and options.get("activation_dtype") == "int8":
        act_dtype = torch.int16
    observer = options.get("activation_observer") or "histogram"
    margin = 1.0 if torch.iinfo(act_dtype).bits == 8 else ACTIVATION_MARGIN_16BIT
    act = QuantizationSpec(
        dtype=act_dtype,
        observer_or_fake_quant_ctr=activation_observer(observer, margin),
        qscheme=torch.per_tensor_affine,
    )
    # 16-bit activations never reach ORT's integer kernels: their weights keep all 8 bits
    weight_max = INT8_WEIGHT_MAX if preset == "a16w8" else integer_product_weight_max(options)
    if preset == "int8_per_tensor":
        weight = QuantizationSpec(
            dtype=torch.int8,
            quant_min=-weight_max,
            quant_max=weight_max,
            qscheme=torch.per_tensor_symmetric,
            observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=EPS),
        )
    else:
        weight = per_channel_weight(int8_max=weight_max)

    def bias(node: torch.fx.Node) -> Any:
        return derived_bias_spec(node, weight_spec=weight)

    return QuantizationConfig(input_activation=act, output_activation=act, weight=weight, bias=bias)
