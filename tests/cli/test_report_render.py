"""Rendering the report from its dict, in-process: escaping, missing plot, the text summary."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from _quantplug.report import (
    SCHEMA,
    ReportError,
    format_summary,
    load_report,
    render_html,
    sqnr_plot_png,
    write_report,
)


def _data(**changes: object) -> dict:
    layers = [
        {
            "node": f"n{i}",
            "op": "aten.linear.default",
            "quantized": i % 4 != 3,
            "sqnr_db": 20.0 + 3 * i,
            "identical": False,
            "max_abs_error": 0.1 / (i + 1),
            "shape": [2, 8],
            "note": "",
        }
        for i in range(8)
    ]
    layers.append(
        {
            "node": "<script>alert(1)</script>",
            "op": "aten.relu.default",
            "quantized": False,
            "sqnr_db": None,
            "identical": True,
            "max_abs_error": 0.0,
            "shape": [2, 8],
            "note": "a & b",
        }
    )
    data = {
        "schema": SCHEMA,
        "created": "2024-01-01T00:00:00+00:00",
        "quantplug_version": "0.1.0",
        "torch_version": "2.13.0",
        "model": {"source": "m.pt2", "kind": "pt2", "name": "m", "inputs": []},
        "backend": {
            "name": "reference",
            "distribution": "quantplug-reference",
            "version": "0.1.0",
            "description": "d",
        },
        "options": {"preset": "int8"},
        "calibration": {"source": "c.pt", "batches": 4, "random": False},
        "summary": {
            "nodes_quantized": 6,
            "nodes_float": 3,
            "nodes_removed": 0,
            "nodes_total": 9,
            "compare_batches": 2,
            "output_sqnr_db": 31.5,
            "output_identical": False,
            "output_max_abs_error": 0.01,
            "float_bytes": 4096,
            "quantized_bytes": 1024,
            "size_ratio": 4.0,
            "sharing_groups": 1,
        },
        "layers": layers,
        "worst": sorted((r for r in layers if r["sqnr_db"] is not None), key=lambda r: r["sqnr_db"]),
        "float_nodes": [{"node": "n3", "op": "aten.linear.default", "reason": "no rule <here>"}],
        "removed_nodes": [],
        "sharing_groups": [
            {
                "id": 0,
                "members": ["x"],
                "kind": "activation",
                "dtype": "uint8",
                "granularity": "tensor",
                "scale": 0.01,
                "zero_point": 128,
                "quant_min": 0,
                "quant_max": 255,
                "channels": None,
            }
        ],
        "validation": {
            "checked_nodes": 5,
            "unconstrained_ops": [],
            "violations": [
                {
                    "node": "n1",
                    "op": "aten.linear.default",
                    "backend_op": "FullyConnected",
                    "port": "output",
                    "expected": "uint8",
                    "actual": "int16",
                    "rule": "dtype",
                }
            ],
        },
        "warnings": ["something to know"],
        "files": [{"path": "quantized.pt2", "bytes": 1234}],
        "timings": {"total": 1.5},
    }
    data.update(changes)
    return data


def test_page_escapes_and_shows_everything() -> None:
    page = render_html(_data(), plot_png=b"\x89PNG fake")
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "no rule &lt;here&gt;" in page
    assert 'src="data:image/png;base64,' + base64.b64encode(b"\x89PNG fake").decode() in page
    assert page.count('class="node-row"') == 8 + 9  # worst table + all nodes
    assert "validation-warning" in page and "FullyConnected" in page and "something to know" in page
    assert "4.0 KiB → 1.0 KiB" in page and "4.00× smaller" in page
    assert "31.5 dB" in page and "identical" in page


def test_page_without_matplotlib_says_why() -> None:
    page = render_html(_data(layers=[]), plot_png=b"")
    assert 'id="sqnr-plot-missing"' in page and "<img" not in page


def test_plot_is_a_png() -> None:
    pytest.importorskip("matplotlib")
    png = sqnr_plot_png(_data()["layers"], output_sqnr_db=31.5)
    assert png is not None and png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert sqnr_plot_png([]) is None


@pytest.mark.parametrize("output_sqnr_db", [2794613.0, -1e9])
def test_plot_of_an_output_far_off_the_layers_scale_keeps_its_size(output_sqnr_db: float) -> None:
    """A hand-edited report (output SQNR 2.8 million dB) once made a figure too tall to rasterize."""
    pytest.importorskip("matplotlib")
    png = sqnr_plot_png(_data()["layers"], output_sqnr_db=output_sqnr_db)
    assert png is not None
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1200, 460)


def test_text_summary() -> None:
    text = format_summary(_data(), out_dir="out")
    assert "reference (quantplug-reference 0.1.0)" in text
    assert "6 quantized, 3 float" in text and "float n3" in text
    assert "31.5 dB" in text and "worst nodes: n0 20.0 dB" in text
    assert "4.0 KiB float -> 1.0 KiB quantized (4.00x smaller)" in text
    assert "1 constraint violation(s)" in text
    assert "written:     out/  quantized.pt2" in text


def test_write_and_load(tmp_path: Path) -> None:
    data = _data()
    data["summary"]["output_sqnr_db"] = float("inf")  # written as null: strict JSON
    json_path, html_path = write_report(data, tmp_path)
    assert json.loads(json_path.read_text())["summary"]["output_sqnr_db"] is None
    assert html_path.read_text().startswith("<!DOCTYPE html>")
    assert load_report(tmp_path)["backend"]["name"] == "reference"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "report.json"]
    (tmp_path / "report.json").write_text('{"schema": "other"}')
    with pytest.raises(ReportError, match="not a quantplug report"):
        load_report(tmp_path)
    (tmp_path / "report.json").write_text("{broken")
    with pytest.raises(ReportError, match="cannot read"):
        load_report(tmp_path)
