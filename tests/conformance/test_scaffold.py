"""``quantplug new-backend``: names, refusals and lint-clean code.

That the generated distribution installs, passes ``quantplug conformance`` and its own tests (the
conformance kit included) is checked once, by the guide that tells users to do exactly that
(tests/docs/test_writing_a_backend.py::test_the_guide_runs, its first shell block).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _quantplug.scaffold import ScaffoldError, create_backend, names, render

REPO = Path(__file__).resolve().parents[2]


def _env(*paths: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTPLUG_")}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(REPO), env.get("PYTHONPATH", "")])
    return env


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200, check=False)


def test_names_and_refusals(tmp_path: Path) -> None:
    assert names("my_npu") == {
        "name": "my_npu",
        "dist": "quantplug-my-npu",
        "package": "quantplug_my_npu",
        "title": "MY NPU",
    }
    for bad in ("My-NPU", "1chip", "chip_", "a__b", ""):
        with pytest.raises(ScaffoldError, match="lowercase identifier"):
            names(bad)
    root = create_backend("my_npu", tmp_path)
    with pytest.raises(ScaffoldError, match="already exists"):
        create_backend("my_npu", tmp_path)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == sorted(render("my_npu"))
    assert "{{" not in "".join(p.read_text() for p in root.rglob("*") if p.is_file())


def test_the_generated_code_is_lint_clean(tmp_path: Path) -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    root = create_backend("lint_npu", tmp_path)
    for args in (["check"], ["format", "--check"]):
        done = _run(
            [ruff, *args, "--config", str(REPO / "pyproject.toml"), str(root)], cwd=tmp_path, env=_env()
        )
        assert done.returncode == 0, done.stdout + done.stderr
