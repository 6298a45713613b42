"""``quantplug quantize --nproc N`` and streamed calibration data, through the command line."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli.conftest import REPO, Result, clean_env, run_cli
from tests.cli.test_fast_cli import _heavy, _imported
from tests.distributed.launch import run_ranks


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from _quantplug.demo.model import demo_calibration, demo_model

    root = tmp_path_factory.mktemp("nproc")
    model, example = demo_model()
    torch.export.save(torch.export.export(model, example), str(root / "demo.pt2"))
    batches = demo_calibration(8)
    torch.save([b[0] for b in batches], root / "list.pt")
    folder = root / "folder"
    folder.mkdir()
    for i, b in enumerate(batches):
        torch.save(b[0], folder / f"b{i}.pt")
    bad = root / "bad"
    bad.mkdir()
    for i, b in enumerate(batches[:3]):
        torch.save(b[0] if i != 1 else [b[0], torch.randn(1, 3, 9, 9)], bad / f"b{i}.pt")
    return {"pt2": root / "demo.pt2", "list": root / "list.pt", "folder": folder, "bad": bad, "root": root}


def _arguments(demo: dict[str, Path], out: str, data: str, *extra: str) -> list[str]:
    return [
        "quantize", str(demo["pt2"]), "-c", data, "-o", "activation_observer=minmax",
        "--compare-batches", "1", "--out", str(demo["root"] / out), *extra,
    ]  # fmt: skip


def quantize(demo: dict[str, Path], out: str, data: str, *extra: str) -> Result:
    """The command, with a temporary folder of its own that it must leave as it found it: a
    launcher left to itself makes a folder there on every run and never removes it. (ONNX
    Runtime keeps one file of a fixed name there, ``.ses``, rewritten by each run.)"""
    temporary = demo["root"] / f"{out}-tmp"
    temporary.mkdir(exist_ok=True)
    result = run_cli(*_arguments(demo, out, data, *extra), timeout=600, env={"TMPDIR": str(temporary)})
    assert sorted(p.name for p in temporary.iterdir() if p.name != ".ses") == [], result.stderr
    return result


#: the algorithms whose two-process runs are compared with one process, by name: every built-in
#: algorithm that collects (and CLE, which transforms with data)
ALGORITHMS: dict[str, list[str]] = {
    "bias_correction": ["bias_correction"],  # running means and the store of batches (sequential)
    "gptq": ["gptq"],  # layer Hessians
    "adaround": ["adaround", "--algorithm-option", "adaround.iterations=50"],
    # the store of batches, Hessians at convert (a fine search: 20 candidates hid the unmerged store)
    "seq_mse": [
        "seq_mse",
        "--algorithm-option",
        "seq_mse.sequential=true",
        "--algorithm-option",
        "seq_mse.candidates=100",
    ],
    "cle": ["cle"],  # a transform with data (high-bias absorption): the same batches on every rank
    "seq_mse+gptq": ["seq_mse", "-A", "gptq"],  # one set of Hessian sums for both: merged through its leader
}

#: runs ``quantplug`` once per argument list, in one interpreter (``main(argv)`` for each); prints
#: ``{key: [exit code, stderr]}``
_ONE_INTERPRETER = """
import contextlib, io, json, sys
from _quantplug.cli.main import main
results = {}
for key, argv in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    results[key] = [code, err.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def one_process(demo: dict[str, Path]) -> dict[str, Result]:
    """The one-process runs the two-process runs must equal (``one``: no algorithm, and one per
    :data:`ALGORITHMS` entry, written to ``<name>-1``), all in one child interpreter: what is
    compared is the files, and a child per run only paid torch's import again. Each run is a
    whole ``quantplug`` command (``main``) with its own output folder, and leaves the temporary
    folder as it found it, as :func:`quantize` checks."""
    runs = {"one": _arguments(demo, "one", str(demo["list"]))}
    for name, algorithm in ALGORITHMS.items():
        runs[name] = _arguments(demo, f"{name}-1", str(demo["list"]), "-A", *algorithm)
    temporary = demo["root"] / "one-process-tmp"
    temporary.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _ONE_INTERPRETER, json.dumps(runs)],
        cwd=REPO,
        env={**clean_env(), "TMPDIR": str(temporary)},
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in temporary.iterdir() if p.name != ".ses") == [], done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return {key: Result(code, "", stderr) for key, (code, stderr) in found.items()}


