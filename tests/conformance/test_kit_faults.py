"""The kit judges backends as installed, and survives the backends it judges.

* Installed backends are checked in a fresh interpreter from the environment as installed: what
  the test session (or the calling process) registers in-process, puts on ``sys.path`` or sets in
  ``os.environ`` plays no part, from ``run_conformance``, the command and the pytest plugin.
* A hook that calls ``sys.exit``, raises KeyboardInterrupt, ends its process or hangs fails its
  check, naming the hook and the code at fault; the command never exits 0 for it. The user's own
  Ctrl-C still stops the run.
* ``untouched`` finds process-wide state a plugin changes (random generators, torch's defaults,
  threads, the environment), while quantizing and when imported.

The backends are ``kit_backend``'s, with a fault switched on by ``"ACTION@WHERE"``.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import quantplug
from _quantplug.plugins import registry
from quantplug.conformance import ConformanceProfile, run_conformance
from tests.conformance.kit_backend import install, write_backend

REPO = Path(__file__).resolve().parents[2]

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _clean_registry() -> Iterator[None]:
    registry.reset_cache()
    yield
    registry.reset_cache()


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on this process's path and on the path of the processes it starts."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    yield root
    for name in [m for m in sys.modules if m.startswith("kit_")]:
        sys.modules.pop(name, None)


#: the timeout of the tests whose hook hangs (what they wait for, twice over for a hang blocked in
#: native code): the checks run before the hang take a fraction of it (loading the kit's small
#: backend, building its quantizers), on a busy machine too
HANG_TIMEOUT_S = 3


def _name() -> str:
    return f"kit_{uuid.uuid4().hex[:8]}"


def _in_process(site: Path, *defects: str) -> str:
    name = write_backend(site, _name(), defects)
    quantplug.register_backend(name, importlib.import_module(name))
    return name


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTPLUG_")}
    return subprocess.run(
        [sys.executable, "-m", "quantplug", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
        check=False,
    )


def _case(report: object, check: str) -> tuple[str, str]:
    (result,) = [c for c in report.checks if c.name == check]  # type: ignore[attr-defined]
    return result.status, " ".join(c.message for c in result.cases)


# -- as installed -----------------------------------------------------------------------------


class _LoweringUnsupported:
    """An in-process extension: it would make the kit skip ``lowering`` if the kit saw it."""

    @quantplug.hookimpl
    def quantplug_conformance_profile(self, context: object) -> ConformanceProfile:
        return ConformanceProfile(unsupported={"lowering": "only in this process"})


def test_run_conformance_ignores_in_process_extensions_of_an_installed_backend(site: Path) -> None:
    name = install(site, _name())
    quantplug.register_extension(name, _LoweringUnsupported())
    try:
        assert "_LoweringUnsupported" in registry.load_backend(name).extensions  # here, it applies
        report = run_conformance(name, only=["lowering"])
    finally:
        quantplug.unregister(name)
    assert report.distribution == f"quantplug-{name}"
    assert _case(report, "lowering")[0] == "pass", report.format(verbose=True)


def test_an_in_process_backend_is_judged_here_and_said_so(site: Path) -> None:
    name = _in_process(site)
    try:
        report = run_conformance(name, only=["options"])
    finally:
        quantplug.unregister(name)
    assert report.ok and report.distribution is None and "(in-process)" in report.format()


def test_pytest_plugin_judges_the_environment_pytest_started_in(
    site: Path, pytester: pytest.Pytester
) -> None:
    good = install(site, _name())
    broken = install(site, _name(), ("options",))
    # what a test session adds: a "*" extension that fails to import, on sys.path and PYTHONPATH
    # (as tests/conftest.py does for the example plugin), and an in-process extension
    extra = pytester.mkdir("session_site")
    (extra / "kit_session_ext.py").write_text("raise RuntimeError('seen by the kit')\n")
    info = extra / "kit_session_ext-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kit-session-ext\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[quantplug.extensions]\n* = kit_session_ext\n")
    pytester.makeconftest(
        f"""
import os, sys
import quantplug
sys.path.insert(0, {str(extra)!r})
os.environ["PYTHONPATH"] = {str(extra)!r} + os.pathsep + os.environ.get("PYTHONPATH", "")

class Skips:
    @quantplug.hookimpl
    def quantplug_conformance_profile(self, context):
        from quantplug.conformance import ConformanceProfile
        return ConformanceProfile(unsupported={{"lowering": "only in this session"}})

quantplug.register_extension({good!r}, Skips())
"""
    )
    pytester.makepyfile(
        test_own=f"""
import quantplug

def test_the_session_sees_its_additions():
    assert quantplug.list_backends()  # listing imports nothing
    try:
        quantplug.get_quantizer({good!r})
    except quantplug.BackendLoadError as exc:
        assert "seen by the kit" in str(exc)
    else:
        raise AssertionError("the session's '*' extension did not load here")

def test_fixture(quantplug_conformance):
    report = quantplug_conformance({good!r}, only=["options"])
    assert report.ok and report.checks[0].name == "options"
