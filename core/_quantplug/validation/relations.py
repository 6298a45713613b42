"""Relations between ports and limits on encodings, checked on plain values (no torch, no graph).

The engine (``engine.py``, at prepare) and the calibrated check (``calibrated.py``, at convert)
reduce a node to a mapping ``port -> facts`` and call these functions, so the rules themselves
are small pure functions that property tests can drive directly:

* :func:`check_values` / :func:`check_port_values`: encodings known (calibrated, or fixed specs);
* :func:`check_static`: before calibration, from sharing groups and spec kinds only;
* :func:`share_merges`: the sharing merges an ``enforce="share"`` relation asks for.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from _quantplug.validation.constraints import (
    OUTPUT,
    Port,
    PortRelation,
    RequantRatio,
    SameEncoding,
    SameScale,
    ScaleProduct,
)

Key = Hashable


@dataclass(frozen=True)
class Encoding:
    """One tensor's encoding: a scale and zero point per tensor (one entry) or per channel/block."""

    scale: tuple[float, ...]
    zero_point: tuple[int, ...]
    dtype: str
    quant_min: int
    quant_max: int

    @property
    def grid(self) -> tuple[str, int, int]:
        return (self.dtype, self.quant_min, self.quant_max)

    def describe(self) -> str:
        return f"{_grid_text(self.grid)} scale {_values(self.scale)} zero point {_values(self.zero_point)}"


@dataclass(frozen=True)
class PortFacts:
    """What is known about one quantized port before calibration.

    ``group`` is its sharing group (None when groups are not resolved yet); ``kind`` is
    ``"plain"`` (measured by an observer), ``"fixed"``, ``"derived"`` or ``"dynamic"`` (computed
    at run time: never checked); ``encoding`` is set for fixed specs; ``derived_from`` holds the
    groups a derived spec reads.
    """

    group: int | None
    kind: str
    grid: tuple[str, int, int]
    encoding: Encoding | None = None
    derived_from: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Problem:
    """One broken rule: which ports, what was expected, what was found."""

    rule: str
    ports: str
    expected: str
    actual: str


def port_label(port: Port) -> str:
    return "output" if port == OUTPUT else f"input {port}"


def _grid_text(grid: tuple[str, int, int]) -> str:
    return f"{grid[0]}[{grid[1]},{grid[2]}]"


def _values(values: Sequence[float]) -> str:
    shown = ", ".join(f"{v:.6g}" for v in values[:4])
    more = f", ... ({len(values)} values)" if len(values) > 4 else ""
    return shown if len(values) == 1 else f"[{shown}{more}]"


def close(a: float, b: float, rtol: float) -> bool:
    """``a`` and ``b`` agree within a relative tolerance (NaN agrees with nothing)."""
    if a == b:
        return True
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def _broadcast_length(*lengths: int) -> int | None:
    """The common length of per-tensor (1) and per-channel (n) value lists, None if they clash."""
    n = max(lengths)
    return n if all(length in (1, n) for length in lengths) else None


def _at(values: Sequence[float], i: int) -> float:
    return values[0] if len(values) == 1 else values[i]


# --- numeric limits on one port -----------------------------------------------------------------


def check_port_values(
    port: Port,
    encoding: Encoding,
    scale_range: tuple[float, float] | None,
    zero_point_range: tuple[int, int] | None,
) -> list[Problem]:
    """Limits on one port's scale and zero point (every channel must satisfy them)."""
    problems: list[Problem] = []
    label = port_label(port)
    if scale_range is not None:
        low, high = scale_range
        bad = [s for s in encoding.scale if not (low <= s <= high)]  # NaN fails too
        if bad:
            worst = max(bad, key=lambda s: math.inf if math.isnan(s) else max(low - s, s - high))
            problems.append(
                Problem("scale range", label, f"scale in [{low:.6g}, {high:.6g}]", f"scale {worst:.6g}")
            )
    if zero_point_range is not None:
        zlow, zhigh = zero_point_range
        zbad = [z for z in encoding.zero_point if not (zlow <= z <= zhigh)]
        if zbad:
            zworst = max(zbad, key=lambda z: max(zlow - z, z - zhigh))
            problems.append(
                Problem("zero point range", label, f"zero point in [{zlow}, {zhigh}]", f"zero point {zworst}")
            )
    return problems


# --- relations on known encodings ---------------------------------------------------------------


