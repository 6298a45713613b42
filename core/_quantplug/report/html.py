"""report.html: one self-contained page (inline CSS, the plot as a base64 PNG, no scripts, no
network), rendered from the report dict."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from _quantplug.report.plot import group_size, plotted_rows, sqnr_plot_png, tradeoff_plot_png

GOOD_DB = 30.0  # SQNR at or above: green
FAIR_DB = 20.0  # at or above: amber; below: red
HIGHLIGHT = 5  # worst layers highlighted in the plot
#: the most rows of the table of every compared node (a page of 200,000 rows is 60 MB that no
#: browser shows): the others are in report.json
TABLE_LIMIT = 5000

_CSS = """
:root { --fg:#1d2330; --muted:#5b6475; --line:#e3e6ec; --bg:#f6f7f9; --card:#fff;
        --good:#1f7a3a; --fair:#a86400; --bad:#c0312a; --accent:#3b6ea8; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--fg);
       font:14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width:1240px; margin:0 auto; padding:24px 28px 48px; }
header h1 { font-size:22px; margin:0 0 4px; }
header p { margin:0; color:var(--muted); }
h2 { font-size:16px; margin:28px 0 10px; }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size:12.5px; }
.cards { display:grid; grid-template-columns:repeat(auto-fill, minmax(220px, 1fr)); gap:12px;
         margin-top:18px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:12px 14px; }
