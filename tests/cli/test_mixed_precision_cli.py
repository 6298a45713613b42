"""``quantplug quantize --mixed-precision`` / ``--mixed-precision-file`` (issue 15.3): the search's
choice is what ships (bit widths in the QNN encodings), the file round-trips through an edit, and
the report shows the trade-off curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.cli.conftest import Result, run_cli

QNN = ["-b", "qnn_htp", "-o", "soc_model=SM8650"]
LAYERS = ("stem.0", "block.0", "head")  # the demo's conv/linear layers


def weight_bits(out: Path) -> dict[str, int]:
    """Each layer's weight bit width in the shipped QNN encodings."""
    params = json.loads((out / "artifact" / "model.encodings").read_text())["param_encodings"]
    by_name = {p["name"]: int(p["bw"]) for p in params}
    bits = {}
    for layer in LAYERS:
        prefix = layer.replace(".", "_") + "_weight"
        bits[layer] = next(bw for name, bw in by_name.items() if name.startswith(prefix))
    return bits


def search(demo_files: dict[str, Path], out: Path, *target: str) -> Result:
    return run_cli(
        "quantize", str(demo_files["pt2"]), "-c", str(demo_files["list"]), *QNN,
        "--mixed-precision", "16a4w,16a8w", *target, "--out", str(out),
    )  # fmt: skip


