"""Rendering quantization reports: report.json (the data), report.html (self-contained page with
the per-layer SQNR plot) and a text summary, all from one dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _quantplug.files import write_atomic
from _quantplug.report.data import SCHEMA, ReportError, build_report, load_report, write_json
from _quantplug.report.html import render_html
from _quantplug.report.plot import sqnr_plot_png
from _quantplug.report.text import format_summary


def write_report(data: dict[str, Any], directory: str | Path) -> tuple[Path, Path]:
    """Write report.json and report.html into ``directory``; returns both paths.

    The page is rendered first, then each file replaces its predecessor in one rename from a
    temporary file created exclusively under a unique name (never a fixed name, never through
    a symbolic link: others may write into ``directory``).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out / "report.json", out / "report.html"
    page = render_html(data)
    write_json(data, json_path)
    write_atomic(html_path, page)
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
