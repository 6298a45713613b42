"""Spec values: immutable, validated at construction with messages that say what to change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _quantplug.annotation.dtypes import INT4, UINT4, bit_width, full_range, storage_dtype
from quantplug import AnnotationError, FixedQParamsQuantizationSpec, QuantizationConfig, QuantizationSpec


def test_specs_are_frozen_values() -> None:
    spec = QuantizationSpec(dtype=torch.uint8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.quant_min = 3  # type: ignore[misc]
    assert spec == QuantizationSpec(dtype=torch.uint8) and hash(spec) == hash(
        QuantizationSpec(dtype=torch.uint8)
    )
    config = QuantizationConfig(spec, spec, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.weight = spec  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": torch.uint8, "quant_min": 10, "quant_max": 3}, "quant_min 10 must be <= quant_max 3"),
        ({"dtype": torch.int8, "quant_min": -200}, r"range \[-200, 127\] does not fit"),
        ({"dtype": torch.float64}, "unsupported quantized dtype"),
        ({"dtype": torch.int8, "qscheme": torch.per_channel_symmetric}, "needs ch_axis"),
        (
            {"dtype": torch.uint8, "is_dynamic": True, "qscheme": torch.per_channel_affine},
            "per-token quantization supports dtype torch.int8 only",
        ),
    ],
)
def test_bad_specs_are_rejected_with_the_reason(kwargs: dict, message: str) -> None:
    with pytest.raises(AnnotationError, match=message):
        QuantizationSpec(**kwargs)


def test_fixed_spec_needs_a_positive_scale() -> None:
    with pytest.raises(AnnotationError, match="positive"):
        FixedQParamsQuantizationSpec(dtype=torch.uint8, scale=0.0, zero_point=0)


def test_sub_byte_and_16_bit_grids_are_first_class() -> None:
    assert full_range(INT4) == (-8, 7) and storage_dtype(INT4) == torch.int8
    assert full_range(UINT4) == (0, 15) and storage_dtype(UINT4) == torch.uint8
    assert full_range(torch.uint16) == (0, 65535) and storage_dtype(torch.uint16) == torch.uint16
    assert QuantizationSpec(dtype=INT4).range == (-8, 7)
    # PT2E's idiom: a 4-bit range in an int8 container counts as 4 bits
    assert bit_width(torch.int8, -8, 7) == 4 and bit_width(torch.int8, -128, 127) == 8
    assert QuantizationSpec(dtype=torch.int8, is_dynamic=True, qscheme=torch.per_channel_affine).is_dynamic