def check_values(relation: PortRelation, encodings: Mapping[Port, Encoding]) -> list[Problem]:
    """A relation checked on known encodings. Ports without one (float ports) are left out."""
    if isinstance(relation, (SameEncoding, SameScale)):
        return _check_same(relation, encodings)
    if isinstance(relation, ScaleProduct):
        return _check_product(relation, encodings)
    return _check_ratio(relation, encodings)


def _check_same(relation: SameEncoding | SameScale, encodings: Mapping[Port, Encoding]) -> list[Problem]:
    present = [p for p in relation.ports if p in encodings]
    if len(present) < 2:
        return []
    first = present[0]
    a = encodings[first]
    whole = isinstance(relation, SameEncoding)
    for port in present[1:]:
        b = encodings[port]
        mismatch = _same_mismatch(a, b, whole=whole, rtol=relation.rtol)
        if mismatch:
            what = "one encoding" if whole else "one scale"
            return [
                Problem(
                    relation.rule,
                    relation.label(),
                    what,
                    f"{port_label(first)} {mismatch[0]} vs {port_label(port)} {mismatch[1]}",
                )
            ]
    return []


def _same_mismatch(a: Encoding, b: Encoding, *, whole: bool, rtol: float) -> tuple[str, str] | None:
    """How ``a`` and ``b`` differ (their descriptions), or None when they agree."""
    if whole and a.grid != b.grid:
        return _grid_text(a.grid), _grid_text(b.grid)
    n = _broadcast_length(len(a.scale), len(b.scale))
    if n is None:
        return f"{len(a.scale)} scales", f"{len(b.scale)} scales"
    for i in range(n):
        if not close(_at(a.scale, i), _at(b.scale, i), rtol):
            return f"scale {_values(a.scale)}", f"scale {_values(b.scale)}"
    if whole:
        nz = _broadcast_length(len(a.zero_point), len(b.zero_point))
        if nz is None or any(_at(a.zero_point, i) != _at(b.zero_point, i) for i in range(nz)):
            return f"zero point {_values(a.zero_point)}", f"zero point {_values(b.zero_point)}"
    return None


def _scale_products(factors: Sequence[Encoding]) -> tuple[float, ...] | None:
    n = _broadcast_length(*(len(f.scale) for f in factors))
    if n is None:
        return None
    return tuple(math.prod(_at(f.scale, i) for f in factors) for i in range(n))


def _check_product(relation: ScaleProduct, encodings: Mapping[Port, Encoding]) -> list[Problem]:
    if relation.result not in encodings or any(f not in encodings for f in relation.factors):
        return []
    result = encodings[relation.result]
    factor_text = " x ".join(port_label(f) for f in relation.factors)
    expected = _scale_products([encodings[f] for f in relation.factors])
    n = None if expected is None else _broadcast_length(len(expected), len(result.scale))
    if expected is None or n is None:
        return [
            Problem(
                relation.rule,
                relation.label(),
                f"scale = {factor_text}",
                "scales of incompatible lengths: "
                + ", ".join(f"{port_label(p)} {len(encodings[p].scale)}" for p in relation.ports),
            )
        ]
    for i in range(n):
        want, got = _at(expected, i), _at(result.scale, i)
        if not close(want, got, relation.rtol):
            where = f" (channel {i})" if n > 1 else ""
            return [
                Problem(
                    relation.rule,
                    relation.label(),
                    f"{port_label(relation.result)} scale = {factor_text} = {want:.8g}{where}",
                    f"{got:.8g}",
                )
            ]
    return []


def _check_ratio(relation: RequantRatio, encodings: Mapping[Port, Encoding]) -> list[Problem]:
    if relation.output not in encodings or any(p not in encodings for p in relation.inputs):
        return []
    numerator = _scale_products([encodings[p] for p in relation.inputs])
    out = encodings[relation.output].scale
    n = None if numerator is None else _broadcast_length(len(numerator), len(out))
    low = -math.inf if relation.minimum is None else relation.minimum
    high = math.inf if relation.maximum is None else relation.maximum
    bounds = f"ratio in [{low:.6g}, {high:.6g}]"
    if numerator is None or n is None:
        return [Problem(relation.rule, relation.label(), bounds, "scales of incompatible lengths")]
    worst: tuple[float, int] | None = None
    for i in range(n):
        denominator = _at(out, i)
        ratio = _at(numerator, i) / denominator if denominator else math.inf
        if not (low <= ratio <= high):
            excess = math.inf if math.isnan(ratio) else max(low - ratio, ratio - high)
            if worst is None or excess > worst[0]:
                worst = (excess, i)
    if worst is None:
        return []
    i = worst[1]
    ratio = _at(numerator, i) / _at(out, i) if _at(out, i) else math.inf
    where = f" (channel {i})" if n > 1 else ""
    return [Problem(relation.rule, relation.label(), bounds, f"ratio {ratio:.6g}{where}")]


