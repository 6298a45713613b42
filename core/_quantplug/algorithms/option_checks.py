"""The value checks an algorithm option's declaration implies, shared by the algorithm (at build
time) and the command line (from metadata, before anything heavy is imported).

Torch-free on purpose: ``quantplug quantize --algorithm-option gptq.damp=nan`` must fail in the
argument check, with the message building the algorithm would give.
"""

from __future__ import annotations

import math


def range_problem(type_name: str, value: object, minimum: float | None, maximum: float | None) -> str | None:
    """What is wrong with ``value`` for an option of ``type_name`` bounded by ``minimum``/``maximum``
    (inclusive; None: unbounded), as the end of "option 'x' of algorithm 'y' must ...", or None.

    A float must be finite whatever its bounds: NaN passes every comparison, and an infinite
    damping or rate is never what was meant.
    """
    if type_name not in ("int", "float") or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if type_name == "float" and not math.isfinite(value):
        return "be a finite number"
    low = -math.inf if minimum is None else minimum
    high = math.inf if maximum is None else maximum
    return None if low <= value <= high else f"be {bounds_text(minimum, maximum)}"


def bounds_text(minimum: float | None, maximum: float | None) -> str:
    """``>= 1``, ``<= 16``, ``in [1, 16]`` (or "" unbounded): for messages and listings."""
    if minimum is None and maximum is None:
        return ""
    if maximum is None:
        return f">= {minimum:g}"
    if minimum is None:
        return f"<= {maximum:g}"
    return f"in [{minimum:g}, {maximum:g}]"
