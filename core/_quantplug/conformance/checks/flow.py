"""What the whole flow owes the caller: an untouched program and process, integer weights, the
declared files, the same result twice, nothing kept alive.
"""

from __future__ import annotations

import gc
import json
import re
import tempfile
import weakref
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import Node

import quantplug
from _quantplug.conformance import process_state
from _quantplug.conformance.checks.ops import float_outputs
from _quantplug.conformance.checks.session import (
    CALIBRATION_BATCHES,
    Failed,
    Session,
    Skipped,
    has_writer,
    options_label,
    run_e2e,
)
from _quantplug.conformance.samples import module_sample
from _quantplug.flow.inspect import DEQUANTIZE_OPS, encodings
from _quantplug.graph.op_names import op_name
from _quantplug.quantizer.quantizer import Quantizer


def _snapshot(model: nn.Module, program: torch.export.ExportedProgram) -> dict[str, Any]:
    return {
        "code": program.graph_module.code,
        "nodes": [(n.name, str(n.target), sorted(n.meta)) for n in program.graph.nodes],
        "state": {k: (id(v), v.detach().clone()) for k, v in program.state_dict.items()},
        "constants": {
            k: (id(v), v.detach().clone())
            for k, v in program.constants.items()
            if isinstance(v, torch.Tensor)
        },
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def _changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    found = []
    if before["code"] != after["code"]:
        found.append("its graph code changed")
    if before["nodes"] != after["nodes"]:
        changed = [a[0] for a, b in zip(after["nodes"], before["nodes"]) if a != b] or ["node list"]
        found.append("node names, targets or metadata changed: " + ", ".join(changed[:5]))
    for group in ("state", "constants"):
        for k, (ident, value) in before[group].items():
            now = after[group].get(k)
            if now is None:
                found.append(f"{group} entry {k!r} disappeared")
            elif now[0] != ident:
                found.append(f"{group} entry {k!r} was replaced")
            elif not torch.equal(now[1], value):
                found.append(f"{group} entry {k!r} was modified in place")
    for k, value in before["model"].items():
        if not torch.equal(after["model"][k], value):
            found.append(f"the model's {k!r} was modified in place")
    return found


def check_untouched(session: Session, case: str) -> str:
    model, example = session.e2e_factory()()
    program = torch.export.export(model, tuple(example))
    before = _snapshot(model, program)
    state = process_state.snapshot()
    try:
        q = session.quantizer(session.option_sets()[0])
        prepared = quantplug.prepare(program, q)
        sample = module_sample("model", lambda: (model, example))
        with torch.no_grad():
            for seed in range(CALIBRATION_BATCHES):
                prepared(*sample.batch(seed))
        converted = quantplug.convert(prepared)
        if has_writer(q):
            artifact = quantplug.lower(converted, q)
            with tempfile.TemporaryDirectory() as tmp:
                artifact.save(tmp)
        changed_state = process_state.changes(state, process_state.snapshot())
    finally:
        process_state.restore(state)  # later checks run in the state they expect
    problems = []
    changes = _changes(before, _snapshot(model, program))
    if changes:
        problems.append("the caller's program changed: " + "; ".join(changes))
    if changed_state:
        problems.append(
            "process-wide state changed by get_quantizer, prepare, calibration, convert or lower: "
            + "; ".join(changed_state)
        )
    entry = session.entry
    if entry is not None and entry.source == "entry-point":
        on_import = session.as_installed()["state_changed"]
        if on_import:
            problems.append(
                "importing the plugin (get_quantizer in a fresh interpreter) changed process-wide state: "
                + "; ".join(on_import)
            )
    if problems:
        raise Failed(" / ".join(problems))
    return (
        "the exported program, the model and the process-wide state (random generators, torch's "
        "defaults, threads and flags, environment, working folder) are unchanged by importing the "
        "plugin, prepare, calibration, convert and lower"
    )


WEIGHTED = {
    "aten.linear.default": 1,
    "aten.conv1d.default": 1,
    "aten.conv2d.default": 1,
    "aten.conv3d.default": 1,
}


def check_integer_weights(session: Session, case: str) -> str:
    run = run_e2e(session, lower=False)
    coverage = {n.node: n for n in run.quantizer.coverage(run.program).nodes}
    checked: list[str] = []
    problems: list[str] = []
    for node in run.converted.graph.nodes:
        index = WEIGHTED.get(op_name(node.target)) if node.op == "call_function" else None
        if index is None or node.name not in coverage or not coverage[node.name].quantized:
            continue
        weight = node.args[index] if len(node.args) > index else None
        if not (isinstance(weight, Node) and weight.target in DEQUANTIZE_OPS):
            problems.append(f"{node.name}: its weight is not dequantized from a stored integer tensor")
            continue
        stored = weight.args[0]
        value = (
            getattr(run.converted, str(stored.target), None)
            if isinstance(stored, Node) and stored.op == "get_attr"
            else None
        )
        if not isinstance(value, torch.Tensor) or value.is_floating_point():
            problems.append(
                f"{node.name}: its weight is stored as {getattr(value, 'dtype', type(value).__name__)}"
            )
            continue
        checked.append(f"{node.name} ({str(value.dtype).removeprefix('torch.')})")
    if problems:
        raise Failed("; ".join(problems))
    if not checked:
        raise Skipped("the end-to-end model has no weighted op this backend quantizes")
    return "weights stored as integers: " + ", ".join(checked)


def check_lowering(session: Session, case: str) -> str:
    problems: list[str] = []
    notes: list[str] = []
    for options in session.option_sets():
        q = session.quantizer(options)
        if not has_writer(q):
            raise Failed(
                "no artifact writer (hook quantplug_artifact_writer); declare 'lowering' unsupported"
            )
        run = run_e2e(session, q)
        artifact = run.artifact
        declared = session.profile.artifact_files or tuple(artifact.files)
        with tempfile.TemporaryDirectory() as tmp:
            written = artifact.save(tmp)
            names = sorted(str(p.relative_to(tmp)) for p in written)
            root = Path(tmp)
            meta = (
                json.loads((root / "artifact.json").read_text())
                if (root / "artifact.json").is_file()
                else None
            )
            if meta is None or meta.get("backend") != session.name:
                problems.append(
                    f"{options_label(options)}: artifact.json missing or not naming backend {session.name!r}"
                )
            for pattern in declared:
                matches = [n for n in names if fnmatch(n, pattern)]
                if not matches:
                    problems.append(
                        f"{options_label(options)}: declared file {pattern!r} not written (wrote {names})"
                    )
                elif all((root / n).stat().st_size == 0 for n in matches):
                    problems.append(f"{options_label(options)}: declared file {pattern!r} is empty")
            missing = [n for n in artifact.files if not (root / n).is_file()]
            if missing:
                problems.append(
                    f"{options_label(options)}: files the artifact lists were not saved: {missing}"
                )
            leftovers = [p.name for p in root.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".")]
            if leftovers:
                problems.append(f"{options_label(options)}: temporary files left behind: {leftovers}")
        notes.append(f"{options_label(options)}: {', '.join(names)}")
    if problems:
        raise Failed("; ".join(problems))
    return "saved " + "; ".join(notes)


