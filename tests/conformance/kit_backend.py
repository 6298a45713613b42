"""A small backend for testing the conformance kit, with defects switched on by name.

``write_backend(root, name, defects)`` writes ``<name>.py`` (the hook module) and
``<name>_rules.py`` (its rules module) into ``root``; ``defects`` names the checks it must fail.
Without defects it conforms. The same module works registered in-process
(``quantplug.registered_backend``) and installed through a throwaway ``.dist-info``.

A defect ``"ACTION@WHERE"`` makes the code at ``WHERE`` (a hook's name, ``"write"`` for the
artifact writer, ``"import"`` for the module itself) misbehave: ``exit`` (``sys.exit(0)``),
``interrupt`` (raise KeyboardInterrupt), ``hang`` (sleep for an hour), ``os-exit``
(``os._exit(0)``), ``reseed`` (``torch.manual_seed``), ``dtype`` (float64 default dtype),
``threads`` (one more torch thread), ``environ`` (set an environment variable), ``sigint``
(send this process SIGINT, as the user's Ctrl-C), ``hang-blocked`` (sleep with SIGALRM blocked,
as a hook stuck in native code).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

BACKEND = """
import importlib
import json
import os
import signal
import sys
import time
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


def _fault(where):
    for defect in DEFECTS:
        action, _, at = defect.partition("@")
        if at != where:
            continue
        if action == "exit":
            sys.exit(0)
        if action == "interrupt":
            raise KeyboardInterrupt
        if action == "hang":
            time.sleep(3600)
        if action == "os-exit":
            os._exit(0)
        if action == "reseed":
            torch.manual_seed(1234)
        if action == "dtype":
            torch.set_default_dtype(torch.float64)
        if action == "threads":
            torch.set_num_threads(torch.get_num_threads() + 1)
        if action == "environ":
            os.environ["KIT_BACKEND_WAS_HERE"] = "1"
        if action == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        if action == "hang-blocked":
            signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM}})
            time.sleep(3600)


_fault("import")
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
    _fault("quantplug_backend_info")
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
    _fault("quantplug_annotation_rules")
    if "listed" in DEFECTS:
        importlib.import_module(RULES)  # eager: every get_quantizer imports the rules
    return [RulesModule(RULES, OPS)]


@quantplug.hookimpl
def quantplug_quantization_config(preset, context):
    _fault("quantplug_quantization_config")
    act = QuantizationSpec(dtype=torch.uint8, qscheme=torch.per_tensor_affine)
    if "integer-weights" in DEFECTS:
        return QuantizationConfig(act, act, None, None)  # weights stay float
    weight = QuantizationSpec(
        dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0
    )
    return QuantizationConfig(act, act, weight, lambda n: derived_bias_spec(n, weight_spec=weight))


@quantplug.hookimpl
def quantplug_op_constraints(op, backend_op, context):
    _fault("quantplug_op_constraints")
    if "validation" in DEFECTS:
        backend_op = "Dense" if backend_op == "FullyConnected" else backend_op + "_v2"  # keys never match
    found = TABLE.get(backend_op or "")
    return [found] if found else []


@quantplug.hookimpl
def quantplug_resolve_sharing(problem, resolve, context):
    _fault("quantplug_resolve_sharing")
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
    _fault("quantplug_passes_before_annotation")
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
    _fault("quantplug_artifact_writer")
    def write(program, ctx):
        _fault("write")
        doc = {{"encodings": encodings(program)}}
        if "deterministic" in DEFECTS:
            doc["build"] = str(uuid.uuid4())
        return Artifact(backend=ctx.backend, files={{"kit.json": json.dumps(doc, default=str)}})

    return write


@quantplug.hookimpl
def quantplug_conformance_profile(context):
    _fault("quantplug_conformance_profile")
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


def install(root: Path, name: str, defects: Iterable[str] = ()) -> str:
    """The backend ``name`` written into ``root`` with its ``.dist-info``: installed for any
    process with ``root`` on its path."""
    write_backend(root, name, defects)
    write_dist(root, name)
    return name
