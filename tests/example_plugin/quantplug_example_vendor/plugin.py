"""Hook implementations of the ``example_vendor`` backend.

Declared in pyproject.toml as::

    [project.entry-points."quantplug.backends"]
    example_vendor = "quantplug_example_vendor.plugin"

The core imports this module only when a user calls ``get_quantizer("example_vendor", ...)``;
it keeps its own imports light and defers the rules, passes and writer to when they are used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.fx import GraphModule, Node

import quantplug
from quantplug.backend import (
    Artifact,
    BackendContext,
    BackendInfo,
    BackendOption,
    ConformanceProfile,
    FusionPattern,
    Key,
    NamedPass,
    OpConstraint,
    Preset,
    QuantizationConfig,
    QuantizationSpec,
    RulesModule,
    SharingGroups,
    SharingProblem,
    rules_from_index,
)
from quantplug_example_vendor import configs

INFO = BackendInfo(
    name="example_vendor",
    description="Example vendor NPU (EV100/EV200/EV300): the worked example of writing a backend",
    options=(
        BackendOption("precision", str, "8a8w", "precision preset", choices=tuple(configs.PRESETS)),
        BackendOption("chip", str, "EV200", "target chip", choices=tuple(configs.CHIPS)),
        BackendOption("block_size", int, 16, "inputs per weight block (8a4w_block)", choices=(8, 16, 32, 64)),
        BackendOption("lift_scalars", bool, True, "quantize scalar operands of add as constants"),
        BackendOption("drop_relu", bool, True, "let the quantize stage apply relus (exact)"),
    ),
    presets=tuple(Preset(name, text) for name, text in configs.PRESETS.items()),
    preset_option="precision",
    requires_api="1.1",
)


@quantplug.hookimpl
def quantplug_backend_info() -> BackendInfo:
    return INFO


@quantplug.hookimpl
def quantplug_annotation_rules(context: BackendContext) -> Sequence[RulesModule]:
    # the ops each module covers are its @register_annotator declarations, indexed in rules/rules.json
    return rules_from_index("quantplug_example_vendor.rules", ["weighted_rules", "elementwise_rules"])


@quantplug.hookimpl
def quantplug_quantization_config(preset: str | None, context: BackendContext) -> QuantizationConfig:
    return configs.build_config(preset or "8a8w", context.options)


@quantplug.hookimpl
def quantplug_target_arch(context: BackendContext) -> int:
    arch = configs.CHIPS[context.option("chip")]
    context.state["arch"] = arch  # the artifact writer reports it
    return arch


@quantplug.hookimpl
def quantplug_op_constraints(
    op: str, backend_op: str | None, context: BackendContext
) -> Sequence[OpConstraint]:
    from quantplug_example_vendor.constraints import constraints_for

    return constraints_for(backend_op)


@quantplug.hookimpl
def quantplug_resolve_sharing(
    problem: SharingProblem,
    resolve: Callable[[SharingProblem], SharingGroups],
    context: BackendContext,
) -> SharingGroups | None:
    """Concat unification: all inputs of a ``cat`` share one observer (the chip's Concat
    copies bytes and cannot rescale)."""
    if problem.graph is None:
        return None
    merges: list[tuple[Key, Key]] = []
    for node in problem.graph.nodes:
        if node.op != "call_function" or node.target != torch.ops.aten.cat.default:
            continue
        tensors = node.args[0] if isinstance(node.args[0], list) else []
        # keys are node names: an input edge is (producer name, consumer name)
        edges: list[Key] = [(a.name, node.name) for a in tensors if isinstance(a, Node)]
        edges = [e for e in dict.fromkeys(edges) if e in problem.specs]  # annotated ones, once
        merges.extend((edges[0], e) for e in edges[1:])
    if not merges:
        return None  # the core resolves the problem unchanged
    return resolve(problem.with_merges(merges))


def _relu_output_is_8_bit(head: Node, tail: Node, context: BackendContext) -> bool:
    """The matrix unit's relu stage writes 8-bit results: a relu quantized to 16 bits runs on its
    own, after the linear/conv's 16-bit output."""
    config = context.config_for(tail)
    output = config.output_activation if config is not None else None
    return isinstance(output, QuantizationSpec) and output.dtype == torch.uint8


#: the matrix unit applies a relu on its way out: linear/conv + relu is one kernel, when the relu's
#: output is 8-bit. A relu the user keeps float leaves the linear/conv quantized on its own.
FUSIONS = (
    FusionPattern(
        ["aten.linear.default", "aten.conv2d.default"],
        ["aten.relu.default"],
        when_tail_float="quantize_head",
        name="matrix unit + relu",
        when=_relu_output_is_8_bit,
    ),
)


@quantplug.hookimpl
def quantplug_fusion_patterns(context: BackendContext) -> Sequence[FusionPattern]:
    return FUSIONS


@quantplug.hookimpl
def quantplug_passes_before_annotation(context: BackendContext) -> Sequence[NamedPass]:
    from quantplug_example_vendor.passes import lift_scalar_operands

    return [NamedPass("lift_scalar_operands", lift_scalar_operands)] if context.option("lift_scalars") else []


@quantplug.hookimpl
def quantplug_annotation_passes(context: BackendContext) -> Sequence[NamedPass]:
    from quantplug_example_vendor.passes import share_data_movement

    return [NamedPass("share_data_movement", share_data_movement)]


@quantplug.hookimpl
def quantplug_io_config(context: BackendContext) -> QuantizationConfig | None:
    """A chip with a quantized host interface takes uint8 in and gives uint8 out (EV300)."""
    if configs.CHIPS[context.option("chip")] < configs.QUANTIZED_IO_MIN_ARCH:
        return None  # the host passes float tensors: inputs and outputs as the rules leave them
    return configs.host_io_config()


@quantplug.hookimpl
def quantplug_lowering_passes(context: BackendContext) -> Sequence[NamedPass]:
    from quantplug_example_vendor.passes import check_standalone_relus, drop_redundant_relu

    passes = [NamedPass("drop_redundant_relu", drop_redundant_relu)] if context.option("drop_relu") else []
    return [*passes, NamedPass("check_standalone_relus", check_standalone_relus)]


@quantplug.hookimpl
def quantplug_artifact_writer(context: BackendContext) -> Callable[[GraphModule, BackendContext], Artifact]:
    from quantplug_example_vendor.writer import write_artifact

    return write_artifact


@quantplug.hookimpl
def quantplug_conformance_profile(context: BackendContext) -> ConformanceProfile:
    """What ``quantplug conformance example_vendor`` checks beyond its defaults."""
    from quantplug_example_vendor.writer import ENCODINGS_FILE

    return ConformanceProfile(artifact_files=(ENCODINGS_FILE,))
