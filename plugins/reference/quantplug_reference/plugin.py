"""Hook implementations of the ``reference`` backend (entry point ``quantplug.backends``)."""

from __future__ import annotations

from collections.abc import Sequence

import quantplug
from quantplug.backend import (
    BackendContext,
    BackendInfo,
    BackendOption,
    ConformanceProfile,
    FusionPattern,
    NamedPass,
    OpConstraint,
    Preset,
    RulesModule,
    rules_from_index,
)
from quantplug_reference import configs

INFO = BackendInfo(
    name="reference",
    description="Generic int8 CPU quantization; the numerical reference for other backends",
    options=(
        BackendOption("preset", str, "int8", "precision preset", choices=tuple(configs.PRESETS)),
        BackendOption(
            "activation_dtype",
            str,
            "uint8",
            "8-bit activation grid (16-bit for a16w8)",
            choices=("uint8", "int8"),
        ),
        BackendOption(
            "activation_observer",
            str,
            "histogram",
            "how activation ranges are measured",
            choices=configs.ACTIVATION_OBSERVERS,
        ),
        BackendOption(
            "group_size",
            int,
            0,
            "inputs per weight group for weight-only presets (0: per channel for weight_only_int8, "
            f"{configs.DEFAULT_INT4_GROUP} for weight_only_int4)",
            choices=configs.GROUP_SIZES,
        ),
        BackendOption(
            "weight_bits",
            int,
            7,
            "grid of conv/linear weights multiplied as integers (int8, int8_per_tensor, dynamic_int8): "
            "7 = [-64, 64], exact with ORT's fast U8S8 kernels on every CPU; 8 = [-127, 127], stored "
            "as uint8 for ORT's U8U8 kernels (exact too, about half as fast on VNNI CPUs)",
            choices=configs.WEIGHT_BITS,
        ),
        BackendOption(
            "onnx_opset",
            int,
            21,
            "ONNX opset of the lowered model (18 and later; Q/DQ of 16/4-bit and per-block grids needs "
            "21; ONNX Runtime 1.32 runs up to 27)",
            minimum=18,
            maximum=27,
        ),
        BackendOption(
            "ort_threads",
            int,
            0,
            "ONNX Runtime intra-op threads for artifact.run (0: ORT's default)",
            minimum=0,
            maximum=1024,
        ),
    ),
    presets=tuple(Preset(name, text) for name, text in configs.PRESETS.items()),
    preset_option="preset",
    requires_api="1.1",
)


@quantplug.hookimpl
def quantplug_backend_info() -> BackendInfo:
    return INFO


@quantplug.hookimpl
def quantplug_annotation_rules(context: BackendContext) -> Sequence[RulesModule]:
    return rules_from_index("quantplug_reference.rules")


@quantplug.hookimpl
def quantplug_quantization_config(
    preset: str | None, context: BackendContext
) -> quantplug.QuantizationConfig:
    return configs.build_config(preset or "int8", context.options)


@quantplug.hookimpl
def quantplug_op_constraints(
    op: str, backend_op: str | None, context: BackendContext
) -> Sequence[OpConstraint]:
    """What the ONNX Runtime lowering requires of each op (``constraints``)."""
    from quantplug_reference.constraints import constraints_for

    return constraints_for(op, int(context.option("onnx_opset", 21) or 21))


@quantplug.hookimpl
def quantplug_fusion_patterns(context: BackendContext) -> Sequence[FusionPattern]:
    from quantplug_reference.rules.fusion import PATTERNS

    return PATTERNS


@quantplug.hookimpl
def quantplug_passes_before_annotation(context: BackendContext) -> Sequence[NamedPass]:
    return ()


@quantplug.hookimpl
def quantplug_conformance_profile(context: BackendContext) -> ConformanceProfile:
    """What ``quantplug conformance reference`` checks the artifact for."""
    return ConformanceProfile(artifact_files=("model.onnx", "encodings.json", "model.pt2"))


@quantplug.hookimpl
def quantplug_artifact_writer(context: BackendContext):  # type: ignore[no-untyped-def]
    from quantplug_reference.lowering import write_artifact

    return write_artifact
