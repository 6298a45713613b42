"""What must be equal on every rank before their observers can be merged.

Ranks that prepared different programs (another model revision, another backend option, a
different torch version tracing differently) have observers that do not correspond; merging
them would silently mix unrelated statistics, and a collective over state of different sizes
would hang or crash. The fingerprint lists the prepared graph's nodes with their output shapes
and dtypes, and each observer's kind and grid (not its statistics or their shapes: a
per-channel observer that saw no data yet has an empty state); with accuracy algorithms, each
collector's class and a digest of every constant (weights a transform wrote from data). Ranks
exchange a digest of it first, and the full list only when digests differ, to name the first
difference.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from _quantplug.algorithms.merge import class_name, fed_collectors
from _quantplug.graph.attrs import fetch_attr
from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY
from _quantplug.meta import TAPS, observer_gid


def observer_signature(obs: nn.Module) -> str:
    """Class and grid of an observer and of every module inside it."""
    parts = []
    for path, module in obs.named_modules():
        grid = [
            f"{attr}={getattr(module, attr)}"
            for attr in ("dtype", "qscheme", "quant_min", "quant_max", "ch_axis", "block_size", "bins")
            if attr in vars(module) and not callable(vars(module)[attr])
        ]
        name = f"{type(module).__module__}.{type(module).__qualname__}"
        parts.append(f"{path or '.'}:{name}({', '.join(grid)})")
    return " ".join(parts)


def fingerprint(prepared: GraphModule, observers: list[tuple[str, nn.Module]]) -> list[str]:
    """The lines that must agree across ranks: graph nodes, observers, then (with accuracy
    algorithms) their collectors and a digest of every constant of the program."""
    lines = _guard_lines(prepared)
    lines += [f"node {n.op} {n.target} -> {n.name}{_meta(n.meta.get('val'))}" for n in prepared.graph.nodes]
    where = {name: str(getattr(obs, "where", "") or "") for name, obs in observers}
    lines += [f"observer {name} [{where[name]}] {observer_signature(obs)}" for name, obs in observers]
    return lines + _algorithm_lines(prepared)


def _guard_lines(prepared: GraphModule) -> list[str]:
    """What the algorithm guard judges on: first, so that ranks prepared with ``held_out`` on
    some and not on others are told so, not that their graphs differ (the calibration store
    the guard needs without ``held_out`` is a node of the graph)."""
    run = getattr(prepared, "meta", {}).get(RUN_KEY)
    if run is None:
        return []
    if not run.guard:
        return ["algorithm guard off"]
    if run.split is not None:
        judged = "every 4th calibration batch (the default split)"
    elif run.held_out is not None:
        judged = "held-out batches (held_out=...)"
    else:
        judged = "calibration batches"
    return [f"algorithm guard judging on {judged}"]


def _algorithm_lines(prepared: GraphModule) -> list[str]:
    """With algorithms: each fed collector's class, and each constant's bytes (hashed).

    Algorithms that transform the float program with data (SmoothQuant, CLE's bias absorption)
    write weights that depend on ``Algorithms([...], calibration=...)``: ranks given other batches would
    prepare programs of the same shapes but other weights, and merging their statistics would mix
    models. The constants' digests make that a named difference. Hashing costs one pass over the
    weights (about 1 GB/s), paid only by programs prepared with algorithms.
    """
    run = getattr(prepared, "meta", {}).get(RUN_KEY)
    if run is None:
        return []
    lines = [f"collector {f.site} {f.algorithm} {class_name(f.collector)}" for f in fed_collectors(prepared)]
    for node in prepared.graph.nodes:
        target = str(node.target)
        head = target.split(".")[0]
        if node.op != "get_attr" or head == TAPS or observer_gid(head) is not None:
            continue
        value = fetch_attr(prepared, target)
        if isinstance(value, torch.Tensor):
            lines.append(f"constant {target}{_meta(value)} {tensor_digest(value)}")
    return lines


def tensor_digest(value: torch.Tensor) -> str:
    """A digest of a tensor's bytes (its dtype and shape are the caller's to add)."""
    data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.data, digest_size=12).hexdigest()


def _meta(value: Any) -> str:
    """A node's output shape and dtype (two programs can share every op and differ in widths)."""
    if isinstance(value, torch.Tensor):
        return f" {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "".join(_meta(v) for v in value)
    return ""


def digest(lines: list[str]) -> bytes:
    return hashlib.sha256("\n".join(lines).encode()).digest()


def first_difference(mine: list[str], theirs: list[str]) -> str:
    """A sentence naming the first line that differs between two fingerprints."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return f"entry {i}: {a!r} against {b!r}"
    if len(mine) != len(theirs):
        longer, extra = (
            ("first", mine[len(theirs)]) if len(mine) > len(theirs) else ("second", theirs[len(mine)])
        )
        return f"{len(mine)} entries against {len(theirs)}; the {longer} goes on with {extra!r}"
    return "the same entries (a hash collision?)"


def mismatch_advice(all_lines: list[list[str]]) -> str:
    """What to do about the first difference: constants differ when the weights do."""
    reference = all_lines[0]
    for lines in all_lines[1:]:
        first = next((a for a, b in zip(reference, lines) if a != b), None)
        if first is not None and first.startswith("algorithm guard"):
            return (
                "the algorithm guard must judge alike on every rank: pass Algorithms([...], held_out=...) on "
                "every rank (each rank's held-out batches are merged at the sync) or on none, and "
                "the same guard everywhere"
            )
        if first is not None and first.startswith("constant "):
            return (
                "the ranks' weights differ: algorithms that transform the float program with data "
                "(SmoothQuant, CLE) must be given the same batches on every rank, "
                "Algorithms([...], calibration=the same batches), not each rank's share; and every rank "
                "must load the same weights"
            )
    return (
        "prepare the same program with the same backend, options, algorithms and quantplug/torch "
        "versions on every rank"
    )


def describe_mismatch(all_lines: list[list[str]]) -> str:
    """For every rank whose fingerprint differs from rank 0's: the first difference."""
    reference = all_lines[0]
    parts = [
        f"rank {r} differs from rank 0 at {first_difference(reference, lines)}"
        for r, lines in enumerate(all_lines)
        if r and lines != reference
    ]
    return "; ".join(parts)
