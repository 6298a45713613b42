"""What must be equal on every rank before their observers can be merged.

Ranks that prepared different programs (another model revision, another backend option, a
different torch version tracing differently) have observers that do not correspond; merging
them would silently mix unrelated statistics, and a collective over state of different sizes
would hang or crash. The fingerprint lists the prepared graph's nodes with their output shapes
and dtypes, and each observer's kind and grid (not its statistics or their shapes: a
per-channel observer that saw no data yet has an empty state); ranks exchange a digest of it
first, and the full list only when digests differ, to name the first difference.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule


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
    """The lines that must agree across ranks: graph nodes, then observers."""
    lines = [f"node {n.op} {n.target} -> {n.name}{_meta(n.meta.get('val'))}" for n in prepared.graph.nodes]
    where = {name: str(getattr(obs, "where", "") or "") for name, obs in observers}
    lines += [f"observer {name} [{where[name]}] {observer_signature(obs)}" for name, obs in observers]
    return lines


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


def describe_mismatch(all_lines: list[list[str]]) -> str:
    """For every rank whose fingerprint differs from rank 0's: the first difference."""
    reference = all_lines[0]
    parts = [
        f"rank {r} differs from rank 0 at {first_difference(reference, lines)}"
        for r, lines in enumerate(all_lines)
        if r and lines != reference
    ]
    return "; ".join(parts)
