"""Start N real processes of a ``torch.distributed`` gloo group on 127.0.0.1 and collect results.

Each rank runs ``python -m tests.distributed.worker SCENARIO`` with the environment torchrun
would give it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a port free at run time, the
launcher's TORCHELASTIC_RUN_ID) and
writes what it found to ``OUT/rank{r}.pt``. Every process has a deadline, so a bug that hangs a
collective fails the test instead of the suite.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str
    result: dict[str, Any]


def run_ranks(
    scenario: str, world: int, out: Path, *, deadline: float = 240.0, **env: str
) -> list[RankResult]:
    out.mkdir(parents=True, exist_ok=True)
    base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "TORCHELASTIC_RUN_ID": "tests",
        "OMP_NUM_THREADS": "1",
        "QUANTPLUG_TEST_OUT": str(out),
        **env,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.worker", scenario],
            cwd=ROOT,
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    for r, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=deadline)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(
                f"rank {r} of scenario {scenario!r} still running after {deadline}s"
            ) from None
        path = out / f"rank{r}.pt"
        found = torch.load(path, weights_only=False) if path.exists() else {}
        results.append(RankResult(r, proc.returncode, output, found))
    return results
