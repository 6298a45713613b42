"""Hook implementations of the ``qnn_htp`` backend (entry point ``quantplug.backends``).

Only what ``quantplug_backend_info`` needs is imported at module level; passes, the SDK adapter
and the ONNX/encodings writer are imported inside the hooks that use them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import quantplug
from quantplug.backend import (
    Artifact,
    BackendContext,
    BackendInfo,
    BackendOption,
    NamedPass,
    OpConstraint,
    Preset,
    RulesModule,
    rules_from_index,
)
from quantplug_qnn_htp import configs, soc

ENCODINGS_VERSIONS = ("0.6.1", "1.0.0", "2.0.0")
DEFAULT_ENCODINGS_VERSION = "1.0.0"

INFO = BackendInfo(
    name="qnn_htp",
    description="Qualcomm QNN HTP (Hexagon NPU): ExecuTorch QnnQuantizer-compatible rules and precisions",
    options=(
        BackendOption(
            "soc_model", str, soc.DEFAULT_SOC, "target chipset (selects the HTP arch)", choices=soc.SOC_NAMES
        ),
        BackendOption(
            "precision", str, configs.DEFAULT_PRECISION, "precision preset", choices=tuple(configs.PRECISIONS)
        ),
        BackendOption("per_channel_conv", bool, True, "per-channel symmetric conv weights"),
        BackendOption(
            "per_channel_linear",
            bool,
            None,
            "per-channel symmetric linear weights (default: on at 8a4w and 16a4w, always at "
            "16a4w_block and 16a2w, off at 8/16-bit weights; ExecuTorch's is off)",
        ),
        BackendOption(
            "per_channel_embedding",
            bool,
            False,
            "per-channel embedding tables and gathered parameters (mixture-of-experts weights, one "
            "scale per expert) on the weight grid (else the activation grid, shared with the rows)",
        ),
        BackendOption(
            "act_observer",
            str,
            None,
            f"activation range observer (default {configs.DEFAULT_ACT_OBSERVER}, with qat "
            f"{configs.DEFAULT_QAT_ACT_OBSERVER}; ExecuTorch's is moving_average)",
            choices=configs.ACT_OBSERVERS,
        ),
        BackendOption("act_symmetric", bool, False, "symmetric activations (zero point at the grid middle)"),
        BackendOption(
            "act_range_margin",
            float,
            configs.DEFAULT_ACT_RANGE_MARGIN,
            "16-bit activations cover this many times their calibrated range, keeping held-out values "
            "the calibration batches did not reach (1: ExecuTorch's; bench/results/activation_margin.md)",
            minimum=1.0,
            maximum=65536.0,
        ),
        BackendOption(
            "unroll_recurrent",
            bool,
            True,
            "LSTM/GRU/RNN ops with a static sequence length unrolled over their steps, so their weights "
            "and gates are quantized (QNN's --expand_lstm_op_structure); False leaves them float",
        ),
        BackendOption(
            "eps",
            float,
            None,
            "smallest scale (default 1e-4/255 for 8-bit, 1e-4/65535 for 16-bit)",
            exclusive_minimum=0.0,
            maximum=1.0,
        ),
        BackendOption(
            "block_size",
            int,
            configs.DEFAULT_BLOCK_SIZE,
            "16a4w_block: largest LPBQ block along input channels, fitted per layer "
            "(0: only nodes in block_size_map)",
            minimum=0,
            maximum=65536,
        ),
        BackendOption(
            "exact_block_size",
            bool,
            False,
            "16a4w_block: use block_size as given on every layer (a layer whose input channels it "
            "does not divide fails) instead of fitting the block per layer",
            applies_with={"precision": ("16a4w_block",)},
        ),
        BackendOption(
            "block_size_map",
            str,
            None,
            "16a4w_block: per-node block sizes 'node:size,...' (or set_block_size_map(quantizer, {...}))",
            applies_with={"precision": ("16a4w_block",)},
        ),
        BackendOption(
            "qat", bool, False, "QAT variant of the preset (use with quantplug.prepare(..., qat=True))"
        ),
        BackendOption(
            "mask_margin",
            float,
            16.0,
            "-inf masks dequantize this far below the masked tensor's smallest real value",
            exclusive_minimum=0.0,
            maximum=65504.0,
        ),
        BackendOption(
            "encodings_version",
            str,
            DEFAULT_ENCODINGS_VERSION,
            "AIMET/QNN encodings file format written by lower()",
            choices=ENCODINGS_VERSIONS,
        ),
        BackendOption(
            "constraints_source",
            str,
            "auto",
            "op constraints: 'auto' (QNN SDK BackendOpInfo if $QNN_SDK_ROOT has it, else built-in), "
            "'builtin', 'sdk'",
            choices=("auto", "builtin", "sdk"),
        ),
    ),
    presets=tuple(Preset(name, text) for name, text in configs.PRECISIONS.items()),
    preset_option="precision",
    qat_option="qat",
    requires_api="1.1",
)

#: context.state key of the loaded SDK op info (or None: built-in table)
SDK_STATE = "qnn_sdk_opinfo"


def soc_info(context: BackendContext) -> soc.SocInfo:
    found = context.state.get("soc")
    if found is None:
        found = context.state["soc"] = soc.lookup(context.option("soc_model"))
    return found


@quantplug.hookimpl
def quantplug_backend_info() -> BackendInfo:
    return INFO


@quantplug.hookimpl
def quantplug_annotation_rules(context: BackendContext) -> Sequence[RulesModule]:
    return rules_from_index("quantplug_qnn_htp.rules")


@quantplug.hookimpl
def quantplug_quantization_config(
    preset: str | None, context: BackendContext
) -> quantplug.QuantizationConfig:
    soc_info(context)  # an unknown SoC fails here, before anything runs
    context.state[configs.BLOCK_MAP_STATE] = configs.parse_block_size_map(context.option("block_size_map"))
    return configs.build_config(preset, context.options)


@quantplug.hookimpl
def quantplug_target_arch(context: BackendContext) -> int:
    return soc_info(context).htp_arch


def sdk_opinfo(context: BackendContext) -> Any:
    """The QNN SDK's BackendOpInfo for this quantizer's SoC, or None (built-in table); loaded once."""
    if SDK_STATE not in context.state:
        from quantplug_qnn_htp import backend_opinfo

        context.state[SDK_STATE] = backend_opinfo.select(
            context.option("constraints_source") or "auto", soc_info(context).chipset_id
        )
    return context.state[SDK_STATE]


@quantplug.hookimpl
def quantplug_op_constraints(
    op: str, backend_op: str | None, context: BackendContext
) -> Sequence[OpConstraint]:
    from quantplug_qnn_htp import constraints

    if backend_op is None:
        return []
    sdk = sdk_opinfo(context)
    if sdk is not None:
        found = sdk.constraint(backend_op)
        if found is not None:
            return [found]
        # an op the SDK does not list: the architecture gates still apply
        gates = constraints.arch_requirements(backend_op)
        return (
            [OpConstraint(backend_op, arch=gates, source="QNN SDK BackendOpInfo (op not listed)")]
            if gates
            else []
        )
    return constraints.constraints_for(backend_op)


@quantplug.hookimpl
def quantplug_passes_before_annotation(context: BackendContext) -> Sequence[NamedPass]:
    from quantplug_qnn_htp.passes import PASSES

    return [NamedPass(name, fn) for name, fn in PASSES]


@quantplug.hookimpl
def quantplug_resolve_sharing(problem: Any, resolve: Callable[[Any], Any], context: BackendContext) -> Any:
    """Discarded nodes keep their edges float; the steps of an unrolled recurrence share their
    encodings, observed per calibration batch (``quantplug_qnn_htp.recurrent``); each group's
    observer comes from its highest-priority spec (concat and mask-aware observers govern the
    whole group they join, wherever their key sits in graph order). See
    ``quantplug_qnn_htp.sharing``."""
    from quantplug_qnn_htp.recurrent import observe_steps_per_pass, share_steps
    from quantplug_qnn_htp.sharing import drop_discarded_edges, prefer_priority_observers, share_fixed_outputs

    reduced = share_steps(drop_discarded_edges(problem))
    groups = prefer_priority_observers(reduced, share_fixed_outputs(reduced, resolve(reduced)))
    return observe_steps_per_pass(reduced, groups)


@quantplug.hookimpl
def quantplug_lowering_passes(context: BackendContext) -> Sequence[NamedPass]:
    """``qnn_htp.linear_to_2d`` (N-D linears as 2-D FullyConnected layers, exact), then the
    writer's own passes (``check_encodings``)."""
    from quantplug_qnn_htp.fully_connected import linear_to_2d
    from quantplug_qnn_htp.lowering import LOWERING_PASSES

    return [NamedPass("qnn_htp.linear_to_2d", linear_to_2d), *(NamedPass(n, fn) for n, fn in LOWERING_PASSES)]


