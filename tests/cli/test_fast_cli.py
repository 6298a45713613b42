"""The command line answers without importing torch or any plugin (issue 12.7 and 12.6's
``quantize --help``): help, ``backends`` and every argument error are read from package metadata.
Checked with ``python -X importtime`` (which modules were imported), never with wall time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.conftest import REPO, clean_env

PLUGIN_PACKAGES = ("quantplug_reference", "quantplug_qnn_htp", "quantplug_example_vendor")


def _imported(
    *args: str, code: str | None = None, cwd: Path = REPO
) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    command = [sys.executable, "-X", "importtime"]
    command += ["-c", code] if code is not None else ["-m", "quantplug", *args]
    done = subprocess.run(command, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300)
    modules = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    return done, modules


def _heavy(modules: set[str]) -> list[str]:
    return sorted(
        m
        for m in modules
        if m == "torch" or m.startswith(("torch.", "numpy")) or m.startswith(PLUGIN_PACKAGES)
    )


def _errors(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if line and not line.startswith("import time:")]


def test_import_quantplug_and_list_backends_import_no_torch() -> None:
    done, modules = _imported(code="import quantplug; quantplug.list_backends(); quantplug.QuantplugError")
    assert done.returncode == 0, done.stderr
    assert "quantplug" in modules and _heavy(modules) == []


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["backends"],
        ["backends", "--json"],
        ["quantize", "--help"],
        ["report", "--help"],
        ["metadata", "--help"],
    ],
    ids=" ".join,
)
def test_help_and_listing_import_nothing_heavy(args: list[str]) -> None:
    done, modules = _imported(*args)
    assert done.returncode == 0, done.stderr
    assert _heavy(modules) == []


def test_quantize_help_describes_every_backend_from_metadata() -> None:
    done, modules = _imported("quantize", "--help")
    assert _heavy(modules) == []
    text = " ".join(done.stdout.split())
    for piece in (
        "reference (quantplug-reference",
        "onnx_opset=int (default 21)",
        ">= 18 and <= 27",
        "qnn_htp (quantplug-qnn-htp",
        "eps=float (default none)",
        "finite and > 0 and <= 1",
        "only with precision=16a4w_block",
        "example_vendor (quantplug-example-vendor",
        "Loading a model runs code",
        "--allow-pickle",
    ):
        assert piece in text, piece


# argument errors: (arguments, words of the one error line)
ARGUMENT_ERRORS = {
    "misspelt command": (["backend"], ["unknown command 'backend'", "did you mean 'backends'"]),
    "misspelt backend": (
        ["quantize", "-b", "refrence"],
        ["unknown backend 'refrence'", "did you mean 'reference'"],
    ),
    "misspelt option": (["quantize", "-o", "prest=int8"], ["no option(s) 'prest'", "did you mean 'preset'"]),
    "misspelt preset": (["quantize", "-o", "preset=int9"], ["'int9'", "did you mean 'int8'"]),
    "misspelt precision": (
        ["quantize", "-b", "qnn_htp", "-o", "precision=16a8"],
        ["did you mean '16a8w'"],
    ),
    "eps nan": (["-b", "qnn_htp", "-o", "eps=nan"], ["'eps'", "nan", "finite and > 0 and <= 1"]),
    "eps huge": (["-b", "qnn_htp", "-o", "eps=1e30"], ["'eps'", "1e+30", "<= 1"]),
    "opset too high": (["-o", "onnx_opset=999"], ["'onnx_opset'", "999", ">= 18 and <= 27"]),
    "opset too low": (["-o", "onnx_opset=13"], ["'onnx_opset'", "13", ">= 18"]),
    "negative threads": (["-o", "ort_threads=-3"], ["'ort_threads'", "-3", ">= 0"]),
    "mask margin inf": (["-b", "qnn_htp", "-o", "mask_margin=inf"], ["'mask_margin'", "inf", "finite"]),
    "block size huge": (["-b", "qnn_htp", "-o", "block_size=1000000"], ["'block_size'", "<= 65536"]),
    "block map per-channel": (
        ["-b", "qnn_htp", "-o", "block_size_map=linear:16"],
        ["'block_size_map'", "only when precision is 16a4w_block", "precision='8a8w'"],
    ),
    "bad bool": (["-o", "strict=perhaps"], ["'strict'", "bool"]),
    "missing model": (["quantize", "missing-model.pt2"], ["missing-model.pt2", "not found"]),
    "missing calibration": (["-c", "nowhere.pt"], ["nowhere.pt", "not found"]),
    "random batches": (["--random-batches", "0"], ["--random-batches", "at least 1"]),
    "mixed without target": (
        ["-b", "qnn_htp", "--mixed-precision", "16a4w,16a8w"],
        ["--mixed-precision needs exactly one target", "--target-sqnr", "--weight-budget"],
    ),
    "mixed two targets": (
        ["-b", "qnn_htp", "--mixed-precision", "16a4w,16a8w", "--target-sqnr", "3", "--weight-budget", "1M"],
        ["exactly one target"],
    ),
    "target without mixed": (["--target-sqnr", "30"], ["--target-sqnr", "add --mixed-precision"]),
    "mixed misspelt preset": (
        ["-b", "qnn_htp", "--mixed-precision", "16a4w,16a8", "--target-sqnr", "30"],
        ["no preset '16a8'", "did you mean '16a8w'"],
    ),
    "mixed one preset": (
        ["-b", "qnn_htp", "--mixed-precision", "16a4w", "--target-sqnr", "30"],
        ["at least two presets"],
    ),
    "mixed and a preset": (
        ["-b", "qnn_htp", "-o", "precision=8a8w", "--mixed-precision", "16a4w,16a8w", "--target-sqnr", "30"],
        ["leave out --option precision=8a8w"],
    ),
    "mixed under nproc": (
        ["-b", "qnn_htp", "--mixed-precision", "16a4w,16a8w", "--target-sqnr", "30", "--nproc", "2"],
        ["without --nproc", "--mixed-precision-file"],
    ),
    "mixed bad budget": (
        ["-b", "qnn_htp", "--mixed-precision", "16a4w,16a8w", "--weight-budget", "lots"],
        ["--weight-budget 'lots' is not a size", "+25%"],
    ),
    "mixed file missing": (["--mixed-precision-file", "nowhere.json"], ["nowhere.json", "not found"]),
    "mixed search and file": (
        ["--mixed-precision", "16a4w,16a8w", "--target-sqnr", "30", "--mixed-precision-file", "x.json"],
        ["give one of them"],
    ),
}


@pytest.mark.parametrize("case", list(ARGUMENT_ERRORS))
def test_argument_errors_answer_without_torch(case: str, tmp_path: Path) -> None:
    args, words = ARGUMENT_ERRORS[case]
    done, modules = _imported(*args, "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr
    errors = _errors(done)
    assert len(errors) == 1 and errors[0].startswith("quantplug: error: "), errors
    for word in words:
        assert word in errors[0], errors[0]
    assert _heavy(modules) == [], case
    assert list(tmp_path.iterdir()) == []  # nothing written, no lock left


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["no_such_backend"], "unknown backend 'no_such_backend'"),
        (["reference", "--check", "speed"], "unknown conformance check(s) 'speed'"),
    ],
)
def test_conformance_usage_errors_answer_without_torch(args: list[str], words: str) -> None:
    done, modules = _imported("conformance", *args)
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert _heavy(modules) == []


def test_a_misspelt_command_is_not_taken_for_a_model(tmp_path: Path) -> None:
    done, _ = _imported("backend", cwd=tmp_path)
    assert done.returncode == 2
    assert "model file" not in done.stderr and "unknown command 'backend'" in done.stderr
    (tmp_path / "backend").write_text("")  # a file of that name is a model path after all
    done, _ = _imported("backend", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert "unknown command" not in done.stderr and "backend" in done.stderr


def test_shipped_metadata_files_match_the_plugins() -> None:
    from _quantplug.plugins import metadata
    from _quantplug.plugins.registry import load_backend

    for name in ("reference", "qnn_htp", "example_vendor"):
        loaded = load_backend(name)
        path = metadata.metadata_path(loaded.entry.module, name)
        assert path is not None and path.is_file(), name
        assert metadata.stale_reason(loaded.entry.module, loaded.info) is None, name


def test_a_stale_metadata_file_is_reported(tmp_path: Path) -> None:
    """A third-party backend whose file no longer matches its plugin: a warning names the fix."""
    from _quantplug.plugins import metadata

    site = tmp_path / "site"
    pkg = site / "stale_vendor"
    pkg.mkdir(parents=True)
    info = site / "stale_vendor-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: stale-vendor\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[quantplug.backends]\nstale = stale_vendor.plugin\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "plugin.py").write_text(
        "import quantplug\n"
        "@quantplug.hookimpl\n"
        "def quantplug_backend_info():\n"
        "    level = quantplug.BackendOption('level', int, 2)\n"
        "    return quantplug.BackendInfo('stale', 'x', options=(level,))\n"
    )
    declared = {"format": metadata.FORMAT, "name": "stale", "description": "x", "preset_option": None}
    declared |= {"qat_option": None, "presets": [], "options": []}
    (pkg / "stale.backend.json").write_text(json.dumps(declared))
    code = (
        "import logging, quantplug\n"
        "from _quantplug.plugins.registry import declared_info, load_backend\n"
        "print([o.name for o in declared_info('stale').options])\n"
        "load_backend('stale')\n"
    )
    env = clean_env()
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"  # what the file declares, read without importing
    assert "does not match the options its plugin declares" in done.stderr
    assert "`quantplug metadata stale`" in done.stderr  # the public command
