"""The report's plots (matplotlib, rendered off-screen to PNG bytes): per-layer SQNR, and the
mixed-precision accuracy-size trade-off curve."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

QUANTIZED_COLOR = "#3b6ea8"
FLOAT_COLOR = "#a0a7b1"
WORST_COLOR = "#d1382b"
OUTPUT_COLOR = "#2f8f46"


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def sqnr_plot_png(
    layers: Sequence[dict[str, Any]],
    *,
    output_sqnr_db: float | None = None,
    highlight: int = 5,
    title: str = "Per-layer SQNR, quantized vs float (graph order)",
) -> bytes | None:
    """A bar per compared node in graph order; the ``highlight`` worst in red and labelled.

    ``layers`` are the report's node dicts (``node``, ``quantized``, ``sqnr_db``, ``identical``).
    Returns PNG bytes, or None when matplotlib is not installed or there is nothing to plot.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        return None
    rows = [r for r in layers if r.get("sqnr_db") is not None or r.get("identical")]
    if not rows:
        return None
    finite = [float(r["sqnr_db"]) for r in rows if r.get("sqnr_db") is not None]
    top = (max(finite) if finite else 60.0) + 10.0
    values = [top if r.get("sqnr_db") is None else float(r["sqnr_db"]) for r in rows]
    ranked = sorted(
        (i for i, r in enumerate(rows) if r.get("sqnr_db") is not None), key=lambda i: (values[i], i)
    )
    worst = set(ranked[:highlight])
    colors = [
        WORST_COLOR if i in worst else QUANTIZED_COLOR if r.get("quantized") else FLOAT_COLOR
        for i, r in enumerate(rows)
    ]

    n = len(rows)
    fig = Figure(figsize=(12, 4.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(n))
    bars = ax.bar(xs, values, color=colors, width=0.8 if n < 400 else 1.0, linewidth=0)
    for i, r in enumerate(rows):
        if r.get("sqnr_db") is None:  # identical outputs: drawn capped and hatched
            bars[i].set_hatch("//")
            bars[i].set_alpha(0.5)
    low = min(0.0, min(values) - 5.0)
    ax.set_ylim(low, top + 8.0)
    ax.set_xlim(-0.8, n - 0.2)
    if output_sqnr_db is not None and math.isfinite(output_sqnr_db):
        # a value off the layers' scale (a report edited by hand, say) is drawn at the edge: text
        # placed millions of dB away would make the figure's tight layout millions of pixels tall
        shown = min(max(output_sqnr_db, low + 1.0), top + 6.0)
        ax.axhline(shown, color=OUTPUT_COLOR, linestyle="--", linewidth=1.2)
        ax.text(
            n - 0.3,
            shown + 0.8,
            f"model output {output_sqnr_db:.1f} dB",
            color=OUTPUT_COLOR,
            ha="right",
            va="bottom",
            fontsize=9,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.5},
            zorder=5,
        )
    for i in ranked[:highlight]:
        ax.annotate(
            rows[i]["node"],
            (i, values[i]),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
            color=WORST_COLOR,
            rotation=90 if n > 12 else 0,
        )
    if n <= 60:
        ax.set_xticks(xs)
        ax.set_xticklabels([r["node"] for r in rows], rotation=60, ha="right", fontsize=8)
    else:
        step = max(1, n // 40)
        ax.set_xticks(xs[::step])
        ax.set_xticklabels([rows[i]["node"] for i in xs[::step]], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("SQNR (dB, higher is better)")
    ax.set_title(title, fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    ax.spines["top"].set_visible(False)
    ax.spines["right"].set_visible(False)
    handles = [
        Patch(color=QUANTIZED_COLOR, label="quantized"),
        Patch(color=FLOAT_COLOR, label="float"),
        Patch(color=WORST_COLOR, label=f"worst {min(highlight, len(ranked))}"),
    ]
    ax.legend(handles=handles, loc="upper left", fontsize=8, frameon=False, ncol=3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def tradeoff_plot_png(mixed: Mapping[str, Any]) -> bytes | None:
    """Output SQNR against weight bytes for every point the mixed-precision search measured.

    ``mixed`` is :meth:`_quantplug.mixed_precision.MixedPrecision.to_dict` (what
    report.json holds under ``mixed_precision``): ``curve`` points with ``weight_bytes`` and
    ``sqnr_db``, the ``chosen`` point's index, the ``target`` (an SQNR floor or a byte budget).
    None when matplotlib is not installed or no point has a finite SQNR.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    curve = list(mixed.get("curve") or [])
    points = [
        (float(p["weight_bytes"]), float(p["sqnr_db"]))
        for p in curve
        if isinstance(p.get("weight_bytes"), (int, float)) and isinstance(p.get("sqnr_db"), (int, float))
    ]
    points = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
    if not points:
        return None
    fig = Figure(figsize=(7, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(
        [x / 1024 for x, _ in points],
        [y for _, y in points],
        "-o",
        color=QUANTIZED_COLOR,
        markersize=4,
        label="measured (search batches)",
    )
    chosen = mixed.get("chosen")
    if isinstance(chosen, int) and 0 <= chosen < len(curve):
        x, y = curve[chosen].get("weight_bytes"), curve[chosen].get("sqnr_db")
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            ax.plot([x / 1024], [y], "o", color=WORST_COLOR, markersize=9, label="chosen")
    target = mixed.get("target") or {}
    if isinstance(target.get("sqnr_db"), (int, float)):
        ax.axhline(target["sqnr_db"], color=OUTPUT_COLOR, linestyle="--", linewidth=1, label="SQNR floor")
    if isinstance(target.get("weight_bytes"), (int, float)):
        budget = target["weight_bytes"] / 1024
        ax.axvline(budget, color=OUTPUT_COLOR, linestyle=":", linewidth=1, label="budget")
    ax.set_xlabel("conv/linear weight size (KiB)")
    ax.set_ylabel("output SQNR vs float (dB)")
    title = f"{mixed.get('backend', '?')}: mixed precision from {mixed.get('default', '?')}"
    ax.set_title(title, fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
