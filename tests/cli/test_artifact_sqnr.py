"""What ships is measured: ``compare(..., artifact=...)``, ``quantplug quantize`` and the report give
the backend artifact's output SQNR against float beside the Q/DQ program's, and flag a gap over
1 dB. Any artifact with a ``run`` method works; the core knows no runtime."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import quantplug
from _quantplug.demo.model import demo_calibration, demo_model
from _quantplug.report import build_report, format_summary, render_html
from quantplug.debug import ARTIFACT_GAP_DB, compare
from tests.cli.conftest import RunCache, backend_run


@pytest.fixture(scope="module")
def demo() -> dict[str, Any]:
    model, example = demo_model()
    program = torch.export.export(model, example)
    batches = demo_calibration(8)
    quantizer = quantplug.get_quantizer("reference")
    prepared = quantplug.prepare(program, quantizer)
    with torch.no_grad():
        for b in batches:
            prepared(*b)
    quantized = quantplug.convert(prepared)
    return {
        "model": model,
        "program": program,
        "batches": batches,
        "quantized": quantized,
        "quantizer": quantizer,
    }


class Runs:
    """An artifact of some third-party backend: ``run`` is all the core needs."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.calls = 0

    def run(self, *inputs: torch.Tensor) -> Any:
        self.calls += 1
        return self.fn(*inputs)


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return 10 * math.log10(float(ref.double().pow(2).sum() / (out.double() - ref.double()).pow(2).sum()))


def test_reference_artifact_is_measured_beside_the_program(demo: dict[str, Any]) -> None:
    artifact = quantplug.lower(demo["quantized"], demo["quantizer"])
    batches = demo["batches"][:3]
    report = compare(demo["program"], demo["quantized"], batches, artifact=artifact)
    shipped = report.artifact
    assert shipped.ran and shipped.batches == 3 and not shipped.flagged
    with torch.no_grad():
        ref = torch.cat([demo["model"](*b) for b in batches])
    out = torch.cat([artifact.run(*b) for b in batches])
    assert shipped.sqnr_db == pytest.approx(_sqnr(ref, out), abs=1e-6)
    assert shipped.program_sqnr_db == report.output_sqnr_db
    assert abs(shipped.gap_db) < ARTIFACT_GAP_DB
    assert shipped.vs_program_sqnr_db > 40  # within a step of the program
    d = report.to_dict()["artifact"]
    assert d["ran"] and d["sqnr_db"] == pytest.approx(shipped.sqnr_db) and d["flagged"] is False
    assert "backend artifact output SQNR" in report.format()


@pytest.mark.parametrize(("noise", "direction"), [(0.2, "below"), (None, "above")])
def test_a_gap_over_one_db_is_flagged(demo: dict[str, Any], noise: float | None, direction: str) -> None:
    """An artifact far worse than the program (a saturating kernel...) or far better (it is not
    the program at all: here the float model) is flagged, in compare, report.json, text and HTML."""
    quantized, model = demo["quantized"], demo["model"]
    gen = torch.Generator().manual_seed(0)
    if noise is None:
        artifact = Runs(lambda x: model(x).detach())
    else:
        artifact = Runs(lambda x: quantized(x) + noise * torch.randn(quantized(x).shape, generator=gen))
    report = compare(demo["program"], quantized, demo["batches"][:2], artifact=artifact)
    assert artifact.calls == 2
    shipped = report.artifact
    assert shipped.ran and shipped.flagged and abs(shipped.gap_db) > ARTIFACT_GAP_DB
    assert (shipped.gap_db > 0) == (direction == "below")
    assert "GAP > 1 dB" in shipped.describe() and direction in shipped.describe()
    data = _report_data(report)
    assert data["summary"]["artifact_flagged"] is True
    assert data["summary"]["artifact_gap_db"] == pytest.approx(shipped.gap_db)
    text = format_summary(data)
    line = next(x for x in text.splitlines() if x.startswith("artifact:"))
    assert "GAP > 1 dB" in line and direction in line
    page = render_html(data, plot_png=b"")
    assert 'id="card-artifact"' in page and 'id="artifact-gap"' in page
    json.dumps(data, allow_nan=False)


def test_an_artifact_that_cannot_run_is_reported_not_measured(demo: dict[str, Any]) -> None:
    class FilesOnly:
        backend = "files_only"

    def broken(*inputs: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no device attached\nmore detail")

    batches = demo["batches"][:2]
    plain = compare(demo["program"], demo["quantized"], batches)
    cases = ((FilesOnly(), "no run() method"), (Runs(broken), "failed on batch 0: RuntimeError"))
    for artifact, note in cases:
        report = compare(demo["program"], demo["quantized"], batches, artifact=artifact)
        assert not report.artifact.ran and note in report.artifact.note
        assert report.artifact.gap_db is None and not report.artifact.flagged
        assert report.output_sqnr_db == plain.output_sqnr_db  # the program's analysis is unaffected
        line = next(x for x in format_summary(_report_data(report)).splitlines() if x.startswith("artifact:"))
        assert "not measured" in line and note in line
    wrong = Runs(lambda x: (x, x))
    report = compare(demo["program"], demo["quantized"], batches, artifact=wrong)
    assert not report.artifact.ran and "2 output(s)" in report.artifact.note


def test_without_an_artifact_the_report_is_unchanged(demo: dict[str, Any]) -> None:
    report = compare(demo["program"], demo["quantized"], demo["batches"][:1])
    assert report.artifact is None
    data = _report_data(report)
    assert data["artifact"] is None and "artifact_sqnr_db" not in data["summary"]
    assert not any(x.startswith("artifact:") for x in format_summary(data).splitlines())
    assert 'id="card-artifact"' not in render_html(data, plot_png=b"")


def test_quantize_command_reports_the_artifact(demo_files: dict[str, Path], runs: RunCache) -> None:
    result, out = backend_run(runs, demo_files, "reference")
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "report.json").read_text())
    shipped = data["artifact"]
    assert shipped["ran"] and shipped["batches"] >= 1 and shipped["flagged"] is False
    assert shipped["sqnr_db"] == pytest.approx(data["summary"]["output_sqnr_db"], abs=ARTIFACT_GAP_DB)
    assert data["summary"]["artifact_sqnr_db"] == shipped["sqnr_db"]
    line = next(x for x in result.stdout.splitlines() if x.startswith("artifact:"))
    assert "dB (backend artifact vs float)" in line
    assert 'id="card-artifact"' in (out / "report.html").read_text()


def _report_data(report: Any) -> dict[str, Any]:
    return build_report(
        report,
        backend={"name": "test"},
        options={},
        model={"source": "demo"},
        calibration={"source": "demo", "batches": 1},
    )