# --- relations before calibration ---------------------------------------------------------------


def check_static(relation: PortRelation, facts: Mapping[Port, PortFacts]) -> list[Problem]:
    """What a relation's annotations already decide, before any value is measured.

    Unquantized ports are left out (coverage, not a violation); a relation touching a dynamic
    port is never checked (its encoding exists only at run time). Known violations:

    * same encoding/scale: ports in separate sharing groups where one of them is measured (two
      observers agree only by chance), or grids that differ (same encoding);
    * scale product: a result that is not derived from exactly the factors' groups;
    * any relation whose ports all have fixed encodings: checked on the values.
    """
    quantized = {p: f for p, f in facts.items() if p in relation.ports}
    if any(f.kind == "dynamic" for f in quantized.values()):
        return []
    known = {p: f.encoding for p, f in quantized.items() if f.encoding is not None}
    if len(known) == len(quantized):
        return check_values(relation, known)
    if isinstance(relation, (SameEncoding, SameScale)):
        return _static_same(relation, quantized)
    if isinstance(relation, ScaleProduct):
        return _static_product(relation, quantized)
    return []  # a requantization ratio needs calibrated values


def _static_same(relation: SameEncoding | SameScale, facts: Mapping[Port, PortFacts]) -> list[Problem]:
    present = [p for p in relation.ports if p in facts]
    if len(present) < 2:
        return []
    if isinstance(relation, SameEncoding):
        grids = {facts[p].grid for p in present}
        if len(grids) > 1:
            shown = ", ".join(f"{port_label(p)} {_grid_text(facts[p].grid)}" for p in present)
            return [Problem(relation.rule, relation.label(), "one grid", shown)]
    groups = {facts[p].group for p in present}
    if None in groups or len(groups) == 1:
        return []
    for i, a in enumerate(present):
        for b in present[i + 1 :]:
            fa, fb = facts[a], facts[b]
            if fa.group == fb.group:
                continue
            if "plain" in (fa.kind, fb.kind):
                how = (
                    "share them (enforce='share')" if relation.enforce == "check" else "they could not share"
                )
                return [
                    Problem(
                        relation.rule,
                        relation.label(),
                        "one sharing group (one observer)",
                        f"{port_label(a)} in group {fa.group}, {port_label(b)} in group {fb.group}: "
                        f"calibrated separately ({how})",
                    )
                ]
            if fa.encoding is not None and fb.encoding is not None:
                found = check_values(relation, {a: fa.encoding, b: fb.encoding})
                if found:
                    return found
    return []


def _static_product(relation: ScaleProduct, facts: Mapping[Port, PortFacts]) -> list[Problem]:
    result = facts.get(relation.result)
    if result is None or any(f not in facts for f in relation.factors):
        return []
    factor_groups = {facts[f].group for f in relation.factors}
    factor_text = ", ".join(port_label(f) for f in relation.factors)
    expected = f"a DerivedQuantizationSpec of the encodings of {factor_text}"
    if result.kind == "derived":
        if None in factor_groups or result.derived_from == factor_groups:
            return []
        return [
            Problem(
                relation.rule,
                relation.label(),
                expected,
                f"derived from groups {sorted(result.derived_from)}, the factors are in groups "
                f"{sorted(g for g in factor_groups if g is not None)}",
            )
        ]
    if result.kind == "fixed":
        return [Problem(relation.rule, relation.label(), expected, "a fixed encoding")]
    return [Problem(relation.rule, relation.label(), expected, f"a {result.kind} spec (its own observer)")]


# --- relations satisfied by construction ----------------------------------------------------------


def share_merges(
    relation: PortRelation, keys: Mapping[Port, Key], signatures: Mapping[Port, Hashable]
) -> list[tuple[Key, Key]]:
    """The sharing merges an ``enforce="share"`` relation asks for.

    ``keys`` maps the node's quantized ports to their sharing keys, ``signatures`` to the
    signature of the concrete spec behind each (what the resolution compares). Ports whose
    signature differs from the first port's cannot share its observer and are left out; the
    static check then reports them (separate groups, or different grids).
    """
    if relation.enforce != "share":
        return []
    present = [p for p in relation.ports if p in keys]
    if len(present) < 2:
        return []
    first = present[0]
    return [(keys[first], keys[p]) for p in present[1:] if signatures.get(p) == signatures.get(first)]
