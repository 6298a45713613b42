"""`quantplug backends`: metadata only by default, imports with --check, --json for scripts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.cli.conftest import REPO, clean_env
from tests.conformance.kit_backend import install


def test_json_has_metadata_without_importing_plugins() -> None:
    code = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from _quantplug.cli.main import main
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["backends", "--json"])
        imported = sorted(m for m in sys.modules if m.startswith("quantplug_"))
        print(json.dumps({"rc": rc, "rows": json.loads(buf.getvalue()), "imported": imported}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout.strip().splitlines()[-1])
    assert data["rc"] == 0
    assert data["imported"] == []  # no plugin module imported without --check
    rows = {r["name"]: r for r in data["rows"]}
    ref = rows["reference"]
    assert ref["distribution"] == "quantplug-reference"
    assert ref["version"]
    assert ref["description"]  # from the distribution's metadata
    assert ref["status"] == "available"
    assert "options" not in ref


def test_check_reports_a_broken_plugin(tmp_path) -> None:
    """An installed-looking plugin that fails to import: status error, others still ok, exit 1."""
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\nSummary: a broken one\n"
    )
    (dist / "entry_points.txt").write_text("[quantplug.backends]\nbroken = broken_plugin_mod\n")
    (tmp_path / "broken_plugin_mod.py").write_text("raise ImportError('needs libfoo.so')\n")
    env = clean_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    done = subprocess.run(
        [sys.executable, "-m", "quantplug", "backends", "--check", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    assert rows["broken"]["status"] == "error"
    assert "needs libfoo.so" in rows["broken"]["error"]
    assert rows["broken"]["distribution"] == "broken-plugin"
    ref = rows["reference"]
    assert ref["status"] == "ok" and ref["error"] is None
    preset = next(o for o in ref["options"] if o["name"] == "preset")
    assert preset["type"] == "str" and preset["default"] == "int8" and "int8" in preset["choices"]
    assert "int8" in ref["presets"]
    # without --check: listed from metadata, nothing imported, exit 0
    done = subprocess.run(
        [sys.executable, "-m", "quantplug", "backends"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["NAME", "DISTRIBUTION", "VERSION", "STATUS", "DESCRIPTION"]
    broken = next(line for line in lines if line.startswith("broken "))
    assert "broken-plugin" in broken and "available" in broken and "a broken one" in broken
    row = next(line for line in lines if line.startswith("reference "))
    assert "quantplug-reference" in row and "available" in row


def _run(args: list[str], site: Path) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    return subprocess.run(
        [sys.executable, "-m", "quantplug", *args],
        cwd=site,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_plugin_calling_sys_exit_is_reported_never_exit_0(tmp_path: Path) -> None:
    """At import (a load error: ``backends --check`` exit 1, ``quantize`` exit 2) or in a hook
    while quantizing (exit 1): one line naming the culprit, nothing written."""
    exits_at_import = install(tmp_path, "kit_exits_at_import", ("exit@import",))
    exits_in_hook = install(tmp_path, "kit_exits_in_hook", ("exit@quantplug_quantization_config",))

    done = _run(["backends", "--check", "--json"], tmp_path)
    assert done.returncode == 1, done.stderr
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    assert rows[exits_at_import]["status"] == "error"
    assert "importing it called sys.exit(0)" in rows[exits_at_import]["error"]
    assert rows["reference"]["status"] == "ok"

    out = tmp_path / "out"
    done = _run(["quantize", "-b", exits_at_import, "--out", str(out)], tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.startswith("quantplug: ")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"backend {exits_at_import!r}" in lines[0] and "importing it called sys.exit(0)" in lines[0]
    assert not out.exists()

    done = _run(["quantize", "-b", exits_in_hook, "--out", str(out)], tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.startswith("quantplug: ")]
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert "sys.exit(0) from code quantplug ran (hook quantplug_quantization_config of 'backend:" in lines[0]
    assert f"{exits_in_hook}.py" in lines[0] and "the command did not complete" in lines[0]
    assert not out.exists()
