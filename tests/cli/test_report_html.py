"""report.html renders in headless Chromium, offline: the plot image and the node table show."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

import quantplug
from tests.cli.conftest import RunCache, backend_run, find_chromium

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,2000",
]


@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        pytest.skip(
            "chromium is not installed (scripts/setup.sh --test installs it: apt-get install chromium)"
        )
    return found


@pytest.fixture(scope="module")
def report_dir(runs: RunCache, demo_files: dict[str, Path]) -> Path:
    """A report with quantized and float nodes (example_vendor keeps pool and mean float)."""
    installed = {e.name for e in quantplug.list_backends()}
    result, out = backend_run(
        runs, demo_files, "example_vendor" if "example_vendor" in installed else "reference"
    )
    assert result.returncode == 0, result.stderr
    return out


def _chromium(chromium: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'profile'}", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def _png_pixels(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, raw scanlines) of an 8-bit RGB/RGBA PNG, decoded with zlib only."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    height = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, zlib.decompress(idat)


def test_static_html_is_self_contained(report_dir: Path) -> None:
    page = (report_dir / "report.html").read_text()
    assert "<style>" in page
    assert re.search(r'<img id="sqnr-plot"[^>]*src="data:image/png;base64,', page)
    # nothing fetched from anywhere: no external scripts, stylesheets, images or fonts
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "<script" not in page
    data = json.loads((report_dir / "report.json").read_text())
    assert page.count('class="node-row"') >= len(data["worst"])


def test_screenshot_is_not_blank(chromium: str, report_dir: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    done = _chromium(chromium, tmp_path, f"--screenshot={shot}", (report_dir / "report.html").as_uri())
    assert shot.exists() and shot.stat().st_size > 10_000, done.stderr[-2000:]
    width, height, raw = _png_pixels(shot.read_bytes())
    assert (width, height) == (1280, 2000)
    # many distinct byte values: text, colours and the plot, not one flat background
    sample = raw[: len(raw) // 2]
    assert len(set(sample)) > 50
    (report_dir / "screenshot.png").write_bytes(shot.read_bytes())  # kept for a human to look at


def test_dom_shows_plot_and_worst_table(chromium: str, report_dir: Path, tmp_path: Path) -> None:
    done = _chromium(chromium, tmp_path, "--dump-dom", (report_dir / "report.html").as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    data = json.loads((report_dir / "report.json").read_text())
    assert re.search(r'<img id="sqnr-plot"[^>]*src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}"', dom)
    table = dom[dom.index('id="worst-nodes"') :]
    table = table[: table.index("</table>")]
    rows = re.findall(r'<tr class="node-row">(.*?)</tr>', table, re.S)
    assert len(rows) == len(data["worst"]) > 0
    assert data["worst"][0]["node"] in rows[0]
    assert f"{data['backend']['name']}" in dom
    assert 'id="card-sqnr"' in dom and 'id="card-size"' in dom and 'id="warnings"' in dom
    for f in data["float_nodes"]:
        assert f["node"] in dom
