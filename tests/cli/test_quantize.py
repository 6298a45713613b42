"""`quantplug quantize` end to end, as a subprocess on fresh output folders."""

from __future__ import annotations

import json
import math
import os
import pty
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.cli.conftest import CLI, REPO, RunCache, backend_run, clean_env, run_cli

EXPECTED_FILES = {"quantized.pt2", "report.html", "report.json", "artifact"}


def _report(out: Path) -> dict[str, Any]:
    return json.loads((out / "report.json").read_text())


def _check_report(data: dict[str, Any], *, backend: str) -> None:
    assert data["schema"] == "quantplug-report/1"
    assert data["backend"]["name"] == backend
    s = data["summary"]
    assert s["nodes_quantized"] > 0
    assert s["nodes_total"] == s["nodes_quantized"] + s["nodes_float"]
    assert s["float_bytes"] > 0 and s["quantized_bytes"] > 0
    assert s["output_sqnr_db"] is not None and s["output_sqnr_db"] > 15
    layers = data["layers"]
    assert layers and all({"node", "op", "sqnr_db", "max_abs_error", "quantized"} <= set(r) for r in layers)
    worst = [r["sqnr_db"] for r in data["worst"]]
    assert worst == sorted(worst) and len(worst) <= 20
    assert len(data["worst"]) == min(20, sum(r["sqnr_db"] is not None for r in layers))
    assert data["sharing_groups"]
    for f in data["float_nodes"]:
        assert f["reason"]