@quantplug.hookimpl
def quantplug_artifact_writer(context: BackendContext) -> Callable[[Any, BackendContext], Artifact]:
    from quantplug_qnn_htp.lowering import write_artifact

    return write_artifact


@quantplug.hookimpl
def quantplug_conformance_profile(context: BackendContext) -> Any:
    from quantplug_qnn_htp.conformance import PROFILE

    return PROFILE


def set_block_size_map(quantizer: Any, mapping: Any) -> Any:
    """Per-node LPBQ block sizes for a ``qnn_htp`` quantizer (merged over ``block_size_map``).

    ``mapping``: ``{"linear": 16, "conv2d_2": (1, 32, 1, 1)}`` (ExecuTorch's tuples accepted) or
    ``"linear:16,conv2d_2:32"``; 0 keeps a node per-channel. Names are node names after the
    qnn_htp passes (``quantizer.coverage(program)`` lists them). Returns the quantizer.
    """
    if getattr(quantizer, "backend", None) != INFO.name:
        raise quantplug.OptionError(
            f"set_block_size_map needs a qnn_htp quantizer, got {getattr(quantizer, 'backend', quantizer)!r}"
        )
    precision = quantizer.options.get("precision")
    if precision != "16a4w_block":
        raise quantplug.OptionError(
            f"set_block_size_map applies only to precision 16a4w_block (this quantizer has precision "
            f"{precision!r}): build it with get_quantizer('qnn_htp', precision='16a4w_block')"
        )
    state = quantizer.context.state
    merged = dict(state.get(configs.BLOCK_MAP_STATE) or {})
    merged.update(configs.parse_block_size_map(mapping))
    state[configs.BLOCK_MAP_STATE] = merged
    return quantizer
