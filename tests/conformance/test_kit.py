"""The conformance kit: the shipped backends conform, and each check fails a backend broken for it.

Broken backends come from ``kit_backend.py``: one small backend whose defects are switched on by
check name, registered in-process (or installed through a throwaway ``.dist-info`` for the
command-line test), so each test shows both sides: the defect fails exactly its check, and the
same backend without it passes that check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import quantplug
from _quantplug.conformance.checks import CHECKS
from _quantplug.plugins import registry
from quantplug.conformance import CAPABILITIES, ConformanceProfile, run_conformance
from tests.conformance.kit_backend import write_backend, write_dist
from tests.conftest import EXAMPLE_PLUGIN

REPO = Path(__file__).resolve().parents[2]

#: check name -> what its failure message must say
BROKEN: dict[str, str] = {
    "listed": "get_quantizer() imported rules modules",
    "options": "default 'yes' is not a bool",
    "ops": "claimed but left float",
    "sharing": "mixes different grids",
    "validation": "returns no constraint for any op",
    "untouched": "modified in place",
    "integer-weights": "is not dequantized from a stored integer tensor",
    "lowering": "declared file 'model.bin' not written",
    "deterministic": "saved file 'kit.json' differs",
    "no-leak": "the prepared model",
}


@pytest.fixture(autouse=True)
def _clean_registry() -> Iterator[None]:
    registry.reset_cache()
    yield
    registry.reset_cache()


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in [m for m in sys.modules if m.startswith("kit_")]:
        sys.modules.pop(name, None)


def _register(site: Path, defects: tuple[str, ...] = ()) -> str:
    import importlib

    name = f"kit_{uuid.uuid4().hex[:8]}"
    write_backend(site, name, defects)
    quantplug.register_backend(name, importlib.import_module(name))
    return name


def test_every_check_has_a_broken_backend() -> None:
    assert set(BROKEN) == {c.name for c in CHECKS}


@pytest.mark.parametrize("check", list(BROKEN))
def test_a_backend_broken_for_one_check_fails_it_and_only_it(site: Path, check: str) -> None:
    broken = _register(site, (check,))
    good = _register(site)
    try:
        failed = run_conformance(broken, only=[check])
        passed = run_conformance(good, only=[check])
    finally:
        quantplug.unregister(broken)
        quantplug.unregister(good)
    (result,) = failed.checks
    assert result.status == "fail", failed.format(verbose=True)
    assert any(BROKEN[check] in c.message for c in result.failures), failed.format(verbose=True)
    assert not failed.ok and failed.failed == [check]
    assert passed.ok, passed.format(verbose=True)


def test_the_kit_backend_conforms_and_the_report_is_complete(site: Path) -> None:
    name = _register(site)
    try:
        report = run_conformance(name)
    finally:
        quantplug.unregister(name)
    assert report.ok, report.format(verbose=True)
    assert [c.name for c in report.checks] == [c.name for c in CHECKS]
    ops = next(c for c in report.checks if c.name == "ops")
    assert sorted(c.case for c in ops.cases) == [
        "aten.add.Tensor",
        "aten.conv2d.default",
        "aten.linear.default",
        "aten.relu.default",
    ]
    assert all("SQNR" in c.message for c in ops.cases)
    data = report.to_dict()
    assert data["ok"] and data["failed"] == [] and json.loads(json.dumps(data)) == data


def test_an_unsupported_capability_is_a_skip_with_the_backends_reason(site: Path) -> None:
    from _quantplug.conformance.checks import Session
    from _quantplug.conformance.runner import run_case

    name = _register(site, ("lowering",))
    try:
        profile = ConformanceProfile(unsupported={"lowering": "the compiler ships next quarter"})
        lowering = next(c for c in CHECKS if c.name == "lowering")
        result = run_case(lowering, Session(name, _profile=profile), "")
    finally:
        quantplug.unregister(name)
    assert result.status == "skip" and "the compiler ships next quarter" in result.message
    with pytest.raises(ValueError, match="unknown capabilities"):
        ConformanceProfile(unsupported={"fast": "no"})
    assert set(CAPABILITIES) == {c for check in CHECKS for c in check.requires}


def test_a_claimed_op_the_kit_cannot_sample_fails_unless_excluded(site: Path) -> None:
    from _quantplug.conformance.checks import Session, check_op
    from _quantplug.conformance.runner import run_case

    name = _register(site)
    try:
        op_check = next(c for c in CHECKS if c.name == "ops")
        session = Session(name)
        result = run_case(op_check, session, "aten.my_custom_op.default")
        assert result.status == "fail" and "no sample graph" in result.message
        session._profile = ConformanceProfile(skip_ops={"aten.my_custom_op.default": "tested in our SDK"})
        assert run_case(op_check, session, "aten.my_custom_op.default").status == "skip"
        floor = ConformanceProfile(op_sqnr_floor_db={"aten.relu.default": 200.0})
        session._profile = floor
        with pytest.raises(Exception, match=r"below the floor of 200\.0 dB"):
            check_op(session, "aten.relu.default")
    finally:
        quantplug.unregister(name)


def _cli(
    *args: str, extra_path: Path | None = None, test_site: bool = True, python: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``python [PYTHON] -m quantplug ARGS`` in this environment, ``extra_path`` first on its path;
    without ``test_site`` the environment as installed: the example plugin the test session makes
    visible (``tests/conftest.py``, ``QUANTPLUG_TEST_SITE``) left out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTPLUG_")}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not test_site:
        hidden = {os.environ.get("QUANTPLUG_TEST_SITE", ""), str(EXAMPLE_PLUGIN)}
        paths = [p for p in paths if p not in hidden]
    env["PYTHONPATH"] = os.pathsep.join([*([str(extra_path)] if extra_path else []), str(REPO), *paths])
    return subprocess.run(
        [sys.executable, *python, "-m", "quantplug", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        check=False,
    )


@pytest.mark.parametrize("backend", ["reference", "qnn_htp"])
def test_shipped_backends_conform_as_installed(backend: str) -> None:
    """Without the example plugin, whose ``reference`` extension adds a constraint: what a user
    of quantplug and its two plugins runs."""
    pytest.importorskip(f"quantplug_{backend}")
    listed = _cli("backends", "--json", test_site=False)
    assert listed.returncode == 0, listed.stderr
    names = {b["name"] for b in json.loads(listed.stdout)}
    assert {"reference", "qnn_htp"} <= names and "example_vendor" not in names
    done = _cli("conformance", backend, "--json", test_site=False)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert data["ok"] and data["distribution"] == f"quantplug-{backend.replace('_', '-')}", data
    assert [c["name"] for c in data["checks"] if c["status"] != "pass"] == [], data["checks"]


def test_cli_example_vendor_conforms_with_json() -> None:
    pytest.importorskip("quantplug_example_vendor")
    done = _cli("conformance", "example_vendor", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert (
        data["ok"]
        and data["backend"] == "example_vendor"
        and data["distribution"] == "quantplug-example-vendor"
    )
    assert {c["name"]: c["status"] for c in data["checks"]} == {c.name: "pass" for c in CHECKS}


def test_cli_broken_backend_exits_non_zero_naming_the_failing_checks(tmp_path: Path) -> None:
    # "listed" through the installed path: the fresh interpreter sees its rules imported eagerly
    write_backend(tmp_path, "kit_installed_broken", ("listed", "options", "lowering"))
    write_dist(tmp_path, "kit_installed_broken")
    done = _cli("conformance", "kit_installed_broken", extra_path=tmp_path, python=("-X", "importtime"))
    assert done.returncode == 1, done.stdout + done.stderr
    # the command's process only starts the kit's own, which imports torch and the plugin
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "_quantplug.conformance.isolated" in imported and "torch" not in imported
    last = done.stdout.strip().splitlines()[-1]
    assert "DOES NOT CONFORM (failed: listed, options, lowering)" in last
    assert all(f"FAIL  {check}" in done.stdout for check in ("listed", "options", "lowering"))
    assert "PASS  sharing" in done.stdout
    assert "default 'yes' is not a bool" in done.stdout and BROKEN["listed"] in done.stdout


def test_cli_usage_errors_exit_2() -> None:
    done = _cli("conformance", "no_such_backend")
    assert done.returncode == 2 and "unknown backend 'no_such_backend'" in done.stderr
    done = _cli("conformance", "reference", "--check", "speed")
    assert done.returncode == 2 and "unknown conformance check(s) 'speed'" in done.stderr
    done = _cli("--help")
    assert done.returncode == 0 and "conformance" in done.stdout and "new-backend" in done.stdout


pytest_plugins = ["pytester"]


def test_pytest_plugin_runs_the_kit_as_tests(site: Path, pytester: pytest.Pytester) -> None:
    good = _register(site)
    broken = _register(site, ("options",))
    try:
        pytester.makepyfile(test_own="def test_own():\n    assert True\n")
        result = pytester.runpytest_inprocess(
            f"--quantplug-conformance={good}", "-p", "no:cacheprovider", "-k", "options or listed or own"
        )
        result.assert_outcomes(passed=3)
        pytester.makeini(f"[pytest]\nquantplug_conformance = {broken}\n")
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-k", "options")
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines([f"*{broken} does not conform: options: *default 'yes' is not a bool*"])
        pytester.makeini("[pytest]\n")
        result = pytester.runpytest_inprocess(
            "--quantplug-conformance=no_such_backend", "-p", "no:cacheprovider"
        )
        result.assert_outcomes(passed=1, failed=1)  # one test stands for a backend that cannot load
        result.stdout.fnmatch_lines(["*unknown backend 'no_such_backend'*"])
    finally:
        quantplug.unregister(good)
        quantplug.unregister(broken)


def test_pytest_fixture_returns_the_report(site: Path, pytester: pytest.Pytester) -> None:
    good = _register(site)
    try:
        pytester.makepyfile(
            test_fixture=f"""
def test_kit(quantplug_conformance):
    report = quantplug_conformance({good!r}, only=["options"])
    assert report.ok and report.checks[0].name == "options"
"""
        )
        pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    finally:
        quantplug.unregister(good)
