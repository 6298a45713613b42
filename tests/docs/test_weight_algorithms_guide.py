"""``docs/weight-algorithms.md``'s recommendation ("Which to use") is the bench's, and its command runs.

The recommendation is read off ``bench/results/algorithms.json``: the run with the least average
shortfall from each 4-bit cell's best. When the bench is re-run and another run wins, or the
figures quoted move, this fails until the guide says so.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from tests.cli.conftest import run_cli

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "weight-algorithms.md"
BENCH = REPO / "bench" / "results" / "algorithms.json"


def _section() -> str:
    text = GUIDE.read_text()
    start = text.index("## Which to use")
    return text[start : text.index("\n## ", start + 1)]


def _command() -> list[str]:
    """The recommended command's arguments after the model and its backend (``...``)."""
    (block,) = re.findall(r"```\n(quantplug quantize .*?)\n```", _section(), flags=re.S)
    words = shlex.split(block)
    return words[words.index("...") + 1 :]


def _shortfalls() -> dict[str, list[float]]:
    """Each run's shortfall (dB) from the best run of every 4-bit-weight cell, over runs made in all."""
    cells = [
        config["runs"]
        for configs in json.loads(BENCH.read_text()).values()
        for name, config in configs.items()
        if "4w" in name or "int4" in name
    ]
    common = set.intersection(*(set(runs) for runs in cells))
    best = [max(run["sqnr"] for run in runs.values()) for runs in cells]
    pairs = list(zip(best, cells, strict=True))
    return {name: [top - runs[name]["sqnr"] for top, runs in pairs] for name in common}


def test_the_recommendation_is_the_benchs_least_shortfall() -> None:
    shortfalls = _shortfalls()
    mean = {name: sum(s) / len(s) for name, s in shortfalls.items()}
    winner = min(mean, key=mean.__getitem__)
    assert winner == "cle+gptq(scale_search=20)+bias_correction"
    section = " ".join(_section().split())
    assert f"Of the {len(shortfalls)} single algorithms and combinations" in section
    assert f"{mean[winner]:.2f} dB on average, {max(shortfalls[winner]):.2f} at most" in section
    smoothquant = "smoothquant+gptq(scale_search=20)+bias_correction"
    assert f"With SmoothQuant in CLE's place: {mean[smoothquant]:.2f} on average" in section
    assert f"but {max(shortfalls[smoothquant]):.1f} short" in section
    assert f"with neither, {mean['gptq(scale_search=20)+bias_correction']:.2f}" in section
    assert f"(`seq_mse`, `gptq`, `bias_correction`): {mean['seq_mse+gptq+bias_correction']:.2f}" in section


def test_the_recommended_command_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = _command()
    assert args[:2] == ["-A", "cle"]
    backend = ["-b", "reference", "-o", "preset=weight_only_int4"]
    done = run_cli("quantize", "--out", str(out), *backend, *args, "-q")
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["options"]["algorithms"] == "cle, gptq(scale_search=20), bias_correction"
