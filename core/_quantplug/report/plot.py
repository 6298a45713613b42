"""The report's plots (matplotlib, rendered off-screen to PNG bytes): per-layer SQNR, and the
mixed-precision accuracy-size trade-off curve."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


#: past this many compared nodes the plot draws groups of consecutive nodes, one bar each (the
#: group's lowest SQNR): one bar per node took 34 s for 1,000 nodes, 200,000 never finished, and
#: a figure 12 inches wide shows a few hundred bars at most
BAR_LIMIT = 300


@dataclass(frozen=True)
class _Bar:
    value: float  # the lowest SQNR of the bar's nodes, or the cap when all are identical
    identical: bool  # every node of the bar has identical outputs (drawn capped and hatched)
    quantized: bool  # some node of the bar is quantized
    first: int  # the index of the bar's first node


def plotted_rows(layers: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The nodes the SQNR plot draws: those with an SQNR, or with identical outputs."""
    return [r for r in layers if r.get("sqnr_db") is not None or r.get("identical")]


def group_size(count: int) -> int:
    """Consecutive nodes per bar for ``count`` plotted nodes (1 up to :data:`BAR_LIMIT`)."""
    return max(1, math.ceil(count / BAR_LIMIT))


def sqnr_plot_png(
    layers: Sequence[dict[str, Any]],
    *,
    output_sqnr_db: float | None = None,
    highlight: int = 5,
    title: str = "Per-layer SQNR, quantized vs float (graph order)",
) -> bytes | None:
    """A bar per compared node in graph order, the ``highlight`` worst in red and labelled; past
    :data:`BAR_LIMIT` nodes a bar per group of :func:`group_size` consecutive nodes, at the
    group's lowest SQNR (the worst nodes' groups red, labelled with the node), the title saying so.

    ``layers`` are the report's node dicts (``node``, ``quantized``, ``sqnr_db``, ``identical``).
    Returns PNG bytes, or None when matplotlib is not installed or there is nothing to plot.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        return None
    rows = plotted_rows(layers)
    if not rows:
        return None
    finite = [float(r["sqnr_db"]) for r in rows if r.get("sqnr_db") is not None]
    top = (max(finite) if finite else 60.0) + 10.0
    size = group_size(len(rows))
    bars = _bars(rows, size, top)
    ranked = sorted(
        (i for i, r in enumerate(rows) if r.get("sqnr_db") is not None),
        key=lambda i: (float(rows[i]["sqnr_db"]), i),
    )[:highlight]
    worst = {i // size: i for i in reversed(ranked)}  # bar -> its worst highlighted node
    colors = [
        WORST_COLOR if b in worst else QUANTIZED_COLOR if bar.quantized else FLOAT_COLOR
        for b, bar in enumerate(bars)
    ]
    values = [bar.value for bar in bars]

    n = len(bars)
    fig = Figure(figsize=(12, 4.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(n))
    drawn = ax.bar(xs, values, color=colors, width=0.8 if n < 200 else 1.0, linewidth=0)
    for b, bar in enumerate(bars):
        if bar.identical:  # identical outputs: drawn capped and hatched
            drawn[b].set_hatch("//")
            drawn[b].set_alpha(0.5)
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
    for b, i in worst.items():
        ax.annotate(
            rows[i]["node"],
            (b, values[b]),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
            color=WORST_COLOR,
            rotation=90 if n > 12 else 0,
        )
    if size > 1:
        step = max(1, n // 10)
        ax.set_xticks(xs[::step])
        ax.set_xticklabels([f"{bars[b].first:,}" for b in xs[::step]], fontsize=8)
        ax.set_xlabel(f"node index in graph order (each bar: {size:,} consecutive nodes, their lowest SQNR)")
        title = f"Per-layer SQNR of {len(rows):,} nodes in {n} groups of {size:,} (graph order)"
    elif n <= 60:
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
        Patch(color=WORST_COLOR, label=f"worst {len(ranked)}" + (" (their groups)" if size > 1 else "")),
    ]
    ax.legend(handles=handles, loc="upper left", fontsize=8, frameon=False, ncol=3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _bars(rows: Sequence[dict[str, Any]], size: int, top: float) -> list[_Bar]:
    """One bar per ``size`` consecutive rows: the lowest SQNR among them (identical outputs, no
    SQNR, count as ``top``: drawn capped)."""
    bars = []
    for first in range(0, len(rows), size):
        group = rows[first : first + size]
        finite = [float(r["sqnr_db"]) for r in group if r.get("sqnr_db") is not None]
        bars.append(
            _Bar(
                value=min(finite) if finite else top,
                identical=not finite,
                quantized=any(r.get("quantized") for r in group),
                first=first,
            )
        )
    return bars


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