def _artifact_bytes(artifact: Any) -> dict[str, Any]:
    """Saved file name -> content; a zip archive (torch's ``.pt2``) as its members, without the
    random ``serialization_id`` torch writes into every archive."""
    if artifact is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        artifact.save(tmp)
        files = sorted(p for p in Path(tmp).rglob("*") if p.is_file())
        return {str(p.relative_to(tmp)): _content(p.read_bytes()) for p in files}


#: in torch archives, what differs between two saves of the same program: a random
#: serialization id, and the memory address of graphs recorded in each node's provenance
_ARCHIVE_NOISE = re.compile(rb'(\\?"graph_id\\?": )\d+')


def _content(data: bytes) -> Any:
    if not data.startswith(b"PK\x03\x04"):
        return data
    import io
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return {
                name: _ARCHIVE_NOISE.sub(rb"\1_", archive.read(name))
                for name in archive.namelist()
                if not name.endswith(".data/serialization_id")
            }
    except zipfile.BadZipFile:
        return data


def check_deterministic(session: Session, case: str) -> str:
    runs = []
    for _ in range(2):
        run = run_e2e(session, session.quantizer(session.option_sets()[0]))
        with torch.no_grad():
            out = float_outputs(run.converted(*run.batch))
        runs.append(
            (
                json.dumps(encodings(run.converted), sort_keys=True, default=str),
                out,
                _artifact_bytes(run.artifact),
            )
        )
    (enc_a, out_a, files_a), (enc_b, out_b, files_b) = runs
    problems = []
    if enc_a != enc_b:
        problems.append("the encodings differ")
    if len(out_a) != len(out_b) or any(not torch.equal(a, b) for a, b in zip(out_a, out_b)):
        problems.append("the quantized outputs differ")
    if sorted(files_a) != sorted(files_b):
        problems.append(f"the saved file names differ ({sorted(files_a)} vs {sorted(files_b)})")
    else:
        problems.extend(f"saved file {name!r} differs" for name in files_a if files_a[name] != files_b[name])
    if problems:
        raise Failed("two runs of the same flow disagree: " + "; ".join(problems))
    return f"two runs agree bit for bit: encodings, outputs and {len(files_a)} saved file(s)"


def _flow_refs(session: Session, q: Quantizer) -> dict[str, weakref.ref[Any]]:
    run = run_e2e(session, q)
    refs: dict[str, weakref.ref[Any]] = {
        "the model": weakref.ref(run.model),
        "the exported program": weakref.ref(run.program),
        "the prepared model": weakref.ref(run.prepared),
        "the converted model": weakref.ref(run.converted),
    }
    if run.artifact is not None:
        with tempfile.TemporaryDirectory() as tmp:
            run.artifact.save(tmp)
    return refs


def check_no_leak(session: Session, case: str) -> str:
    q = session.quantizer(session.option_sets()[0])  # the user keeps their quantizer
    refs = _flow_refs(session, q)
    gc.collect()
    alive = {name: r() for name, r in refs.items() if r() is not None}
    if alive:
        held = []
        for name, obj in alive.items():
            owners = sorted(
                {
                    type(o).__name__
                    for o in gc.get_referrers(obj)
                    if o is not refs and not isinstance(o, weakref.ref)
                }
            )
            held.append(f"{name} (referenced by {', '.join(owners[:4]) or 'nothing visible'})")
        del alive
        raise Failed(
            "still alive after the flow and gc.collect(), while the quantizer is kept: " + "; ".join(held)
        )
    return (
        "model, exported program, prepared and converted models are freed; the quantizer keeps none of them"
    )
