"""The code base stays ruff-clean, ruff-formatted and mypy-clean (core and both plugins)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [
    (ROOT / "core", "quantplug"),
    (ROOT / "core", "_quantplug"),
    (ROOT / "plugins" / "reference", "quantplug_reference"),
    (ROOT / "plugins" / "qnn_htp", "quantplug_qnn_htp"),
]


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (scripts/setup.sh --test installs it)")
    return found


def _run(*cmd: str, cwd: Path = ROOT) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"


def test_ruff_check() -> None:
    _run(_tool("ruff"), "check", "core", "plugins", "tests", "bench")


def test_ruff_format() -> None:
    _run(_tool("ruff"), "format", "--check", "core", "plugins", "tests", "bench")


@pytest.mark.parametrize(("where", "package"), PACKAGES, ids=[p for _, p in PACKAGES])
def test_mypy(where: Path, package: str) -> None:
    _run(_tool("mypy"), "--config-file", str(ROOT / "pyproject.toml"), package, cwd=where)
