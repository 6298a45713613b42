"""Print the zoo's measurements as tables: SQNR per model and preset, and against ExecuTorch.

Run the zoo with ``QUANTPLUG_ZOO_RECORD`` naming a file, then this module on it::

    QUANTPLUG_ZOO_RECORD=/tmp/zoo.jsonl .venv/bin/python -m pytest -q tests/zoo
    .venv/bin/python -m tests.zoo.report /tmp/zoo.jsonl

The first table is what ``FLOORS_TABLE`` in ``test_zoo.py`` is derived from (measured minus
1 dB, rounded down to 0.5 dB).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from typing import Any

from tests.zoo.harness import PRESETS
from tests.zoo.models import MODELS


def floor_of(sqnr: float) -> float:
    """The floor stated for a measured SQNR: 1 dB below it, rounded down to 0.5 dB (100 at most)."""
    return 100.0 if sqnr >= 101.0 else math.floor((sqnr - 1.0) * 2) / 2


def tables(lines: Iterable[str]) -> str:
    program: dict[tuple[str, str, str], float] = {}
    artifact: dict[tuple[str, str, str], float] = {}
    peers: list[dict[str, Any]] = []
    redrawn: dict[tuple[str, str, str], list[list[float]]] = {}  # (ours, theirs) per draw
    for line in lines:
        entry = json.loads(line)
        key = (entry["model"], entry["backend"], entry["preset"])
        if entry["kind"] == "program":
            program[key] = entry["sqnr"]
        elif entry["kind"] == "artifact":
            artifact[key] = entry["sqnr"]
        elif entry["kind"] == "peer_redrawn":
            redrawn[key] = entry["pairs"]
        else:
            peers.append(entry)
    out = ["SQNR of the Q/DQ program against float (dB); [artifact's where ORT ran it]", ""]
    out.append(f"{'model':19}" + "".join(f"{p:>20}" for _, p in PRESETS))
    for name in MODELS:
        cells = []
        for backend, preset in PRESETS:
            key = (name, backend, preset)
            cell = f"{program[key]:.1f}" if key in program else "-"
            if key in artifact:
                cell += f" [{artifact[key]:.1f}]"
            cells.append(f"{cell:>20}")
        out.append(f"{name:19}" + "".join(cells))
    out += ["", "floors (measured - 1 dB, rounded down to 0.5 dB), as FLOORS_TABLE spells them", ""]
    width = {preset: max(len(preset) + 1, 7) for _, preset in PRESETS}
    split = sum(1 for backend, _ in PRESETS if backend == "reference")
    header = [f"{preset:<{width[preset]}}" for _, preset in PRESETS]
    out.append(f"{'model':19}" + "".join(header[:split]) + "| " + "".join(header[split:]))
    for name in MODELS:
        cells = []
        for backend, preset in PRESETS:
            value = program.get((name, backend, preset))
            cells.append(f"{floor_of(value) if value is not None else '-':<{width[preset]}}")
        out.append((f"{name:19}" + "".join(cells[:split]) + "| " + "".join(cells[split:])).rstrip())
    out += ["", "quantplug vs ExecuTorch's quantizer (torchao prepare_pt2e/convert_pt2e), SQNR in dB", ""]
    out.append(
        f"{'model':19}{'backend':10}{'preset':14}{'options':18}{'peer':26}{'ours':>8}{'theirs':>8}{'diff':>8}"
    )
    for e in sorted(peers, key=lambda e: (list(MODELS).index(e["model"]), e["backend"], e["preset"])):
        options = ",".join(f"{k}={v}" for k, v in e["options"].items()) or "-"
        line = (
            f"{e['model']:19}{e['backend']:10}{e['preset']:14}{options:18}{e['peer']:26}"
            f"{e['ours']:8.2f}{e['theirs']:8.2f}{e['ours'] - e['theirs']:+8.2f}"
        )
        pairs = redrawn.get((e["model"], e["backend"], e["preset"]))
        if pairs:  # re-judged on fresh draws of the data (test_no_worse_than_peer)
            mean = sum(a - b for a, b in pairs) / len(pairs)
            line += f"  mean over {len(pairs)} draws {mean:+.2f}"
        out.append(line)
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        print(tables(f))
