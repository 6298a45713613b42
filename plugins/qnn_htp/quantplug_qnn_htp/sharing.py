"""Observer-sharing adjustments for HTP (the ``quantplug_resolve_sharing`` hook).

1. Discarded nodes keep their edges float. A node discarded by an override (``quantizer.discard``,
   ``set_node_name(name, None)``, a module override of None...) gets no annotation, but its
   neighbours' specs would still put Q/DQ on the edges into and out of it (ExecuTorch defect P10).
   Before resolution, every key on such an edge is dropped: the discarded node's input edges, the
   input edges of its consumers that read it, the output of a producer whose every consumer is
   discarded, and then whatever depends on a dropped key (derived biases, shared specs), so the
   float region is closed. A producer that also feeds quantized consumers keeps its output
   encoding (those consumers need it); the discarded node then reads its dequantized value.
2. Consumers read a fixed encoding as it is. A sigmoid / hard-sigmoid / 16-bit tanh output has a
   fixed encoding; a consumer edge whose plain spec has the same grid (dtype and range, per
   tensor) joins that group instead of requantizing. ExecuTorch gets this from torchao's implicit
   sharing (its fixed outputs are plain specs with a FixedQParamsObserver); the core's signature
   keeps fixed and plain specs apart, so this hook merges them.
3. Priority observers govern their groups. The core builds a group's observer from its first
   concrete spec in graph order. For a ``cat`` the producers of its inputs come first, so their
   moving-average observer would measure the concat group; likewise for the output of a masked op
   and the consumers sharing it. Specs whose observer class declares a ``group_priority`` (see
   ``observers``) win instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from quantplug.backend import Q_ANNOTATION_KEY, Key, SharingGroups, SpecKind, is_discarded, spec_kind
from quantplug_qnn_htp.observers import group_priority


def discarded_nodes(graph: Any) -> set[str]:
    return {n.name for n in graph.nodes if n.op == "call_function" and is_discarded(n)}


def drop_discarded_edges(problem: Any) -> Any:
    """``problem`` without the keys on edges of discarded nodes (and what depends on them)."""
    graph = getattr(problem, "graph", None)
    if graph is None:
        return problem
    gone = discarded_nodes(graph)
    if not gone:
        return problem
    users = {n.name: [u.name for u in n.users] for n in graph.nodes}
    drop: set[Key] = set()
    for key in problem.specs:
        if isinstance(key, tuple):
            if key[0] in gone or key[1] in gone:
                drop.add(key)
        elif users.get(key) and all(u in gone for u in users[key]):
            drop.add(key)
    changed = True
    while changed:  # close over shared and derived specs pointing at dropped keys
        changed = False
        for key, spec in problem.specs.items():
            if key in drop:
                continue
            if (spec.shared_with is not None and spec.shared_with in drop) or any(
                s in drop for s in spec.derived_from
            ):
                drop.add(key)
                changed = True
    specs = {k: v for k, v in problem.specs.items() if k not in drop}
    merges = tuple((a, b) for a, b in problem.extra_merges if a not in drop and b not in drop)
    return dataclasses.replace(problem, specs=specs, extra_merges=merges)


def _specs_by_key(graph: Any) -> dict[Key, Any]:
    found: dict[Key, Any] = {}
    for node in graph.nodes:
        ann = node.meta.get(Q_ANNOTATION_KEY)
        if ann is None:
            continue
        for arg, spec in (getattr(ann, "input_qspec_map", None) or {}).items():
            if spec is not None:
                found[(arg.name, node.name)] = spec
        out = getattr(ann, "output_qspec", None)
        if out is not None:
            found[node.name] = out
    return found


def _grid(spec: Any) -> tuple[Any, ...] | None:
    from quantplug.backend import is_per_channel, spec_range

    if getattr(spec, "is_dynamic", False) or is_per_channel(spec) or getattr(spec, "block_size", None):
        return None
    return (spec.dtype, spec_range(spec))


def share_fixed_outputs(problem: Any, groups: SharingGroups) -> SharingGroups:
    """Merge consumer-edge groups into the group of a fixed-encoding producer with the same grid."""
    graph = getattr(problem, "graph", None)
    if graph is None:
        return groups
    specs = _specs_by_key(graph)
    blocked = set(getattr(problem, "no_implicit_consumers", ()))
    parent = list(range(len(groups.members)))

    def find(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    merged = False
    for key, gid in groups.group_of.items():
        if not isinstance(key, tuple) or key[1] in blocked:
            continue
        producer = key[0]
        out_gid = groups.group_of.get(producer)
        if out_gid is None:
            continue
        out_spec = specs.get(groups.representative[out_gid])
        edge_spec = specs.get(groups.representative[gid])
        if out_spec is None or edge_spec is None or spec_kind(out_spec) is not SpecKind.FIXED:
            continue
        if spec_kind(edge_spec) is not SpecKind.PLAIN or _grid(out_spec) != _grid(edge_spec):
            continue
        a, b = find(out_gid), find(gid)
        if a != b:
            parent[b] = a
            merged = True
    if not merged:
        return groups
    result = SharingGroups()
    new_id: dict[int, int] = {}
    for gid, members in enumerate(groups.members):
        root = find(gid)
        if root not in new_id:
            new_id[root] = len(result.members)
            result.members.append([])
            result.representative.append(groups.representative[root])
        result.members[new_id[root]].extend(members)
    for key, gid in groups.group_of.items():
        result.group_of[key] = new_id[find(gid)]
    return result


def prefer_priority_observers(problem: Any, groups: SharingGroups) -> SharingGroups:
    """Make each group's representative its highest-priority concrete spec (ties: graph order)."""
    graph = getattr(problem, "graph", None)
    if graph is None:
        return groups
    specs = _specs_by_key(graph)
    for gid, members in enumerate(groups.members):
        best_key = groups.representative[gid]
        best = group_priority(specs.get(best_key))
        for key in members:
            spec = specs.get(key)
            if spec is None or spec_kind(spec) is not SpecKind.PLAIN:
                continue
            p = group_priority(spec)
            if p > best:
                best_key, best = key, p
        groups.representative[gid] = best_key
    return groups
