"""A small backend for testing the conformance kit, with defects switched on by name.

``write_backend(root, name, defects)`` writes ``<name>.py`` (the hook module) and
``<name>_rules.py`` (its rules module) into ``root``; ``defects`` names the checks it must fail.
Without defects it conforms. The same module works registered in-process
(``quantplug.registered_backend``) and installed through a throwaway ``.dist-info``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

BACKEND = """
import importlib
import json
import uuid

import torch

import quantplug
from quantplug import (
    Artifact,
    BackendInfo,
    BackendOption,
    OpConstraint,
    PortConstraint,
    Preset,
    QuantizationConfig,
    QuantizationSpec,
    RulesModule,
    derived_bias_spec,
)
from _quantplug.conformance.profile import ConformanceProfile
from _quantplug.flow.inspect import encodings
from _quantplug.sharing.resolution import SharingGroups
from _quantplug.validation.constraints import OUTPUT, ScaleProduct

NAME = {name!r}
DEFECTS = {defects!r}
RULES = NAME + "_rules"
OPS = ["aten.linear.default", "aten.conv2d.default", "aten.relu.default", "aten.add.Tensor"]
ACT = PortConstraint(dtypes=frozenset({{torch.uint8}}), per_tensor_only=True)
WEIGHT = PortConstraint(dtypes=frozenset({{torch.int8}}), symmetric=True)
BIAS = (ScaleProduct(2, (0, 1)),)
TABLE = {{
    "FullyConnected": OpConstraint("FullyConnected", {{0: ACT, 1: WEIGHT, OUTPUT: ACT}}, relations=BIAS),
    "Conv2d": OpConstraint("Conv2d", {{0: ACT, 1: WEIGHT, OUTPUT: ACT}}, relations=BIAS),
    "Relu": OpConstraint("Relu", {{0: ACT, OUTPUT: ACT}}),
    "Add": OpConstraint("Add", {{0: ACT, 1: ACT, OUTPUT: ACT}}),
}}


@quantplug.hookimpl
def quantplug_backend_info():
    default = "yes" if "options" in DEFECTS else True  # "options": a default of the wrong type
    return BackendInfo(
        name=NAME,
        description="conformance kit test backend",
        options=(
            BackendOption("precision", str, "8a8w", "preset", choices=("8a8w",)),
            BackendOption("per_channel", bool, default, "per-channel weights"),
        ),
        presets=(Preset("8a8w"),),
        preset_option="precision",
    )


@quantplug.hookimpl
def quantplug_annotation_rules(context):
    if "listed" in DEFECTS:
        importlib.import_module(RULES)  # eager: every get_quantizer imports the rules
    return [RulesModule(RULES, OPS)]


@quantplug.hookimpl
def quantplug_quantization_config(preset, context):
    act = QuantizationSpec(dtype=torch.uint8, qscheme=torch.per_tensor_affine)
    if "integer-weights" in DEFECTS:
        return QuantizationConfig(act, act, None, None)  # weights stay float
    weight = QuantizationSpec(
        dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0
    )
    return QuantizationConfig(act, act, weight, lambda n: derived_bias_spec(n, weight_spec=weight))


@quantplug.hookimpl
def quantplug_op_constraints(op, backend_op, context):
    if "validation" in DEFECTS:
        backend_op = "Dense" if backend_op == "FullyConnected" else backend_op + "_v2"  # keys never match
    found = TABLE.get(backend_op or "")
    return [found] if found else []


@quantplug.hookimpl
def quantplug_resolve_sharing(problem, resolve, context):
    if "sharing" not in DEFECTS:
        return None
    groups = resolve(problem)
    weight = next((k for k in groups.group_of if isinstance(k, tuple) and "weight" in k[0]), None)
    act = next((k for k in groups.group_of if not isinstance(k, tuple)), None)
    if weight is None or act is None:
        return groups
    gone, into = groups.group_of[weight], groups.group_of[act]
    members = [list(m) for m in groups.members]
    members[into].extend(members[gone])  # a weight (int8) merged into an activation group (uint8)
    kept = [m for i, m in enumerate(members) if i != gone]
    reps = [r for i, r in enumerate(groups.representative) if i != gone]
    return SharingGroups({{k: i for i, m in enumerate(kept) for k in m}}, kept, reps)


@quantplug.hookimpl
def quantplug_passes_before_annotation(context):
    def scale_weights_in_place(gm, ctx):
        for p in gm.parameters():
            p.data.mul_(1.0001)  # the caller's tensors
        return gm

    def remember(gm, ctx):
        ctx.state["last_graph"] = gm  # keeps every prepared model alive
        return gm

    passes = []
    if "untouched" in DEFECTS:
        passes.append(quantplug.NamedPass("scale", scale_weights_in_place))
    if "no-leak" in DEFECTS:
        passes.append(quantplug.NamedPass("remember", remember))
    return passes


@quantplug.hookimpl
def quantplug_artifact_writer(context):
    def write(program, ctx):
        doc = {{"encodings": encodings(program)}}
        if "deterministic" in DEFECTS:
            doc["build"] = str(uuid.uuid4())
        return Artifact(backend=ctx.backend, files={{"kit.json": json.dumps(doc, default=str)}})

    return write


@quantplug.hookimpl
def quantplug_conformance_profile(context):
    files = ("kit.json", "model.bin") if "lowering" in DEFECTS else ("kit.json",)
    return ConformanceProfile(artifact_files=files)
"""

RULES = """
import torch
from quantplug import annotate_binary, annotate_single_in_single_out, annotate_weighted, register_annotator

DEFECTS = {defects!r}
aten = torch.ops.aten


@register_annotator([aten.linear.default], backend_op="FullyConnected")
def linear(node, config):
    annotate_weighted(node, config)


@register_annotator([aten.conv2d.default], backend_op="Conv2d")
def conv(node, config):
    annotate_weighted(node, config)


@register_annotator([aten.relu.default], backend_op="Relu")
def relu(node, config):
    if "ops" not in DEFECTS:  # "ops": claims relu, leaves it float
        annotate_single_in_single_out(node, config)


@register_annotator([aten.add.Tensor], backend_op="Add")
def add(node, config):
    annotate_binary(node, config)
"""


def write_backend(root: Path, name: str, defects: Iterable[str] = ()) -> str:
    """Write the backend ``name`` (hooks + rules modules) into ``root``; returns the module name."""
    found = tuple(sorted(defects))
    (root / f"{name}.py").write_text(BACKEND.format(name=name, defects=found))
    (root / f"{name}_rules.py").write_text(RULES.format(defects=found))
    return name


def write_dist(root: Path, name: str) -> None:
    """A ``.dist-info`` declaring ``name`` as an installed backend (entry point = the module)."""
    info = root / f"quantplug_{name}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: quantplug-{name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[quantplug.backends]\n{name} = {name}\n")