.card .label { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
.card .value { font-size:19px; font-weight:600; margin-top:2px; }
.card .sub { color:var(--muted); font-size:12.5px; margin-top:2px; }
.panel { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:14px 16px; }
.plot img { display:block; max-width:100%; height:auto; margin:0 auto; }
table { border-collapse:collapse; width:100%; background:var(--card); }
th, td { text-align:left; padding:6px 10px; border-bottom:1px solid var(--line); vertical-align:top; }
th { background:#eef1f5; font-weight:600; font-size:12.5px; }
td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
tr:last-child td { border-bottom:none; }
.tablewrap { border:1px solid var(--line); border-radius:8px; overflow:hidden; }
.chip { display:inline-block; padding:1px 8px; border-radius:10px; font-size:12px; font-weight:600;
        color:#fff; }
.good { background:var(--good); } .fair { background:var(--fair); } .bad { background:var(--bad); }
.none { background:#8a93a3; }
.tag { display:inline-block; padding:0 6px; border-radius:4px; font-size:11.5px; border:1px solid var(--line);
       color:var(--muted); }
.tag.q { color:var(--accent); border-color:#b9cde6; }
.warn { border-left:4px solid var(--fair); background:#fff8ec; padding:8px 12px; margin:6px 0;
        border-radius:4px; }
.warn.error { border-left-color:var(--bad); background:#fdf0ef; }
.ok { border-left:4px solid var(--good); background:#eff8f1; padding:8px 12px; border-radius:4px; }
.opts { margin:0; padding:0; list-style:none; }
.opts li { display:inline-block; margin:2px 6px 2px 0; }
details { margin-top:10px; }
details summary { cursor:pointer; font-weight:600; padding:6px 0; }
.muted { color:var(--muted); }
footer { margin-top:36px; color:var(--muted); font-size:12px; }
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _db_class(value: float | None, identical: bool = False) -> str:
    if identical:
        return "good"
    if value is None:
        return "none"
    return "good" if value >= GOOD_DB else "fair" if value >= FAIR_DB else "bad"


def _db_chip(value: float | None, identical: bool = False) -> str:
    if identical:
        text = "identical"
    elif value is None:
        text = "n/a"
    else:
        text = f"{value:.1f} dB"
    return f'<span class="chip {_db_class(value, identical)}">{_e(text)}</span>'


def _num(value: Any, fmt: str = "{:.4g}") -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and not math.isfinite(value):
        return "–"
    return fmt.format(value)


def human_bytes(value: int | None) -> str:
    if value is None:
        return "n/a"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{value} B"


def _card(label: str, value: str, sub: str = "", *, raw: bool = False, ident: str = "") -> str:
    v = value if raw else _e(value)
    attr = f' id="{ident}"' if ident else ""
    return (
        f'<div class="card"{attr}><div class="label">{_e(label)}</div><div class="value">{v}</div>'
        + (f'<div class="sub">{_e(sub)}</div>' if sub else "")
        + "</div>"
    )


def _node_rows(rows: Sequence[Mapping[str, Any]], *, rank: bool) -> str:
    out = []
    for i, r in enumerate(rows, 1):
        tag = (
            '<span class="tag q">quantized</span>' if r.get("quantized") else '<span class="tag">float</span>'
        )
        shape = "×".join(str(s) for s in r.get("shape") or []) or "–"
        note = _e(r.get("note") or "")
        out.append(
            '<tr class="node-row">'
            + (f'<td class="num">{i}</td>' if rank else "")
            + f'<td class="mono">{_e(r.get("node"))}</td>'
            + f'<td class="mono">{_e(r.get("op"))}</td>'
            + f"<td>{tag}</td>"
            + f'<td class="num">{_db_chip(r.get("sqnr_db"), bool(r.get("identical")))}</td>'
            + f'<td class="num">{_num(r.get("max_abs_error"))}</td>'
            + f'<td class="mono">{_e(shape)}</td>'
            + f'<td class="muted">{note}</td>'
            + "</tr>"
        )
    return "\n".join(out)


def _node_table(rows: Sequence[Mapping[str, Any]], *, ident: str, rank: bool) -> str:
    head = (
        ('<th class="num">#</th>' if rank else "")
        + "<th>node</th><th>op</th><th></th><th class='num'>SQNR</th>"
        + "<th class='num'>max |error|</th><th>shape</th><th>note</th>"
    )
    return (
        f'<div class="tablewrap"><table id="{ident}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{_node_rows(rows, rank=rank)}</tbody></table></div>"
    )


Cell = tuple[str, str]  # (escaped html, css class)


def _table(ident: str, head: Sequence[Cell], rows: Sequence[Sequence[Cell]]) -> str:
    th = "".join(f'<th class="{cls}">{_e(text)}</th>' for text, cls in head)
    body = "".join(
        "<tr>" + "".join(f'<td class="{cls}">{html_}</td>' for html_, cls in r) + "</tr>" for r in rows
    )
    table = f'<table id="{ident}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'
    return f'<div class="tablewrap">{table}</div>'


def _reason_cells(f: Mapping[str, Any]) -> list[Cell]:
    return [(_e(f.get("node")), "mono"), (_e(f.get("op")), "mono"), (_e(f.get("reason")), "")]


def _group_cells(g: Mapping[str, Any]) -> list[Cell]:
    if g.get("scale") is not None:
        encoding = f"scale {_num(g.get('scale'), '{:.5g}')}, zero point {g.get('zero_point')}"
    elif g.get("channels"):
        encoding = f"{g.get('channels')} scales"
    elif g.get("granularity") in ("dynamic", "token"):
        encoding = "computed at run time"
    else:
        encoding = "–"
    grid = f"{g.get('dtype')} [{g.get('quant_min')}, {g.get('quant_max')}]"
    return [
        (_e(g.get("id")), "num"),
        (_e(g.get("kind")), ""),
        (_e(grid), "mono"),
        (_e(g.get("granularity")), ""),
        (_e(encoding), "mono"),
        (_e(", ".join(g.get("members", []))), "mono"),
    ]


def _artifact_card(artifact: Mapping[str, Any] | None) -> list[str]:
    """The backend artifact's output SQNR, beside the program's card (none without an artifact)."""
    if not artifact:
        return []
    if not artifact.get("ran"):
        note = str(artifact.get("note", ""))
        return [_card("artifact output SQNR", "not measured", note, ident="card-artifact")]
    gap = artifact.get("gap_db")
    sub = "what ships (the backend's artifact) vs float"
    if isinstance(gap, (int, float)):
        sub += f" · {abs(gap):.1f} dB {'below' if gap > 0 else 'above'} the Q/DQ program"
    return [
        _card(
            "artifact output SQNR",
            _db_chip(artifact.get("sqnr_db"), bool(artifact.get("identical"))),
            sub,
            raw=True,
            ident="card-artifact",
        )
    ]


def _artifact_warning(artifact: Mapping[str, Any] | None) -> str:
    if not artifact or not artifact.get("flagged"):
        return ""
    gap = artifact.get("gap_db") or 0.0
    return (
        '<div class="warn error" id="artifact-gap">The backend artifact\'s output SQNR is '
        f"{abs(gap):.1f} dB {'below' if gap > 0 else 'above'} the Q/DQ program's (threshold "
        f"{_e(artifact.get('threshold_db', 1.0))} dB): the per-layer analysis below describes the "
        "program, not what ships.</div>"
    )


def _mixed_precision_section(mixed: Mapping[str, Any]) -> str:
    """The per-layer presets the run applied, and the accuracy-size curve the search measured."""
    overrides = mixed.get("overrides") or {}
    layers = mixed.get("layers")
    default = mixed.get("default", "?")
    out = ['<h2>Mixed precision</h2><div class="panel" id="mixed-precision">']
    counted = f"{len(overrides)} of {layers}" if isinstance(layers, int) else str(len(overrides))
    out.append(
        f"<p>{_e(counted)} layer(s) raised from <code>{_e(default)}</code> "
        f"<span class='muted'>({_e(mixed_precision_source(mixed))})</span>; the other layers "
        f"and every other op follow <code>{_e(default)}</code>. The choice is "
        "<code>mixed_precision.json</code> in this folder: edit it and pass it back with "
        "<code>--mixed-precision-file</code>.</p>"
    )
    png = tradeoff_plot_png(mixed)
    if png:
        count = len(mixed.get("curve") or [])
        out.append(
            _png("tradeoff-plot", f"Output SQNR against weight size for the {count} measured points", png)
        )
        out.append(
            "<p class='muted'>Each point is a per-layer choice the search quantized and measured "
            "(model output SQNR on the search batches, against the conv/linear weight bytes); "
            "the red point is the one applied.</p>"
        )
    elif mixed.get("curve"):
        out.append(
            '<p class="muted" id="tradeoff-plot-missing">Plot unavailable: matplotlib is not installed.</p>'
        )
    curve = [p for p in mixed.get("curve") or [] if isinstance(p, Mapping)]
    if curve:
        chosen = mixed.get("chosen")
        rows = [
            [
                (str(i) + (" (chosen)" if i == chosen else ""), "num"),
                (_size(p.get("weight_bytes")), "num"),
                (_db_chip(p.get("sqnr_db")), ""),
                (_e(", ".join(f"{m}: {v}" for m, v in (p.get("overrides") or {}).items()) or "none"), "mono"),
            ]
            for i, p in enumerate(curve)
        ]
        out.append(
            f"<details><summary>Measured points ({len(curve)})</summary>"
            + _table(
                "tradeoff-points",
                [("point", "num"), ("weights", "num"), ("SQNR", ""), ("layers raised", "")],
                rows,
            )
            + "</details>"
        )
    if overrides:
        out.append(
            _table(
                "mixed-overrides",
                [("layer", ""), ("preset", "")],
                [[(_e(m), "mono"), (_e(v), "mono")] for m, v in overrides.items()],
            )
        )
    out.append("</div>")
    return "".join(out)


def _png(ident: str, alt: str, png: bytes) -> str:
    """A plot embedded in the page (the report is one self-contained file)."""
    b64 = base64.b64encode(png).decode("ascii")
    return f'<img id="{ident}" alt="{_e(alt)}" src="data:image/png;base64,{b64}">'


def _size(value: Any) -> str:
    return human_bytes(int(value)) if isinstance(value, (int, float)) else "–"


def mixed_precision_source(mixed: Mapping[str, Any]) -> str:
    """'searched for an SQNR floor of 30 dB' / 'applied from FILE': how the choice was made."""
    source = str(mixed.get("source", ""))
    if source != "search":
        return f"applied from {source}"
    target = mixed.get("target") or {}
    if isinstance(target.get("sqnr_db"), (int, float)):
        return f"searched for an output SQNR of at least {target['sqnr_db']:g} dB"
    if isinstance(target.get("weight_growth"), (int, float)):
        return f"searched within +{100 * target['weight_growth']:g} % weight bytes"
    if isinstance(target.get("weight_bytes"), (int, float)):
        return f"searched within {human_bytes(int(target['weight_bytes']))} of weights"
    return "searched"


def render_html(data: Mapping[str, Any], *, plot_png: bytes | None = None) -> str:
    """The report page. The plot is drawn from ``data["layers"]`` unless ``plot_png`` is given."""
    s = data.get("summary", {})
    backend = data.get("backend", {})
    model = data.get("model", {})
    calibration = data.get("calibration", {})
    layers = data.get("layers", [])
    if plot_png is None:
        plot_png = sqnr_plot_png(layers, output_sqnr_db=s.get("output_sqnr_db"), highlight=HIGHLIGHT)

    title = f"quantplug report · {backend.get('name', '?')} · {model.get('name') or model.get('source', '')}"
    parts: list[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>",
        "<header><h1>Quantization report</h1>",
        f"<p>{_e(model.get('source', ''))} · backend <b>{_e(backend.get('name'))}</b>"
        + (
            f" ({_e(backend.get('distribution'))} {_e(backend.get('version'))})"
            if backend.get("distribution")
            else ""
        )
        + f" · {_e(data.get('created', ''))}</p></header>",
    ]

    # -- summary cards ---------------------------------------------------------------------------
    ratio = s.get("size_ratio")
    cards = [
        _card(
            "model output SQNR",
            _db_chip(s.get("output_sqnr_db"), bool(s.get("output_identical"))),
            f"max |error| {_num(s.get('output_max_abs_error'))} "
            f"over {s.get('compare_batches', '?')} batch(es)",
            raw=True,
            ident="card-sqnr",
        ),
        *_artifact_card(data.get("artifact")),
        _card(
            "nodes",
            f"{s.get('nodes_quantized', 0)} quantized · {s.get('nodes_float', 0)} float",
            f"{s.get('nodes_removed', 0)} folded/removed · {s.get('sharing_groups', 0)} sharing groups",
            ident="card-nodes",
        ),
        _card(
            "size (parameters + buffers)",
            f"{human_bytes(s.get('float_bytes'))} → {human_bytes(s.get('quantized_bytes'))}",
            f"{ratio:.2f}× smaller" if isinstance(ratio, (int, float)) else "",
            ident="card-size",
        ),
        _card(
            "calibration",
            f"{calibration.get('batches', '?')} batch(es)",
            ("RANDOM data · " if calibration.get("random") else "") + str(calibration.get("source", "")),
            ident="card-calibration",
        ),
    ]
    parts.append('<section class="cards">' + "".join(cards) + "</section>")

    # -- backend and options ---------------------------------------------------------------------
    opts = data.get("options", {})
    opt_items = "".join(f"<li><code>{_e(k)}={_e(v)}</code></li>" for k, v in opts.items()) or "<li>none</li>"
    parts.append(
        '<h2>Backend</h2><div class="panel" id="backend">'
        f"<b>{_e(backend.get('name'))}</b> <span class='muted'>{_e(backend.get('description', ''))}</span>"
        f'<ul class="opts" id="options">{opt_items}</ul></div>'
    )

    mixed = data.get("mixed_precision")
    if isinstance(mixed, Mapping):
        parts.append(_mixed_precision_section(mixed))

    # -- warnings --------------------------------------------------------------------------------
    validation = data.get("validation") or {}
    violations = validation.get("violations", []) if isinstance(validation, Mapping) else []
    run_warnings = data.get("warnings", [])
    parts.append('<h2>Validation and warnings</h2><div id="warnings">')
    if not violations and not run_warnings and not (data.get("artifact") or {}).get("flagged"):
        checked = validation.get("checked_nodes") if isinstance(validation, Mapping) else None
        if checked:
            text = f"{checked} node(s) checked against the backend's constraints: no violations."
        elif checked == 0:
            text = "The backend declares no op constraints for this graph; no warnings."
        else:
            text = "No warnings."
        parts.append(f'<div class="ok">{_e(text)}</div>')
    for w in run_warnings:
        parts.append(f'<div class="warn">{_e(w)}</div>')
    gap_warning = _artifact_warning(data.get("artifact"))
    if gap_warning:
        parts.append(gap_warning)
    for v in violations:
        target = f"{v.get('op')} ({v.get('backend_op')})" if v.get("backend_op") else v.get("op")
        parts.append(
            '<div class="warn error validation-warning">'
            f"<b class='mono'>{_e(v.get('node'))}</b> [{_e(target)}] {_e(v.get('port'))}: "
            f"{_e(v.get('rule'))}: expected {_e(v.get('expected'))}, got {_e(v.get('actual'))}</div>"
        )
    parts.append("</div>")

    # -- plot ------------------------------------------------------------------------------------
    parts.append('<h2>Per-layer SQNR</h2><div class="panel plot">')
    plotted = len(plotted_rows(layers))
    size = group_size(plotted)
    grouped = ""
    if size > 1:
        groups = math.ceil(plotted / size)
        grouped = f" in {groups:,} groups of {size:,} consecutive nodes, each bar a group's lowest SQNR"
    if plot_png:
        alt = f"Per-layer SQNR of {plotted:,} nodes{grouped}, the {HIGHLIGHT} worst highlighted"
        parts.append(_png("sqnr-plot", alt, plot_png))
    else:
        reason = "matplotlib is not installed (pip install matplotlib)" if layers else "no node was compared"
        parts.append(f'<p class="muted" id="sqnr-plot-missing">Plot unavailable: {_e(reason)}.</p>')
    parts.append(
        "<p class='muted'>Each bar compares a node's output in the quantized program with the same "
        "node in the float program on the same inputs (what its consumers see: after its own "
        "quantize/dequantize when its output is quantized). Errors accumulate along the graph."
        + (
            f" With {plotted:,} nodes, a bar per node would not be legible: each bar stands for "
            f"{size:,} consecutive nodes and shows the lowest SQNR among them; the worst nodes are "
            "listed below, every node in report.json."
            if size > 1
            else ""
        )
        + "</p></div>"
    )

    # -- worst nodes -----------------------------------------------------------------------------
    worst = data.get("worst", [])
    parts.append(f"<h2>Worst {len(worst)} nodes</h2>")
    if worst:
        parts.append(_node_table(worst, ident="worst-nodes", rank=True))
    else:
        parts.append('<p class="muted" id="worst-nodes">No node could be compared.</p>')

    # -- float nodes -----------------------------------------------------------------------------
    float_nodes = data.get("float_nodes", [])
    removed = data.get("removed_nodes", [])
    parts.append(f"<h2>Nodes kept in float ({len(float_nodes)})</h2>")
    reason_head = [("node", ""), ("op", ""), ("reason", "")]
    if float_nodes:
        parts.append(_table("float-nodes", reason_head, [_reason_cells(f) for f in float_nodes]))
    else:
        parts.append('<p class="muted" id="float-nodes">Every op is quantized.</p>')
    if removed:
        parts.append(
            f"<details><summary>Folded or removed before annotation ({len(removed)})</summary>"
            + _table("removed-nodes", reason_head, [_reason_cells(f) for f in removed])
            + "</details>"
        )

    # -- all layers, sharing groups, files, timings ----------------------------------------------
    shown = layers[:TABLE_LIMIT]
    parts.append(
        f"<details><summary>All compared nodes ({len(layers):,}, graph order"
        + (f"; the first {len(shown):,} here, all in report.json" if len(shown) < len(layers) else "")
        + ")</summary>"
        + _node_table(shown, ident="all-nodes", rank=False)
        + "</details>"
    )
    groups = data.get("sharing_groups", [])
    if groups:
        head = [
            ("id", "num"),
            ("kind", ""),
            ("grid", ""),
            ("granularity", ""),
            ("encoding", ""),
            ("members", ""),
        ]
        parts.append(
            f"<details><summary>Sharing groups ({len(groups)})</summary>"
            + _table("sharing-groups", head, [_group_cells(g) for g in groups])
            + "</details>"
        )
    files = data.get("files", [])
    if files:
        cells = [
            [
                (_e(f.get("path")), "mono"),
                (_num(f.get("bytes"), "{:,}") + " B" if f.get("bytes") else "–", "num"),
            ]
            for f in files
        ]
        parts.append(
            f"<details><summary>Files written ({len(files)})</summary>"
            + _table("files", [("file", ""), ("size", "num")], cells)
            + "</details>"
        )
    timings = data.get("timings", {})
    timing_text = " · ".join(f"{k} {v:.2f} s" for k, v in timings.items() if isinstance(v, (int, float)))
    parts.append(
        f"<footer>quantplug {_e(data.get('quantplug_version'))} · torch {_e(data.get('torch_version'))}"
        + (f" · {_e(timing_text)}" if timing_text else "")
        + "</footer></main></body></html>"
    )
    return "\n".join(parts)
