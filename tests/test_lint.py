"""The code base stays ruff-clean, ruff-formatted and mypy-clean (core and both plugins)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: (folder on mypy's path, package); each package's verdict is read from the files under it
PACKAGES = [
    ("core", "quantplug"),
    ("core", "_quantplug"),
    ("plugins/reference", "quantplug_reference"),
    ("plugins/qnn_htp", "quantplug_qnn_htp"),
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


@pytest.fixture(scope="module")
def mypy_run() -> subprocess.CompletedProcess[str]:
    """One mypy process over the four packages, each resolved from this checkout (MYPYPATH).

    One process analyses torch's stubs once instead of once per package (a cold run of each
    package spent most of its 15 s there); the plugins' ``import quantplug`` then reads this
    checkout's core, as it does when the packages are installed from it.
    """
    env = dict(os.environ, MYPYPATH=os.pathsep.join(sorted({str(ROOT / where) for where, _ in PACKAGES})))
    cmd = [_tool("mypy"), "--config-file", str(ROOT / "pyproject.toml"), "--show-absolute-path"]
    for _, package in PACKAGES:
        cmd += ["-p", package]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)


def _package_of(line: str) -> str | None:
    for where, package in PACKAGES:
        if line.startswith(str(ROOT / where / package) + os.sep):
            return package
    return None


@pytest.mark.parametrize(("where", "package"), PACKAGES, ids=[p for _, p in PACKAGES])
def test_mypy(mypy_run: subprocess.CompletedProcess[str], where: str, package: str) -> None:
    lines = mypy_run.stdout.splitlines()
    own = [line for line in lines if _package_of(line) == package]
    assert not own, f"mypy reports in {where}/{package}:\n" + "\n".join(own)
    # a failure no package's file explains (a crash, a bad option) fails every package's test
    explained = any(_package_of(line) for line in lines)
    assert mypy_run.returncode == 0 or explained, f"mypy failed:\n{mypy_run.stdout}\n{mypy_run.stderr}"


def test_mypy_reads_the_bodies_of_modules_that_have_stubs() -> None:
    """A package check reads ``X.pyi`` where it sits beside ``X.py`` (the public fronts' generated
    stubs), so a type error in the ``.py`` itself would go unreported; named as files, mypy
    checks the ``.py``."""
    shadowed: dict[str, list[str]] = {}
    for where, package in PACKAGES:
        for path in sorted((ROOT / where / package).rglob("*.py")):
            if path.with_suffix(".pyi").exists():
                shadowed.setdefault(where, []).append(str(path.relative_to(ROOT / where)))
    assert "quantplug/debug.py" in shadowed.get("core", [])  # else this test would check nothing
    for where, files in shadowed.items():
        _run(_tool("mypy"), "--config-file", str(ROOT / "pyproject.toml"), *files, cwd=ROOT / where)
