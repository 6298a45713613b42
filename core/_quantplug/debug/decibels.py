"""SQNR figures in decibels, as the debugger's reports compute, print and store them."""

from __future__ import annotations

import math


def sqnr(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)``; ``inf`` without noise, ``-inf`` without signal."""
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def format_db(value: float | None) -> str:
    """A figure for a text report (``identical`` for no error at all)."""
    if value is None:
        return "n/a"
    if math.isinf(value):
        return "identical" if value > 0 else "-inf dB"
    return f"{value:.1f} dB"


def json_float(value: float | None) -> float | None:
    """A figure for JSON, which has no infinity nor NaN (None instead)."""
    if value is None or math.isinf(value) or math.isnan(value):
        return None
    return float(value)
