"""Helpers shared by the reference rules modules."""

from __future__ import annotations

from torch.fx import Node

from quantplug.backend import (
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationConfig,
    QuantizationSpec,
    SharedQuantizationSpec,
    get_annotation,
    output_spec_of,
)


def reuse_fixed_inputs(node: Node) -> None:
    """Input edges fed by a fixed-qparams output (sigmoid, tanh...) reuse that encoding.

    The tensor is already on the fixed grid; measuring it again would only add a second
    rounding (and a second quantize). Only plain activation specs of the same dtype are
    replaced; weights, derived and explicitly shared specs are left as they are. Not for cat,
    whose inputs must all share one (measured) encoding.
    """
    ann = get_annotation(node)
    if not isinstance(ann, QuantizationAnnotation):
        return
    for arg, spec in list(ann.input_qspec_map.items()):
        produced = output_spec_of(arg)
        if (
            isinstance(produced, FixedQParamsQuantizationSpec)
            and isinstance(spec, QuantizationSpec)
            and not spec.is_dynamic
            and not produced.is_dynamic
            and spec.dtype == produced.dtype
        ):
            ann.input_qspec_map[arg] = SharedQuantizationSpec(arg)


def static_activations(config: QuantizationConfig) -> bool:
    """The config quantizes activations with calibrated (static) encodings.

    False for weight-only configs (no activation spec) and dynamic ones: only weighted ops
    (linear, embedding) take part in those; everything else stays float.
    """
    spec = config.input_activation
    return spec is not None and not getattr(spec, "is_dynamic", False)


def weight_only(config: QuantizationConfig) -> bool:
    """The config quantizes weights and nothing else."""
    return config.input_activation is None and config.output_activation is None and config.weight is not None