def test_no_arguments_quantizes_the_demo(tmp_path: Path) -> None:
    """README Quick start 1: `quantplug` with nothing at all, into ./quantplug-out."""
    done = subprocess.run(CLI, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "quantplug-out"
    assert EXPECTED_FILES <= {p.name for p in out.iterdir()}
    assert (out / "artifact" / "artifact.json").exists()
    assert "SQNR" in done.stdout and "quantized" in done.stdout
    assert "warning" not in done.stderr  # the demo brings its own data
    data = _report(out)
    _check_report(data, backend="reference")
    assert data["model"]["kind"] == "demo"
    assert data["calibration"] == {
        "source": "built-in synthetic data",
        "batches": 16,
        "random": False,
        "nonfinite": "error",
    }
    assert data["options"]["preset"] == "int8"
    # batch norms were folded: the conv is compared with the batch norm's float output
    conv = next(r for r in data["layers"] if r["node"] == "conv2d")
    assert conv["float_node"] == "batch_norm" and conv["sqnr_db"] > 25
    assert {r["node"] for r in data["removed_nodes"]} == {"batch_norm", "batch_norm_1"}
    # no staging folder left behind
    assert [p.name for p in tmp_path.iterdir()] == ["quantplug-out"]


def test_calibration_folder_and_options(demo_files: dict[str, Path], runs: RunCache) -> None:
    result, out = runs.get(
        "folder",
        str(demo_files["pt2"]),
        "--calibration",
        str(demo_files["folder"]),
        "--option",
        "activation_dtype=int8",
        "--option",
        "activation_observer=minmax",
    )
    assert result.returncode == 0, result.stderr
    data = _report(out)
    _check_report(data, backend="reference")
    assert data["model"]["kind"] == "pt2"
    assert data["calibration"] == {
        "source": str(demo_files["folder"]),
        "batches": 3,
        "random": False,
        "nonfinite": "error",
    }
    assert "warning" not in result.stderr
    assert data["options"]["activation_dtype"] == "int8"
    assert data["options"]["activation_observer"] == "minmax"
    activations = [g for g in data["sharing_groups"] if g["kind"] == "activation"]
    assert activations and all(g["dtype"] == "int8" for g in activations)


def test_factory_without_calibration_warns_about_random_data(runs: RunCache) -> None:
    result, out = runs.get("factory", "tests.cli._models:two_inputs", "--random-batches", "3")
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "RANDOM" in warning[0] and "--calibration" in warning[0]
    data = _report(out)
    assert data["calibration"]["random"] is True and data["calibration"]["batches"] == 3
    assert any("RANDOM" in w for w in data["warnings"])
    assert "RANDOM" in (out / "report.html").read_text()
    assert data["model"]["kind"] == "factory"
    assert [i["name"] for i in data["model"]["inputs"]] == ["x", "y"]
    assert {r["op"] for r in data["layers"]} >= {"aten.linear.default", "aten.add.Tensor"}


def test_keyword_inputs(demo_files: dict[str, Path], runs: RunCache) -> None:
    """A factory whose example is a dict, calibrated on a list of dicts (keyword inputs)."""
    import torch

    from tests.cli._models import keyword_batches

    result, out = runs.get("keywords", "tests.cli._models:keyword_inputs", "-c", str(demo_files["keywords"]))
    assert result.returncode == 0, result.stderr
    data = _report(out)
    _check_report(data, backend="reference")
    assert [i["name"] for i in data["model"]["inputs"]] == ["x", "mask"]
    assert data["calibration"]["batches"] == 5
    program = torch.export.load(str(out / "quantized.pt2"))
    batch = keyword_batches(1, seed=9)[0]
    assert program.module()(**batch).shape == (2, 3)


def _installed_backends() -> list[str]:
    from quantplug import list_backends

    return [e.name for e in list_backends() if e.status in ("available", "loaded")]


@pytest.mark.parametrize("backend", ["reference", "example_vendor", "qnn_htp"])
def test_every_backend(backend: str, demo_files: dict[str, Path], runs: RunCache) -> None:
    if backend not in _installed_backends():
        pytest.skip(f"backend {backend} is not installed")
    result, out = backend_run(runs, demo_files, backend)
    assert result.returncode == 0, result.stderr
    data = _report(out)
    _check_report(data, backend=backend)
    assert data["calibration"]["batches"] == 6
    if backend == "example_vendor":  # it has no rules for max_pool2d and mean: they stay float
        reasons = {f["node"]: f["reason"] for f in data["float_nodes"]}
        assert set(reasons) == {"max_pool2d", "mean"}
        assert all("no rule" in r for r in reasons.values())
        assert data["summary"]["nodes_float"] == 2
    if (out / "artifact").exists():
        assert data["files"] and any(f["path"].startswith("artifact/") for f in data["files"])
    else:  # a backend without an artifact writer: said so, the rest is still written
        assert any("artifact writer" in w for w in data["warnings"])


def test_existing_out_keeps_unrelated_files(demo_files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "artifact").mkdir(parents=True)
    (out / "artifact" / "stale.bin").write_text("old")
    (out / "notes.txt").write_text("mine")
    result = run_cli(
        "quantize", str(demo_files["pt2"]), "-c", str(demo_files["list"]), "--out", str(out), "-q"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""  # --quiet: no progress, no summary
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "artifact" / "stale.bin").exists()  # artifact/ is replaced as a whole
    assert EXPECTED_FILES <= {p.name for p in out.iterdir()}


def test_quantized_program_loads_and_runs(demo_files: dict[str, Path], runs: RunCache) -> None:
    import torch

    result, out = backend_run(runs, demo_files, "reference")
    assert result.returncode == 0, result.stderr
    program = torch.export.load(str(out / "quantized.pt2"))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert any("quantize_per_tensor" in t for t in targets)
    # notes on quantplug's own passes are not written; the model's module paths are
    assert not [n.name for n in program.graph.nodes if {"from_node", "torch_fn"} & set(n.meta)]
    assert any(n.meta.get("nn_module_stack") for n in program.graph.nodes)
    y = program.module()(torch.randn(1, 3, 32, 32))
    assert y.shape == (1, 10)


def test_plain_progress_lines_when_not_a_terminal(demo_files: dict[str, Path], runs: RunCache) -> None:
    result, _ = backend_run(runs, demo_files, "reference")
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    lines = result.stderr.splitlines()
    assert "calibrating: 6 batches" in lines
    assert any(line.startswith("calibrated: 6 batches in ") and "batch/s" in line for line in lines)
    assert any(line.startswith("lowered: ") and "step" in line for line in lines)


def test_progress_bar_on_a_terminal(demo_files: dict[str, Path], tmp_path: Path) -> None:
    """stderr attached to a pseudo-terminal: a bar redrawn in place, with counts and rates."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [
            *CLI,
            "quantize",
            str(demo_files["pt2"]),
            "-c",
            str(demo_files["list"]),
            "--out",
            str(tmp_path / "o"),
        ],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=secondary,
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    stdout = proc.stdout.read().decode() if proc.stdout else ""
    assert proc.wait(timeout=300) == 0
    os.close(primary)
    screen = b"".join(chunks).decode(errors="replace")
    assert "\rcalibrating" in screen and "6/6 batches" in screen and "batch/s" in screen
    assert "\rlowering" in screen and "step/s" in screen
    assert "█" in screen
    assert "SQNR" in stdout  # the summary stays on stdout


def test_report_command_rerenders_html(demo_files: dict[str, Path], runs: RunCache, tmp_path: Path) -> None:
    result, first = backend_run(runs, demo_files, "reference")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "copy"
    shutil.copytree(first, out)
    before = (out / "report.html").read_text()
    (out / "report.html").unlink()
    result = run_cli("report", str(out))
    assert result.returncode == 0, result.stderr
    after = (out / "report.html").read_text()
    assert after == before  # everything in the page comes from report.json
    assert "SQNR" in result.stdout and "reference" in result.stdout
    assert str(out / "report.html") in result.stdout
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_report_json_is_strict_json(demo_files: dict[str, Path], runs: RunCache) -> None:
    result, out = backend_run(runs, demo_files, "reference")
    assert result.returncode == 0, result.stderr
    text = (out / "report.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text)
    for row in data["layers"]:
        assert row["sqnr_db"] is None or math.isfinite(row["sqnr_db"])


def test_help_lists_every_backends_options() -> None:
    result = run_cli("quantize", "--help")
    assert result.returncode == 0
    text = result.stdout
    assert "backend options" in text
    assert "preset=str (default int8)" in text  # reference, with its default
    assert "one of int8, int8_per_tensor" in text  # and its choices
    for name in _installed_backends():
        assert f"  {name} (" in text
    assert "strict=bool (default true)" in text
