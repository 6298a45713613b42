"""Every file derived from a declaration is what its declaration gives (``scripts/generate.py``).

Each fact is declared once, in code: a backend's options (``quantplug_backend_info``), the ops of
each rules module (its ``register_annotator`` decorators), an algorithm's options (its
``AlgorithmOption`` declarations), the public names (each public module's ``_DECLARATION``). The
files that repeat them for readers that must not import the code are generated; this test runs
the generator's check as a developer or CI does, in a fresh interpreter, and names each stale file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: what scripts/generate.py reads and writes (the rest of the repository plays no part)
TREES = ("core", "plugins", "scripts", "api", "docs", "tests/example_plugin", "tests/api")


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    """``scripts/generate.py --check`` of the checkout at ``root``, its code first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTPLUG_")}
    paths = [root / "core", root / "plugins" / "reference", root / "plugins" / "qnn_htp"]
    env["PYTHONPATH"] = os.pathsep.join(map(str, paths))
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "generate.py"), "--check"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def test_every_generated_file_is_current() -> None:
    done = _check(REPO)
    stale = re.findall(r"^stale: (\S+)", done.stdout, re.MULTILINE)
    assert done.returncode == 0 and not stale, (
        f"stale generated files (run `python scripts/generate.py`): {', '.join(stale)}\n{done.stderr[-3000:]}"
    )


def test_a_rule_declared_but_not_indexed_is_reported(tmp_path: Path) -> None:
    """A copy whose rules module registers one more op than its index lists: that index is named."""
    root = tmp_path / "repo"
    for tree in TREES:
        shutil.copytree(REPO / tree, root / tree, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "tests" / "__init__.py", root / "tests" / "__init__.py")
    rules = root / "plugins" / "reference" / "quantplug_reference" / "rules" / "linear_rules.py"
    source = rules.read_text()
    assert "[aten.linear.default]" in source
    rules.write_text(source.replace("[aten.linear.default]", "[aten.linear.default, aten.bilinear.default]"))

    done = _check(root)
    assert done.returncode == 1, done.stdout + done.stderr
    stale = re.findall(r"^stale: (\S+)", done.stdout, re.MULTILINE)
    assert stale == ["plugins/reference/quantplug_reference/rules/rules.json"], done.stdout