def program_content(out: Path) -> tuple[str, dict[str, Any]]:
    import torch.ao.quantization.fx._decomposed  # registers the Q/DQ ops the program holds

    program = torch.export.load(str(out / "quantized.pt2"))
    return program.graph_module.code, {**program.state_dict, **program.constants}


def assert_same_output(a: Path, b: Path) -> None:
    """The deployable files byte for byte, and the quantized program's code and every tensor."""
    files = sorted(p.relative_to(a) for p in (a / "artifact").rglob("*") if p.is_file())
    assert files
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    code_a, tensors_a = program_content(a)
    code_b, tensors_b = program_content(b)
    assert code_a == code_b and tensors_a.keys() == tensors_b.keys()
    assert all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)


def test_two_processes_write_what_one_writes(demo: dict[str, Path], one_process: dict[str, Result]) -> None:
    one = one_process["one"]
    two = quantize(demo, "two", str(demo["list"]), "--nproc", "2")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    a, b = demo["root"] / "one", demo["root"] / "two"
    assert_same_output(a, b)
    # quantized.pt2 differs only where torch.export writes object ids and a random serialization id
    names = zipfile.ZipFile(a / "quantized.pt2").namelist()
    assert any(n.endswith("serialization_id") for n in names)
    report = json.loads((b / "report.json").read_text())
    assert report["calibration"]["batches"] == 8 and report["calibration"]["processes"] == 2
    assert "calibrating (2 processes): 8 batches" in two.stderr  # rank 0 counts every rank's batches
    assert "calibrated: 8 batches" in two.stderr


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_algorithms_on_two_processes_write_what_one_writes(
    demo: dict[str, Path], one_process: dict[str, Result], name: str
) -> None:
    """Every built-in algorithm that collects (and CLE, which transforms with data): its
    statistics merge by sums in rank order, so the files are those of one process."""
    algorithm = ALGORITHMS[name]
    one = one_process[name]
    two = quantize(demo, f"{name}-2", str(demo["list"]), "-A", *algorithm, "--nproc", "2")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert_same_output(demo["root"] / f"{name}-1", demo["root"] / f"{name}-2")
    report = json.loads((demo["root"] / f"{name}-2" / "report.json").read_text())
    assert report["options"]["algorithms"].startswith(algorithm[0])
    assert report["calibration"]["processes"] == 2