"""
    )
    result = pytester.runpytest_subprocess(
        f"--quantplug-conformance={good}", "-p", "no:cacheprovider", "-k", "options or lowering or own"
    )
    result.assert_outcomes(passed=4)  # options, lowering (not skipped), the two own tests
    pytester.makeini(f"[pytest]\nquantplug_conformance = {broken}\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "options and not own")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*{broken} does not conform: options: *default 'yes' is not a bool*"])


# -- hooks that exit, interrupt or hang ---------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ("exit", "sys.exit(0) was called (hook quantplug_op_constraints of 'backend:"),
        (
            "interrupt",
            "KeyboardInterrupt raised by plugin code, not by the user (hook quantplug_op_constraints",
        ),
    ],
)
def test_a_hook_that_exits_or_interrupts_fails_its_check(site: Path, fault: str, words: str) -> None:
    name = _in_process(site, f"{fault}@quantplug_op_constraints")
    try:
        report = run_conformance(name, only=["options", "validation"])
    finally:
        quantplug.unregister(name)
    status, message = _case(report, "validation")
    assert status == "fail" and words in message and f"{name}.py" in message, message
    assert _case(report, "options")[0] == "pass" and report.failed == ["validation"]


def test_a_hook_that_hangs_times_out_naming_it(site: Path) -> None:
    name = _in_process(site, "hang@quantplug_conformance_profile")  # read first by "validation"
    try:
        report = run_conformance(name, only=["options", "validation"], timeout=HANG_TIMEOUT_S)
    finally:
        quantplug.unregister(name)
    status, message = _case(report, "validation")
    assert status == "fail" and f"timed out: no result after {HANG_TIMEOUT_S} s" in message, message
    assert "hook quantplug_conformance_profile" in message and "in _fault" in message
    assert _case(report, "options")[0] == "pass"


def test_the_users_ctrl_c_stops_the_run(site: Path) -> None:
    name = _in_process(site, "sigint@quantplug_op_constraints")  # SIGINT, as from the terminal
    try:
        with pytest.raises(KeyboardInterrupt):
            run_conformance(name, only=["validation"])
    finally:
        quantplug.unregister(name)


def test_timeout_must_be_seconds_and_the_default_is_one() -> None:
    from _quantplug.cli import conformance as cli
    from _quantplug.conformance import runner

    with pytest.raises(quantplug.OptionError, match="timeout"):
        run_conformance("reference", timeout=0)
    assert cli.DEFAULT_TIMEOUT_S == runner.DEFAULT_TIMEOUT_S  # the command's --help repeats it


def test_cli_a_hook_calling_sys_exit_fails_the_check_not_the_run(site: Path) -> None:
    name = install(site, _name(), ("exit@quantplug_op_constraints",))
    done = _cli("conformance", name, "--check", "options", "--check", "validation")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "PASS  options" in done.stdout and "FAIL  validation" in done.stdout
    assert "sys.exit(0) was called (hook quantplug_op_constraints" in done.stdout
    assert done.stdout.strip().splitlines()[-1].endswith("DOES NOT CONFORM (failed: validation)")


@pytest.mark.parametrize(
    ("fault", "checks", "expected"),
    [
        ("hang", ["lowering"], f"timed out: no result after {HANG_TIMEOUT_S} s"),
        ("hang-blocked", ["lowering"], f"timed out after {HANG_TIMEOUT_S} s in native code and was ended"),
        ("os-exit", ["integer-weights", "lowering"], "exited with code 0"),
    ],
)
def test_cli_a_hook_that_hangs_or_ends_its_process_fails_only_its_check(
    site: Path, fault: str, checks: list[str], expected: str
) -> None:
    """A hang in Python code is interrupted in the kit's process; one blocking the interrupt (as
    native code does) or ending the process (``os._exit(0)``) loses that process, and a new one
    runs the next check. The profile hook is the first code of the backend these checks run."""
    name = install(site, _name(), (f"{fault}@quantplug_conformance_profile",))
    selected = [word for check in checks for word in ("--check", check)]
    done = _cli("conformance", name, *selected, "--json", "--timeout", str(HANG_TIMEOUT_S))
    assert done.returncode == 1, done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert data["failed"] == checks, data
    for check in data["checks"]:
        assert expected in check["summary"], check
        if fault != "os-exit":
            assert f"{name}.py" in check["summary"] and "in _fault" in check["summary"], check


def test_cli_a_plugin_exiting_at_import_is_a_load_error(site: Path) -> None:
    name = install(site, _name(), ("exit@import",))
    done = _cli("conformance", name)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"backend {name!r}" in done.stderr and "importing it called sys.exit(0)" in done.stderr


# -- process-wide state -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ("reseed@write", "torch's global random generator: reseeded or drawn from"),
        ("dtype@write", "torch's default dtype: torch.float32 -> torch.float64"),
        ("threads@write", "torch's intra-op thread count"),
        ("environ@write", "environment: variables KIT_BACKEND_WAS_HERE"),
    ],
)
def test_untouched_finds_process_wide_state_a_plugin_changes(site: Path, fault: str, words: str) -> None:
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    name = _in_process(site, fault)
    try:
        report = run_conformance(name, only=["untouched"])
    finally:
        quantplug.unregister(name)
    status, message = _case(report, "untouched")
    assert status == "fail" and "process-wide state changed by get_quantizer, prepare" in message, message
    assert words in message, message
    # put back for the checks (and tests) that follow
    assert torch.get_default_dtype() == torch.float32 and torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), rng) and "KIT_BACKEND_WAS_HERE" not in os.environ


def test_untouched_finds_state_a_plugin_changes_when_imported(site: Path) -> None:
    name = install(site, _name(), ("reseed@import",))
    report = run_conformance(name, only=["untouched"])
    status, message = _case(report, "untouched")
    assert status == "fail", message
    assert "importing the plugin (get_quantizer in a fresh interpreter) changed process-wide state" in message
    assert "torch's global random generator" in message