@pytest.fixture(scope="module")
def searched(demo_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    out = tmp_path_factory.mktemp("mixed") / "out"
    return search(demo_files, out, "--target-sqnr", "30"), out


def test_the_search_choice_is_what_ships(searched: tuple[Result, Path]) -> None:
    result, out = searched
    assert result.returncode == 0, result.stderr
    choice = json.loads((out / "mixed_precision.json").read_text())
    report = json.loads((out / "report.json").read_text())
    mixed = report["mixed_precision"]
    assert mixed["source"] == "search" and mixed["layers"] == len(LAYERS)
    assert mixed["overrides"] == choice["overrides"] and choice["overrides"]  # 4-bit alone misses 30 dB
    curve = mixed["curve"]
    assert curve[0]["overrides"] == {} and curve[0]["sqnr_db"] < 30
    chosen = curve[mixed["chosen"]]
    assert chosen["sqnr_db"] >= 30 and chosen["overrides"] == choice["overrides"]
    assert all(p["sqnr_db"] < 30 for p in curve[: mixed["chosen"]])  # the smallest point reaching it
    bits = weight_bits(out)
    assert bits == {layer: 8 if layer in choice["overrides"] else 4 for layer in LAYERS}
    assert report["options"]["precision"] == "16a4w"
    assert "mixed:       " in result.stdout and "raised from 16a4w" in result.stdout


def test_the_report_draws_the_tradeoff_curve(searched: tuple[Result, Path]) -> None:
    from _quantplug.report.plot import matplotlib_available

    _, out = searched
    page = (out / "report.html").read_text()
    assert 'id="mixed-precision"' in page and 'id="mixed-overrides"' in page
    assert "searched for an output SQNR of at least 30 dB" in page
    if matplotlib_available():
        assert 'id="tradeoff-plot"' in page and "data:image/png;base64," in page
    (out / "report.html").unlink()
    again = run_cli("report", str(out))  # re-rendered from report.json alone
    assert again.returncode == 0, again.stderr
    assert 'id="mixed-precision"' in (out / "report.html").read_text()
    assert "raised from 16a4w" in again.stdout


def test_an_edited_file_is_applied_without_a_search(
    searched: tuple[Result, Path], demo_files: dict[str, Path], tmp_path: Path
) -> None:
    _, out = searched
    edited: dict[str, Any] = json.loads((out / "mixed_precision.json").read_text())
    edited["overrides"] = {"stem.0": "16a8w", "block.0": "16a8w"}  # the user's own choice
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(edited))
    result = run_cli(
        "quantize", str(demo_files["pt2"]), "-c", str(demo_files["list"]), *QNN,
        "--mixed-precision-file", str(path), "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "mixed precision search" not in result.stderr
    assert weight_bits(tmp_path / "out") == {"stem.0": 8, "block.0": 8, "head": 4}
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["mixed_precision"]["source"] == str(path)
    written = json.loads((tmp_path / "out" / "mixed_precision.json").read_text())
    assert written["overrides"] == edited["overrides"]


def test_the_budget_bounds_the_weights(demo_files: dict[str, Path], tmp_path: Path) -> None:
    result = search(demo_files, tmp_path / "out", "--weight-budget", "+10%")
    assert result.returncode == 0, result.stderr
    mixed = json.loads((tmp_path / "out" / "report.json").read_text())["mixed_precision"]
    cheapest = mixed["curve"][0]["weight_bytes"]
    assert mixed["target"]["weight_bytes"] == pytest.approx(cheapest * 1.1)
    assert all(p["weight_bytes"] <= cheapest * 1.1 for p in mixed["curve"])
    # 10 % of the demo's 1448 4-bit weight bytes (2896 weights) holds the head at 8 bits (160
    # weights: +80 bytes), not the stem as well (432 weights: +216 bytes)
    assert mixed["overrides"] == {"head": "16a8w"}


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"overrides": {"head_": "16a8w"}}, ["'head_'", "did you mean 'head'", "stem.0, block.0, head"]),
        ({"overrides": {"head": "16a9w"}}, ["'16a9w'", "did you mean '16a8w'"]),
        ({"backend": "reference"}, ["backend 'reference', not 'qnn_htp'", "--backend reference"]),
        ({"format": "something/2"}, ["cannot be read", "mixed_precision.json written by"]),
    ],
    ids=["misspelt layer", "misspelt preset", "other backend", "not a choice file"],
)
def test_a_bad_file_is_refused_by_name(
    searched: tuple[Result, Path],
    demo_files: dict[str, Path],
    tmp_path: Path,
    edit: dict[str, Any],
    words: list[str],
) -> None:
    _, out = searched
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**json.loads((out / "mixed_precision.json").read_text()), **edit}))
    result = run_cli(
        "quantize", str(demo_files["pt2"]), "-c", str(demo_files["list"]), *QNN,
        "--mixed-precision-file", str(path), "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("quantplug: error:")]
    assert len(error) == 1, result.stderr
    for word in words:
        assert word in error[0], error[0]
    assert not (tmp_path / "out").exists()


def test_a_damaged_choice_in_report_json_is_named(searched: tuple[Result, Path], tmp_path: Path) -> None:
    _, out = searched
    report = json.loads((out / "report.json").read_text())
    report["mixed_precision"]["curve"][0]["sqnr_db"] = "high"
    (tmp_path / "report.json").write_text(json.dumps(report))
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 2
    assert "mixed_precision.curve[0].sqnr_db" in result.stderr


UNITS = {"": 1, "B": 1, "kB": 1000, "MB": 1000**2, "GB": 1000**3, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


@given(
    number=st.floats(min_value=0.001, max_value=1e6, allow_nan=False).map(lambda v: round(v, 3)),
    unit=st.sampled_from(sorted(UNITS)),
    space=st.sampled_from(["", " "]),
)
def test_budget_sizes_parse_to_bytes(number: float, unit: str, space: str) -> None:
    from _quantplug.cli.mixed_precision import parse_budget

    if number <= 0:
        return
    budget = parse_budget(f"{number}{space}{unit}")
    assert budget.growth is None and budget.bytes == pytest.approx(number * UNITS[unit])


@given(
    st.floats(min_value=0, max_value=1000, allow_nan=False).map(lambda v: round(v, 2)),
    st.sampled_from(["", "+"]),
)
def test_budget_growths_parse_to_fractions(percent: float, sign: str) -> None:
    from _quantplug.cli.mixed_precision import parse_budget

    budget = parse_budget(f"{sign}{percent}%")
    assert budget.bytes is None and budget.growth == pytest.approx(percent / 100)


@pytest.mark.parametrize(
    "text", ["lots", "-5%", "0", "1.5 parsecs", "nan%", "inf%", "%", "12 MB extra", "-3MB"]
)
def test_budgets_that_are_not_sizes_are_refused(text: str) -> None:
    from _quantplug.cli.errors import InputError
    from _quantplug.cli.mixed_precision import parse_budget

    with pytest.raises(InputError, match="--weight-budget"):
        parse_budget(text)


def test_a_search_under_a_launcher_is_refused(tmp_path: Path) -> None:
    """Under torchrun every rank would search (N times the work, N answers that must agree)."""
    import subprocess

    from tests.cli.conftest import CLI, REPO, clean_env

    env = {**clean_env(), "WORLD_SIZE": "2", "RANK": "1", "TORCHELASTIC_RUN_ID": "torchrun"}
    args = ["quantize", "-b", "qnn_htp", "--mixed-precision", "16a4w,16a8w", "--target-sqnr", "30"]
    done = subprocess.run(
        [*CLI, *args, "--out", str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2 and "without --nproc (or torchrun)" in done.stderr, done.stderr
