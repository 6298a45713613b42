"""The sharing problem as a backend hook sees it: keys and spec facts, plus the graph for context."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from _quantplug.sharing.resolution import Key, KeySpec, SharingGroups, resolve_sharing


@dataclass(frozen=True)
class SharingProblem:
    """Inputs of :func:`resolve_sharing` together with the graph the keys name (read-only)."""

    specs: Mapping[Key, KeySpec]
    no_implicit_consumers: frozenset[str] = frozenset()
    extra_merges: tuple[tuple[Key, Key], ...] = ()
    graph: torch.fx.Graph | None = field(default=None, compare=False)

    def with_merges(self, merges: Sequence[tuple[Key, Key]]) -> SharingProblem:
        """A copy that also asks for ``merges`` (pairs of keys to put in one group)."""
        return replace(self, extra_merges=self.extra_merges + tuple(merges))


def solve(problem: SharingProblem) -> SharingGroups:
    """The core resolution applied to a problem."""
    return resolve_sharing(
        problem.specs,
        no_implicit_consumers=problem.no_implicit_consumers,
        extra_merges=problem.extra_merges,
    )