def test_transforms_and_the_guard_see_rank_0s_batches_on_every_rank(tmp_path: Path) -> None:
    """A data factory whose items differ on every call (an unseeded augmentation): each rank
    reading the transform batches itself would smooth other weights into its program (the sync
    names the difference); rank 0 reads them and sends them to the others. So it does with the
    guard's ``--held-out`` batches, here from a factory that fits the model on rank 0 only."""
    result = run_cli(
        "quantize", "tests.distributed.data:norm_mlp", "-c", "tests.distributed.data:augmented",
        "-o", "activation_observer=minmax", "-A", "smoothquant", "-A", "gptq",
        "--algorithm-option", "smoothquant.alpha=0.5",
        "--held-out", "tests.distributed.data:fitting_on_rank_0_only",
        "--compare-batches", "1", "--nproc", "2", "--out", str(tmp_path / "out"), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["options"]["algorithm_guard"].startswith(
        "on (judged on held-out data tests.distributed.data:fitting_on_rank_0_only)"
    )


def test_ranks_end_without_finalisation_but_run_the_users_exit_handlers(tmp_path: Path) -> None:
    """A rank could abort in the interpreter's finalisation after a successful run (gloo's threads
    still holding tensors: "terminate called without an active exception", seen on CI with the group
    destroyed). Ranks now end with ``os._exit`` after the run; the exit handlers of user code (a
    model factory's cleanup) must still run on every rank, and the run's exit code be kept."""
    marks = tmp_path / "marks"
    marks.mkdir()
    result = run_cli(
        "quantize", "tests.distributed.data:norm_mlp_marking_its_exit",
        "-c", "tests.distributed.data:augmented",
        "-o", "activation_observer=minmax", "--compare-batches", "1", "--nproc", "2",
        "--out", str(tmp_path / "out"), timeout=600, env={"QUANTPLUG_TEST_MARKS": str(marks)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in marks.iterdir()) == ["rank-0", "rank-1"]
    assert (tmp_path / "out" / "report.json").exists()


def test_an_algorithm_whose_collector_cannot_merge_is_refused_before_calibrating(
    demo: dict[str, Path], tmp_path: Path
) -> None:
    argv = [
        "quantize", str(demo["pt2"]), "-c", str(demo["list"]), "-A", "unmergeable",
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    ranks = run_ranks(
        "cli", 2, tmp_path / "ranks", QUANTPLUG_TEST_ARGV=json.dumps(argv), QUANTPLUG_TEST_UNMERGEABLE="1"
    )
    for rank in ranks:
        assert rank.result.get("exit") == 2, rank.output
        assert "algorithm 'unmergeable' collects with " in rank.output and "Unmergeable.Count" in rank.output
    assert not list((tmp_path / "ranks").glob("fed-*"))  # refused before calibrating
    assert not (tmp_path / "out").exists()


def test_every_rank_leaves_the_group_when_its_run_ends(demo: dict[str, Path], tmp_path: Path) -> None:
    """A gloo group left open at interpreter exit aborts the process ("terminate called without
    an active exception") after a run that succeeded: seen on a busy CI machine, where rank 1
    (done after calibrating) exited while rank 0 lowered. Each rank must destroy the group it made."""
    argv = [
        "quantize", str(demo["pt2"]), "-c", str(demo["list"]), "-o", "activation_observer=minmax",
        "--compare-batches", "1", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    ranks = run_ranks("cli", 2, tmp_path / "ranks", QUANTPLUG_TEST_ARGV=json.dumps(argv))
    for rank in ranks:
        assert rank.returncode == 0, rank.output
        assert rank.result == {"exit": 0, "group_left_open": False}, rank.output
    assert (tmp_path / "out" / "report.json").exists()  # rank 0 wrote the run


@pytest.mark.parametrize(
    "data", ["folder", "tests.distributed.data:loader", "tests.distributed.data:sharded"]
)
def test_streamed_sources_calibrate_every_batch_once(
    demo: dict[str, Path], one_process: dict[str, Result], data: str
) -> None:
    source = str(demo["folder"]) if data == "folder" else data
    result = quantize(
        demo, f"stream-{data.rsplit(':', 1)[-1]}", source, *(["--nproc", "2"] if data != "folder" else [])
    )
    assert result.returncode == 0, result.stderr
    out = demo["root"] / f"stream-{data.rsplit(':', 1)[-1]}"
    report = json.loads((out / "report.json").read_text())
    assert report["calibration"]["batches"] == 8
    assert one_process["one"].returncode == 0, one_process["one"].stderr
    reference = demo["root"] / "one"  # the same 8 batches as the list file: the same encodings
    assert (out / "artifact" / "encodings.json").read_bytes() == (
        reference / "artifact" / "encodings.json"
    ).read_bytes()


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ("bad", ["b1.pt[1]", "(1, 3, 9, 9)"]),
        ("tests.distributed.data:broken", ["tests.distributed.data:broken item 1", "(1, 3, 8, 8)"]),
    ],
)
def test_a_bad_batch_names_its_file_and_index(demo: dict[str, Path], data: str, words: list[str]) -> None:
    source = str(demo["bad"]) if data == "bad" else data
    result = quantize(demo, "bad-out", source, "--nproc", "2")
    assert result.returncode == 2, result.stderr
    for word in words:
        assert word in result.stderr
    assert not (demo["root"] / "bad-out").exists()


def test_nproc_argument_errors_import_no_torch() -> None:
    done, modules = _imported("quantize", "--nproc", "0")
    assert done.returncode == 2 and "--nproc must be at least 1" in done.stderr
    assert _heavy(modules) == []
    done, modules = _imported("quantize", "--help")
    assert "--nproc" in done.stdout and _heavy(modules) == []
