"""Observer groups a prepared model can rely on: one grid per group, shares and derivations inside."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule

import quantplug
from _quantplug.annotation.spec_view import SpecKind, spec_kind, spec_range
from _quantplug.annotation.specs import Q_ANNOTATION_KEY
from _quantplug.conformance.checks.session import (
    Failed,
    Session,
    run_e2e,
)
from _quantplug.errors import QuantplugError
from _quantplug.flow.prepare import PreparedState
from _quantplug.meta import STATE_KEY, observer_gid


def sharing_problems(prepared: GraphModule) -> list[str]:
    """What is wrong with a prepared model's observer groups (empty: they are consistent)."""
    state: PreparedState = prepared.meta[STATE_KEY]
    nodes = {n.name: n for n in prepared.graph.nodes}
    specs: dict[Any, Any] = {}
    for node in prepared.graph.nodes:
        ann = node.meta.get(Q_ANNOTATION_KEY)
        if ann is None:
            continue
        for arg, spec in ann.input_qspec_map.items():
            if spec is not None:
                specs[(arg.name, node.name)] = spec
        if ann.output_qspec is not None:
            specs[node.name] = ann.output_qspec
    problems: list[str] = []
    members: dict[int, list[Any]] = {}
    for key, gid in state.group_of.items():
        if key not in specs:
            problems.append(f"{_key(key)} is in group {gid} but has no quantization spec")
        members.setdefault(gid, []).append(key)
    if sorted(members) != list(range(len(state.groups))):
        problems.append(f"group ids {sorted(members)} do not match the {len(state.groups)} groups")

    def concrete(spec: Any, seen: int = 0) -> Any:
        while spec is not None and spec_kind(spec) is SpecKind.SHARED and seen < 1000:
            t = spec.edge_or_node
            spec = specs.get((t[0].name, t[1].name) if isinstance(t, tuple) else t.name)
            seen += 1
        return spec

    for gid, keys in members.items():
        grids = {}
        fixed = set()
        derived = set()
        for key in keys:
            spec = concrete(specs.get(key))
            if spec is None:
                continue
            kind = spec_kind(spec)
            grids[key] = (
                str(spec.dtype),
                spec_range(spec),
                getattr(spec, "qscheme", None) in (torch.per_channel_affine, torch.per_channel_symmetric),
                getattr(spec, "ch_axis", None),
                getattr(spec, "block_size", None),
                bool(getattr(spec, "is_dynamic", False)),
            )
            if kind is SpecKind.FIXED:
                fixed.add((float(spec.scale), int(spec.zero_point)))
            if kind is SpecKind.DERIVED:
                derived.add(id(spec))
        if len(set(grids.values())) > 1:
            shown = sorted({f"{g[0]}[{g[1][0]},{g[1][1]}]" for g in grids.values()})
            problems.append(
                f"group {gid} mixes different grids: {', '.join(shown)} ({', '.join(map(_key, keys[:4]))})"
            )
        if len(fixed) > 1:
            problems.append(f"group {gid} holds different fixed encodings {sorted(fixed)}")
        if derived and len(derived) + len(fixed) > 1:
            problems.append(f"group {gid} mixes a derived spec with other encodings")
    for key, spec in specs.items():
        if key not in state.group_of:
            continue  # dropped by the backend's sharing: float
        if spec_kind(spec) is SpecKind.SHARED:
            t = spec.edge_or_node
            target = (t[0].name, t[1].name) if isinstance(t, tuple) else t.name
            if target in state.group_of and state.group_of[target] != state.group_of[key]:
                problems.append(f"{_key(key)} shares {_key(target)}'s encoding but is in another group")
        if spec_kind(spec) is SpecKind.DERIVED:
            for source in spec.derived_from:
                s = (source[0].name, source[1].name) if isinstance(source, tuple) else source.name
                if s not in state.group_of:
                    problems.append(f"{_key(key)} derives from {_key(s)}, which has no group")
    observed = {observer_gid(n.target) for n in nodes.values() if n.op == "call_module"}
    for group in state.groups:
        if group.gid not in observed:
            problems.append(f"group {group.gid} ({group.describe()}) has no observer in the graph")
    return problems


def _key(key: Any) -> str:
    return f"input {key[0]!r} of {key[1]!r}" if isinstance(key, tuple) else f"output of {key!r}"


def check_sharing(session: Session, case: str) -> str:
    q = session.quantizer(session.option_sets()[0])
    problems: list[str] = []
    checked = 0
    run = run_e2e(session, q, lower=False)
    for p in sharing_problems(run.prepared):
        problems.append(f"end-to-end model: {p}")
    checked += 1
    for op in session.claimed_ops():
        sample = session.sample(op)
        if sample is None or op in session.profile.skip_ops:
            continue
        try:
            prepared = quantplug.prepare(session.program(sample), q)
        except QuantplugError:
            continue  # reported by the op's own check
        checked += 1
        problems.extend(f"{op}: {p}" for p in sharing_problems(prepared))
    if problems:
        raise Failed(f"{len(problems)} inconsistent group(s): " + "; ".join(problems[:10]))
    return f"observer groups consistent on {checked} prepared graphs (one grid per group)"
