"""Rendering quantization reports: report.json (the data), report.html (self-contained page with
the per-layer SQNR plot) and a text summary, all from one dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantplug.report.data import SCHEMA, ReportError, build_report, load_report, write_json
from quantplug.report.html import render_html
from quantplug.report.plot import sqnr_plot_png
from quantplug.report.text import format_summary


def write_report(data: dict[str, Any], directory: str | Path) -> tuple[Path, Path]:
    """Write report.json and report.html into ``directory``; returns both paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out / "report.json", out / "report.html"
    # render first, then write each file under a temporary name and rename: no half-written report
    page = render_html(data)
    tmp_json, tmp_html = out / ".report.json.tmp", out / ".report.html.tmp"
    try:
        write_json(data, tmp_json)
        tmp_html.write_text(page, encoding="utf-8")
        tmp_json.replace(json_path)
        tmp_html.replace(html_path)
    finally:
        tmp_json.unlink(missing_ok=True)
        tmp_html.unlink(missing_ok=True)
    return json_path, html_path


__all__ = [
    "SCHEMA",
    "ReportError",
    "build_report",
    "format_summary",
    "load_report",
    "render_html",
    "sqnr_plot_png",
    "write_json",
    "write_report",
]
