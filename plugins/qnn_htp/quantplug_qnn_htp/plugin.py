"""Hook implementations of the ``qnn_htp`` backend (entry point ``quantplug.backends``)."""

from __future__ import annotations

from collections.abc import Sequence

import quantplug
from quantplug import BackendContext, BackendInfo, BackendOption, OpConstraint, Preset, RulesModule
from quantplug_qnn_htp import configs, constraints, soc
from quantplug_qnn_htp.rules import RULE_MODULES

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
        BackendOption("per_channel_linear", bool, False, "per-channel symmetric linear weights"),
        BackendOption(
            "act_observer", str, "moving_average", "activation range observer", choices=configs.ACT_OBSERVERS
        ),
        BackendOption("act_symmetric", bool, False, "symmetric activations (zero point at the grid middle)"),
        BackendOption(
            "eps", float, None, "smallest scale (default 1e-4/255 for 8-bit, 1e-4/65535 for 16-bit)"
        ),
        BackendOption("block_size", int, configs.DEFAULT_BLOCK_SIZE, "LPBQ block size along input channels"),
    ),
    presets=tuple(Preset(name, text) for name, text in configs.PRECISIONS.items()),
    preset_option="precision",
)


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
    return RULE_MODULES


@quantplug.hookimpl
def quantplug_quantization_config(
    preset: str | None, context: BackendContext
) -> quantplug.QuantizationConfig:
    soc_info(context)  # an unknown SoC fails here, before anything runs
    return configs.build_config(preset, context.options)


@quantplug.hookimpl
def quantplug_target_arch(context: BackendContext) -> int:
    return soc_info(context).htp_arch


@quantplug.hookimpl
def quantplug_op_constraints(
    op: str, backend_op: str | None, context: BackendContext
) -> Sequence[OpConstraint]:
    precision = context.option("precision") or configs.DEFAULT_PRECISION
    sixteen = precision.startswith("16a")
    return constraints.constraints_for(backend_op, sixteen_bit_act=sixteen)
