"""Bad input: exit code 2, one readable line naming the problem, nothing written to --out.

One case per kind of mistake the issue names runs as its own ``python -m quantplug``
process; the variants run together in one more process that calls the same ``main()`` per case
(every CLI process pays torch's import, several seconds on a loaded 2-core machine). The
processes start together, then each case checks its own result.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.cli.conftest import REPO, Result, clean_env, run_cli

#: one process each: the mistakes the issue lists
OWN_PROCESS = {
    "missing_model",
    "unreadable_model",
    "factory_raises",
    "calibration_wrong_shape",
    "unknown_option",
    "option_wrong_type",
}

_BATCH_RUNNER = """
import contextlib, io, json, sys
from _quantplug.cli.main import main
results = {}
for case, argv in json.loads(sys.argv[1]).items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    results[case] = [rc, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""

# case -> (arguments, with {pt2}/{...} filled from demo_files; words the error line must contain)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "missing_model": (["missing-model.pt2"], ["missing-model.pt2", "not found"]),
    "unreadable_model": (["{garbage_pt2}"], ["garbage.pt2", "cannot load"]),
    "model_is_folder": (["{folder}"], ["is a folder"]),
    "factory_raises": (
        ["tests.cli._models:raises"],
        ["tests.cli._models:raises", "RuntimeError", "/data/missing.bin"],
    ),
    "factory_missing_module": (["no_such_pkg.models:build"], ["no_such_pkg", "cannot import"]),
    "factory_missing_attr": (["tests.cli._models:nope"], ["has no attribute", "nope"]),
    "factory_bad_return": (["tests.cli._models:not_a_model"], ["not_a_model", "str"]),
    "calibration_wrong_shape": (
        ["{pt2}", "--calibration", "{wrong_shape}"],
        ["wrong_shape.pt", "shape (1, 3, 16, 16)", "(1, 3, 32, 32)"],
    ),
    "calibration_wrong_arity": (["{pt2}", "--calibration", "{wrong_arity}"], ["2 input(s)", "takes 1"]),
    "calibration_wrong_keyword": (
        ["tests.cli._models:keyword_inputs", "--calibration", "{wrong_keyword}"],
        ["wrong_keyword.pt", "keyword x, masks", "takes keyword x, mask"],
    ),
    "calibration_missing": (["{pt2}", "--calibration", "nowhere.pt"], ["nowhere.pt", "not found"]),
    "calibration_unreadable": (["{pt2}", "--calibration", "{garbage_pt}"], ["garbage.pt", "cannot read"]),
    "unknown_option": (["--option", "colour=blue"], ["colour", "valid options", "preset"]),
    "option_wrong_type": (
        ["--backend", "example_vendor", "--option", "block_size=big"],
        ["block_size", "int", "big"],
    ),
    "option_bad_choice": (["--option", "preset=int3"], ["preset", "int3", "int8"]),
    "option_bad_bool": (["--option", "strict=perhaps"], ["strict", "bool"]),
    "option_not_key_value": (["--option", "preset"], ["key=value"]),
    "unknown_backend": (["--backend", "tpu9000"], ["tpu9000", "installed backends", "reference"]),
}


@pytest.fixture(scope="module")
def results(
    demo_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Result, Path]]:
    base = tmp_path_factory.mktemp("bad_input")
    fill = {k: str(v) for k, v in demo_files.items()}

    argvs: dict[str, list[str]] = {}
    outs: dict[str, Path] = {}
    for case, (args, _) in CASES.items():
        parent = base / case
        parent.mkdir()
        outs[case] = parent / "out"
        argvs[case] = ["quantize", *(a.format(**fill) for a in args), "--out", str(outs[case])]

    def run_batch() -> dict[str, Result]:
        batch = {c: a for c, a in argvs.items() if c not in OWN_PROCESS}
        done = subprocess.run(
            [sys.executable, "-c", _BATCH_RUNNER, json.dumps(batch)],
            cwd=REPO,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        raw = json.loads(done.stdout.strip().splitlines()[-1])
        return {c: Result(*raw[c]) for c in batch}

    with ThreadPoolExecutor(max_workers=3) as pool:
        batch = pool.submit(run_batch)
        own = {c: pool.submit(run_cli, *argvs[c]) for c in sorted(OWN_PROCESS)}
        found = {c: f.result() for c, f in own.items()} | batch.result()
    return {c: (found[c], outs[c]) for c in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line(case: str, results: dict[str, tuple[Result, Path]]) -> None:
    result, out = results[case]
    assert result.returncode == 2, (result.stdout, result.stderr)
    errors = [line for line in result.stderr_lines if not line.startswith(("loading model:", "warning:"))]
    assert len(errors) == 1, result.stderr
    line = errors[0]
    assert line.startswith("quantplug: error: ")
    assert "Traceback" not in result.stderr
    for word in CASES[case][1]:
        assert word in line, line
    assert result.stdout == ""
    # nothing written: neither --out nor a staging folder next to it
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir()] == []


def test_failed_run_leaves_existing_out_untouched(demo_files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text('{"previous": true}')
    result = run_cli(
        "quantize", str(demo_files["pt2"]), "-c", str(demo_files["wrong_shape"]), "--out", str(out)
    )
    assert result.returncode == 2
    assert (out / "report.json").read_text() == '{"previous": true}'
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_out_that_is_a_file(demo_files: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "file.txt"
    target.write_text("x")
    result = run_cli("quantize", "--out", str(target))
    assert result.returncode == 2
    assert result.stderr_lines[-1].startswith("quantplug: error: --out")
    assert target.read_text() == "x"


def test_verbose_shows_the_traceback(tmp_path: Path) -> None:
    result = run_cli("quantize", "tests.cli._models:raises", "--out", str(tmp_path / "o"), "--verbose")
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert "weights file /data/missing.bin" in result.stderr
    assert result.stderr_lines[-1].startswith("quantplug: error: factory")


def test_report_of_a_folder_without_report(tmp_path: Path) -> None:
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr_lines == [
        f"quantplug: error: no report.json in {tmp_path} (write one with `quantplug quantize --out DIR`)"
    ]


FAILING_WRITER = """
import dataclasses
import quantplug
from quantplug_reference import plugin as ref

quantplug_annotation_rules = ref.quantplug_annotation_rules
quantplug_quantization_config = ref.quantplug_quantization_config


@quantplug.hookimpl
def quantplug_backend_info():
    return dataclasses.replace(ref.quantplug_backend_info(), name="failing")


@quantplug.hookimpl
def quantplug_artifact_writer(context):
    def write(program, context):
        raise OSError("disk on fire")
    return write
"""


def test_failure_late_in_the_run_leaves_nothing(tmp_path: Path) -> None:
    """The artifact writer fails after calibration and convert: --out is never created."""
    site = tmp_path / "site"
    info = site / "failing_backend-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: failing-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[quantplug.backends]\nfailing = failing_backend_mod\n")
    (site / "failing_backend_mod.py").write_text(FAILING_WRITER)
    env = clean_env()
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "quantplug", "quantize", "--backend", "failing", "--out", "out"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr
    assert "calibrated: 16 batches" in done.stderr  # it got that far
    last = done.stderr.splitlines()[-1]
    assert last.startswith("quantplug: error: ") and "disk on fire" in last and "failing" in last
    assert list(work.iterdir()) == []  # no out/, no staging folder
