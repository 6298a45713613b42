"""Helpers of the CLI tests: run ``python -m quantplug`` in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "quantplug"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    def json(self) -> Any:
        return json.loads(self.stdout)


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTPLUG_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 300, env: dict[str, str] | None = None
) -> Result:
    done = subprocess.run(
        [*CLI, *args],
        cwd=cwd or REPO,
        env={**clean_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Result(done.returncode, done.stdout, done.stderr)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


@pytest.fixture(scope="session")
def demo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo program saved as .pt2 and calibration data in every accepted layout."""
    import torch

    from _quantplug.demo.model import demo_calibration, demo_model

    root = tmp_path_factory.mktemp("demo_files")
    model, example = demo_model()
    program = torch.export.export(model, example)
    torch.export.save(program, str(root / "demo.pt2"))
    batches = demo_calibration(6)
    torch.save([b[0] for b in batches], root / "list.pt")  # a list of tensors
    torch.save([b for b in batches], root / "tuples.pt")  # a list of 1-tuples
    torch.save(torch.stack([b[0] for b in batches]), root / "stack.pt")  # one stacked tensor
    folder = root / "calib"
    folder.mkdir()
    for i, b in enumerate(batches[:3]):
        torch.save(b, folder / f"batch{i}.pt")  # one tuple per file
    torch.save(torch.randn(1, 3, 16, 16), root / "wrong_shape.pt")
    torch.save([(torch.randn(1, 3, 32, 32), torch.randn(1, 3, 32, 32))], root / "wrong_arity.pt")
    from tests.cli._models import keyword_batches

    torch.save(keyword_batches(5), root / "keywords.pt")  # a list of dicts: keyword inputs
    wrong = keyword_batches(1)[0]
    torch.save({"x": wrong["x"], "masks": wrong["mask"]}, root / "wrong_keyword.pt")
    (root / "garbage.pt2").write_bytes(b"this is not a zip archive")
    (root / "garbage.pt").write_bytes(b"\x00\x01 nor a pickle")
    return {
        "pt2": root / "demo.pt2",
        "list": root / "list.pt",
        "tuples": root / "tuples.pt",
        "stack": root / "stack.pt",
        "folder": folder,
        "wrong_shape": root / "wrong_shape.pt",
        "wrong_arity": root / "wrong_arity.pt",
        "garbage_pt2": root / "garbage.pt2",
        "garbage_pt": root / "garbage.pt",
        "keywords": root / "keywords.pt",
        "wrong_keyword": root / "wrong_keyword.pt",
    }


class RunCache:
    """Each distinct CLI run once per session (the runs are the slow part: torch imports)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._done: dict[str, tuple[Result, Path]] = {}

    def get(self, key: str, *args: str, cwd: Path | None = None) -> tuple[Result, Path]:
        """Run ``quantplug quantize ARGS --out <fresh folder>`` (once per key)."""
        if key not in self._done:
            folder = self.base / key
            folder.mkdir()
            out = folder / "out"
            self._done[key] = (run_cli("quantize", *args, "--out", str(out), cwd=cwd), out)
        return self._done[key]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> RunCache:
    return RunCache(tmp_path_factory.mktemp("runs"))


def backend_run(runs: RunCache, demo_files: dict[str, Path], backend: str) -> tuple[Result, Path]:
    """The demo .pt2 calibrated on list.pt (6 batches) with ``backend``: shared by several tests."""
    return runs.get(backend, str(demo_files["pt2"]), "-c", str(demo_files["list"]), "--backend", backend)
