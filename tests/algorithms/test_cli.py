"""``quantplug algorithms`` and ``quantize --algorithm``: listings, help and argument errors read
metadata only (no torch, no plugin, no algorithm imported); a run applies the algorithms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.conftest import Result, run_cli
from tests.cli.test_fast_cli import _errors, _heavy, _imported

#: option bounds, checked from metadata: torch-free and no algorithm's
LIGHT_CHECKS = "_quantplug.algorithms.option_checks"


def _no_algorithm_module(modules: set[str]) -> list[str]:
    return sorted(
        m
        for m in modules
        if m.startswith("quantplug.algorithms.") and m not in ("_quantplug.algorithms.registry", LIGHT_CHECKS)
    )


@pytest.mark.parametrize(
    "args", [["algorithms"], ["algorithms", "--json"], ["quantize", "--help"]], ids=" ".join
)
def test_listing_and_help_import_nothing_heavy(args: list[str]) -> None:
    done, modules = _imported(*args)
    assert done.returncode == 0, done.stderr
    assert _heavy(modules) == [] and _no_algorithm_module(modules) == []


def test_listing_describes_each_algorithm_from_metadata() -> None:
    done, _ = _imported("algorithms", "--json")
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    assert {"bias_correction", "cle", "smoothquant"} <= set(rows)
    assert "Nagel" in rows["cle"]["paper"]
    assert [o["name"] for o in rows["smoothquant"]["options"]][:1] == ["alpha"]
    text, _ = _imported("quantize", "--help")
    assert "accuracy algorithms (--algorithm NAME)" in text.stdout and "smoothquant" in text.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-A", "cle_"], "unknown algorithm 'cle_' (did you mean 'cle'?)"),
        (["-A", "cle", "--algorithm-option", "iteratons=3"], "did you mean 'iterations'"),
        (["-A", "cle", "--algorithm-option", "iterations=many"], "must be a int"),
        (
            ["-A", "gptq", "--algorithm-option", "damp=nan"],
            "option 'damp' of algorithm 'gptq' must be a finite",
        ),
        (["-A", "cle", "--algorithm-option", "sigmas=-1"], "option 'sigmas' of algorithm 'cle' must be >= 0"),
        (["-A", "seq_mse", "--algorithm-option", "candidates=100000"], "must be in [1, 1000], got '100000'"),
        (["-A", "cle", "-A", "smoothquant", "--algorithm-option", "alpha=0.5"], "name the algorithm"),
        (["-A", "cle", "--algorithm-option", "smoothquant.alpha=0.5"], "not among --algorithm"),
        (["--algorithm-option", "alpha=0.5"], "without --algorithm"),
        (["--held-out", "h.pt"], "--held-out is what the algorithm guard judges on; give --algorithm"),
        (["-A", "gptq", "--held-out", "h.pt", "--no-algorithm-guard"], "give one or the other"),
        (["-A", "gptq", "--held-out", "nowhere.pt"], "held-out data 'nowhere.pt' not found"),
    ],
)
def test_argument_errors_are_one_line_and_import_nothing_heavy(args: list[str], message: str) -> None:
    done, modules = _imported("quantize", *args)
    assert done.returncode == 2
    (line,) = _errors(done)
    assert message in line
    assert _heavy(modules) == []


def test_quantize_applies_the_algorithms(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_cli(
        "quantize",
        "--out",
        str(out),
        "-A",
        "cle",
        "-A",
        "bias_correction",
        "--algorithm-option",
        "cle.iterations=5",
        "-q",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["options"]["algorithms"] == "cle(iterations=5), bias_correction"
    assert report["options"]["algorithm_guard"].startswith("on: ")  # what the guard did is reported


def test_quantize_can_keep_every_choice_without_the_guard(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_cli("quantize", "--out", str(out), "-A", "gptq", "--no-algorithm-guard", "-q")
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["options"]["algorithm_guard"] == "off (--no-algorithm-guard)"


@pytest.fixture(scope="module")
def gptq_on_held_out(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path, Path]:
    """``quantize -A gptq --held-out FILE`` on the demo, not quiet: the guard's report and the
    progress lines of one run."""
    import torch

    root = tmp_path_factory.mktemp("held_out")
    held_out = root / "held_out.pt"
    g = torch.Generator().manual_seed(11)
    torch.save([torch.randn(1, 3, 32, 32, generator=g) for _ in range(3)], held_out)
    out = root / "out"
    return run_cli("quantize", "--out", str(out), "-A", "gptq", "--held-out", str(held_out)), out, held_out


def test_quantize_judges_on_held_out_batches(
    gptq_on_held_out: tuple[Result, Path, Path], tmp_path: Path
) -> None:
    import torch

    done, out, held_out = gptq_on_held_out
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["options"]["algorithm_guard"].startswith(f"on (judged on held-out data {held_out}): ")
    wrong = tmp_path / "wrong.pt"
    torch.save([torch.randn(1, 3, 16, 16)], wrong)
    done = run_cli("quantize", "--out", str(tmp_path / "out"), "-A", "gptq", "--held-out", str(wrong), "-q")
    assert done.returncode == 2
    (line,) = _errors(done)
    assert "held-out batch 0 (wrong.pt): input 'x' has shape (1, 3, 16, 16)" in line


def test_quantize_shows_the_algorithms_progress_layer_by_layer(
    gptq_on_held_out: tuple[Result, Path, Path],
) -> None:
    """convert with algorithms runs layer after layer (minutes on an LLM): the command line counts
    the layers chosen, as it counts calibration batches."""
    done, _, _ = gptq_on_held_out
    assert done.returncode == 0, done.stderr
    counted = [line for line in done.stderr.splitlines() if line.startswith("weights chosen: ")]
    assert len(counted) == 1 and int(counted[0].split()[2]) > 0, done.stderr
