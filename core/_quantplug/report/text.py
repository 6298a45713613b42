"""The plain-text summary printed by ``quantplug quantize`` and ``quantplug report``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from _quantplug.report.html import human_bytes, mixed_precision_source


def _db(value: Any, identical: bool = False) -> str:
    if identical:
        return "identical"
    return "n/a" if value is None else f"{value:.1f} dB"


def format_summary(data: Mapping[str, Any], *, worst: int = 5, out_dir: str | None = None) -> str:
    s = data.get("summary", {})
    backend = data.get("backend", {})
    model = data.get("model", {})
    calibration = data.get("calibration", {})
    opts = " ".join(f"{k}={v}" for k, v in data.get("options", {}).items())
    dist = f" ({backend['distribution']} {backend.get('version')})" if backend.get("distribution") else ""
    lines = [
        f"model:       {model.get('source', '?')}",
        f"backend:     {backend.get('name', '?')}{dist}" + (f"  {opts}" if opts else ""),
        f"calibration: {calibration.get('batches', '?')} batch(es) from {calibration.get('source', '?')}"
        + ("  [RANDOM DATA]" if calibration.get("random") else ""),
        f"nodes:       {s.get('nodes_quantized', 0)} quantized, {s.get('nodes_float', 0)} float"
        + (f", {s['nodes_removed']} folded/removed" if s.get("nodes_removed") else ""),
    ]
    for f in data.get("float_nodes", [])[:10]:
        lines.append(f"             float {f['node']} [{f['op']}]: {f['reason']}")
    if len(data.get("float_nodes", [])) > 10:
        lines.append(
            f"             ... and {len(data['float_nodes']) - 10} more float node(s) (see the report)"
        )
    err = s.get("output_max_abs_error")
    lines.append(
        f"SQNR:        {_db(s.get('output_sqnr_db'), bool(s.get('output_identical')))} "
        "(model output, quantized vs float)"
        + (f", max |error| {err:.4g}" if isinstance(err, (int, float)) else "")
    )
    mixed = data.get("mixed_precision")
    if isinstance(mixed, Mapping):
        lines.append(_mixed_line(mixed))
    shipped = _artifact_line(data.get("artifact"))
    if shipped:
        lines.append(shipped)
    bad = data.get("worst", [])[:worst]
    if bad:
        lines.append(
            "worst nodes: "
            + ", ".join(f"{n['node']} {_db(n.get('sqnr_db'), bool(n.get('identical')))}" for n in bad)
        )
    fb, qb, ratio = s.get("float_bytes"), s.get("quantized_bytes"), s.get("size_ratio")
    if fb is not None and qb is not None:
        lines.append(
            f"size:        {human_bytes(fb)} float -> {human_bytes(qb)} quantized"
            + (f" ({ratio:.2f}x smaller)" if isinstance(ratio, (int, float)) else "")
        )
    violations = (data.get("validation") or {}).get("violations", [])
    warnings = data.get("warnings", [])
    if violations or warnings:
        lines.append(
            f"warnings:    {len(violations)} constraint violation(s), {len(warnings)} other (see the report)"
        )
    if out_dir is not None:
        files = [f["path"] for f in data.get("files", [])]
        artifact = [f for f in files if f.startswith("artifact/")]
        shown = [f for f in files if not f.startswith("artifact/")]
        if artifact:
            shown.insert(1, f"artifact/ ({len(artifact)} file(s))")
        lines.append(f"written:     {out_dir}/  " + ", ".join(shown))
    total = data.get("timings", {}).get("total")
    if isinstance(total, (int, float)):
        lines.append(f"time:        {total:.1f} s")
    return "\n".join(lines)


def _artifact_line(artifact: Mapping[str, Any] | None) -> str:
    """'artifact:    38.1 dB (backend artifact vs float), 0.2 dB below the program' (+ the flag)."""
    if not artifact:
        return ""
    if not artifact.get("ran"):
        return f"artifact:    not measured ({artifact.get('note') or 'it cannot run here'})"
    sqnr = _db(artifact.get("sqnr_db"), bool(artifact.get("identical")))
    line = f"artifact:    {sqnr} (backend artifact vs float)"
    gap = artifact.get("gap_db")
    if isinstance(gap, (int, float)) and abs(gap) >= 0.05:
        line += f", {abs(gap):.1f} dB {'below' if gap > 0 else 'above'} the Q/DQ program"
    if artifact.get("flagged"):
        line += f"  [GAP > {artifact.get('threshold_db', 1.0):g} dB: what ships is not what was measured]"
    return line


def _mixed_line(mixed: Mapping[str, Any]) -> str:
    """'mixed:       2 of 7 layers raised from 16a4w (16a8w: 2), searched for ... ; chosen 31.2 dB'."""
    overrides = mixed.get("overrides") or {}
    layers = mixed.get("layers")
    counted = f"{len(overrides)} of {layers}" if isinstance(layers, int) else str(len(overrides))
    presets: dict[str, int] = {}
    for preset in overrides.values():
        presets[preset] = presets.get(preset, 0) + 1
    by_preset = ", ".join(f"{p}: {n}" for p, n in sorted(presets.items()))
    line = f"mixed:       {counted} layer(s) raised from {mixed.get('default', '?')}"
    line += (f" ({by_preset})" if by_preset else "") + f", {mixed_precision_source(mixed)}"
    chosen, curve = mixed.get("chosen"), mixed.get("curve") or []
    if isinstance(chosen, int) and 0 <= chosen < len(curve):
        point = curve[chosen]
        size = human_bytes(point.get("weight_bytes"))
        line += f"; chosen point {_db(point.get('sqnr_db'))} at {size} weights"
    return line
