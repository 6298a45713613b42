"""The conformance kit inside a vendor's own test run (a ``pytest11`` plugin shipped with quantplug).

Name the backend on the command line or in the project's pytest configuration::

    pytest --quantplug-conformance=my_chip

    [tool.pytest.ini_options]
    quantplug_conformance = ["my_chip"]

and every check becomes a test (``quantplug-conformance[my_chip]::ops[aten.linear.default]``): a
failure shows what the backend does wrong, a capability the backend declares unsupported shows
as a skip with its reason, ``-k`` selects checks by name. The ``quantplug_conformance`` fixture
runs the whole kit from a test of your own (``quantplug_conformance("my_chip").ok``).

The kit judges the backend as installed, as ``quantplug conformance`` does: the checks run in a
fresh interpreter started from the environment pytest was started in (read when this plugin is
loaded, before any ``conftest.py``), so nothing the test session registers in-process, puts on
``sys.path`` or sets in ``os.environ`` reaches them. A backend registered in-process exists only
in this process and is checked here. ``--quantplug-conformance-timeout`` (or the ini option of
the same name) sets the seconds each check may run.

Without the option this plugin adds nothing and imports nothing but pytest.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from typing import Any

import pytest

OPTION = "--quantplug-conformance"
INI = "quantplug_conformance"
TIMEOUT_INI = "quantplug_conformance_timeout"

#: the environment pytest was started in: the one the kit judges installed backends in
ENVIRON_AT_START: dict[str, str] = dict(os.environ)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("quantplug", "quantplug backend conformance")
    group.addoption(
        OPTION,
        action="append",
        default=[],
        metavar="NAME",
        dest="quantplug_conformance",
        help="run quantplug's conformance kit against backend NAME, one test per check (repeatable)",
    )
    group.addoption(
        OPTION + "-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        dest="quantplug_conformance_timeout",
        help="seconds each conformance check may run before it fails as hung (default: 600)",
    )
    parser.addini(INI, type="args", default=[], help="backend names the conformance kit runs against")
    parser.addini(TIMEOUT_INI, default="", help="seconds each conformance check may run (default: 600)")


def _backends(config: pytest.Config) -> list[str]:
    names = [*config.getoption("quantplug_conformance"), *config.getini(INI)]
    return list(dict.fromkeys(names))


def _timeout(config: pytest.Config) -> float:
    from _quantplug.conformance.runner import DEFAULT_TIMEOUT_S

    given = config.getoption("quantplug_conformance_timeout")
    if given is None:
        given = config.getini(TIMEOUT_INI) or DEFAULT_TIMEOUT_S
    return float(given)


class ConformanceFailure(Exception):
    """A check failed: its message is the report."""


class ConformanceItem(pytest.Item):
    """One case of one check against one backend."""

    def __init__(self, *, backend: str, check: Any, case: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.check = check
        self.case = case

    def runtest(self) -> None:
        from _quantplug.conformance.report import FAIL, SKIP

        result = _results(self.session, self.config, self.backend).get((self.check.name, self.case))
        if result is None:
            raise ConformanceFailure("the kit reported no result for this case")
        if result.status == SKIP:
            pytest.skip(result.message)
        if result.status == FAIL:
            raise ConformanceFailure(result.message)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, ConformanceFailure):
            return f"{self.backend} does not conform: {self.check.name}: {excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[str, int | None, str]:
        return f"quantplug-conformance[{self.backend}]", None, self.name


_RESULTS = pytest.StashKey[dict[str, dict[tuple[str, str], Any]]]()


def _results(session: pytest.Session, config: pytest.Config, backend: str) -> dict[tuple[str, str], Any]:
    """Every result of ``backend``, ``(check, case)`` -> CaseResult: one kit run per backend and
    test session, of the checks its selected items need."""
    from _quantplug.conformance.runner import judge

    cache = config.stash.setdefault(_RESULTS, {})
    if backend not in cache:
        checks = list(
            dict.fromkeys(
                i.check.name for i in session.items if isinstance(i, ConformanceItem) and i.backend == backend
            )
        )
        report = judge(backend, only=checks, timeout=_timeout(config), environ=ENVIRON_AT_START)
        cache[backend] = {
            (check.name, case.case if case.case != check.name else ""): case
            for check in report.checks
            for case in check.cases
        }
    return cache[backend]


class ConformanceCollector(pytest.Collector):
    """The checks of one backend."""

    def __init__(self, *, backend: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend = backend

    def collect(self) -> Iterable[pytest.Item]:
        from _quantplug.conformance.runner import list_cases
        from _quantplug.errors import QuantplugError

        try:
            listed = list_cases(self.backend, timeout=_timeout(self.config), environ=ENVIRON_AT_START)
        except QuantplugError as exc:  # unknown or broken: one failing test that says so
            yield UnloadableBackend.from_parent(self, name="load", message=str(exc))
            return
        for check, cases in listed:
            if isinstance(cases, str):  # the cases could not be listed: why
                yield UnloadableBackend.from_parent(self, name=check.name, message=cases)
                continue
            for case in cases:
                name = f"{check.name}[{case}]" if case else check.name
                yield ConformanceItem.from_parent(
                    self, name=name, backend=self.backend, check=check, case=case
                )


class UnloadableBackend(pytest.Item):
    """Stands for checks that could not even be listed (the backend fails to load)."""

    def __init__(self, *, message: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.message = message

    def runtest(self) -> None:
        raise ConformanceFailure(self.message)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        return str(excinfo.value)

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "quantplug-conformance", None, self.name


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    for backend in _backends(config):
        collector = ConformanceCollector.from_parent(
            session, name=f"quantplug-conformance[{backend}]", backend=backend
        )
        items.extend(collector.collect())


@pytest.fixture
def quantplug_conformance(pytestconfig: pytest.Config) -> Callable[..., Any]:
    """``quantplug_conformance(name, **run_options)`` runs the kit (as installed: in the
    environment pytest started with) and returns its report."""
    from _quantplug.conformance.runner import judge

    return functools.partial(judge, timeout=_timeout(pytestconfig), environ=ENVIRON_AT_START)
