"""NaN/inf calibration data on the command line (issue 12.1): the run stops at the first batch
holding them, naming the file, the batch, the input and the node, and writes nothing; with
``--nonfinite ignore`` it completes, counts them in the report and writes strict JSON only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cli.conftest import run_cli


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from _quantplug.demo.model import demo_calibration

    folder = tmp_path_factory.mktemp("poisoned")
    batches = [b[0] for b in demo_calibration(4)]
    batches[2] = batches[2].clone()
    batches[2][0, 1, 5, 7] = float("nan")
    batches[2][0, 0, 0, 0] = float("inf")
    torch.save(batches, folder / "calib.pt")
    return folder / "calib.pt"


@pytest.mark.parametrize("backend", ["reference", "qnn_htp"])
def test_a_nan_batch_is_rejected_naming_file_batch_input(
    poisoned: Path, tmp_path: Path, backend: str
) -> None:
    out = tmp_path / "out"
    result = run_cli("quantize", "-c", str(poisoned), "-b", backend, "--out", str(out))
    assert result.returncode == 2, result.stderr
    line = result.stderr_lines[-1]
    expected = (
        "calibration batch 2 (calib.pt[2])",
        "input 'x'",
        "1 NaN and 1 inf",
        "(0, 0, 0, 0)",
        "--nonfinite",
    )
    for words in expected:
        assert words in line, line
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_ignored_values_are_counted_and_files_hold_no_nan(poisoned: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_cli(
        "quantize", "-c", str(poisoned), "-b", "qnn_htp", "--nonfinite", "ignore", "--out", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert "NaN/inf value(s) left out of the calibration statistics" in result.stderr
    report = json.loads((out / "report.json").read_text())
    ignored = report["calibration"]["nonfinite_ignored"]
    assert ignored["input 'x' of node 'conv2d'"] == 2  # where they first appear; then what they became
    assert len(ignored) > 1
    assert report["calibration"]["nonfinite"] == "ignore"
    for path in out.rglob("*"):
        if path.suffix in (".json", ".encodings"):
            json.loads(path.read_text(), parse_constant=_refuse)


def _refuse(token: str) -> None:
    raise AssertionError(f"{token} in a written file")


def test_a_weight_only_preset_refuses_nan_data_or_its_algorithms_leave_it_out(
    poisoned: Path, tmp_path: Path
) -> None:
    """A weight-only preset has no activation observer: the batch is still refused (file, batch,
    input), and under ``--nonfinite ignore`` the algorithm's collector leaves the poisoned sample
    out and says so."""
    common = ("quantize", "-c", str(poisoned), "-b", "reference", "-o", "preset=weight_only_int4")
    common += ("-A", "gptq")
    refused = run_cli(*common, "--out", str(tmp_path / "refused"))
    assert refused.returncode == 2, refused.stderr
    line = refused.stderr_lines[-1]
    expected = ("calibration batch 2 (calib.pt[2])", "input 'x' holds 1 NaN", "--nonfinite")
    for words in expected:
        assert words in line, line
    assert not (tmp_path / "refused").exists()
    done = run_cli(*common, "--nonfinite", "ignore", "--out", str(tmp_path / "done"))
    assert done.returncode == 0, done.stderr
    assert "left out of the statistics of 1 layer(s)" in done.stderr
