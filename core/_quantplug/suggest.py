"""'Did you mean' suggestions for misspelt names (backends, options, presets, commands)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


def close_matches(word: Any, candidates: Iterable[Any]) -> list[str]:
    """The candidates closest to ``word`` (at most two), a case-insensitive match first."""
    names = [str(c) for c in candidates]
    lowered = {n.lower(): n for n in names}
    if str(word).lower() in lowered and str(word) not in names:
        return [lowered[str(word).lower()]]
    return difflib.get_close_matches(str(word), names, n=2, cutoff=0.6)


def did_you_mean(word: Any, candidates: Iterable[Any]) -> str:
    """`` (did you mean 'x'?)`` naming the closest candidates, or an empty string."""
    close = close_matches(word, candidates)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"
