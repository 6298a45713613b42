"""The conformance kit inside a vendor's own test run (a ``pytest11`` plugin shipped with quantplug).

Name the backend on the command line or in the project's pytest configuration::

    pytest --quantplug-conformance=my_chip

    [tool.pytest.ini_options]
    quantplug_conformance = ["my_chip"]

and every check becomes a test (``quantplug-conformance[my_chip]::ops[aten.linear.default]``): a
failure shows what the backend does wrong, a capability the backend declares unsupported shows
as a skip with its reason, ``-k`` selects checks by name. The ``quantplug_conformance`` fixture
runs the whole kit from a test of your own (``quantplug_conformance("my_chip").ok``).

Without the option this plugin adds nothing and imports nothing but pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest

OPTION = "--quantplug-conformance"
INI = "quantplug_conformance"


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
    parser.addini(INI, type="args", default=[], help="backend names the conformance kit runs against")


def _backends(config: pytest.Config) -> list[str]:
    names = [*config.getoption("quantplug_conformance"), *config.getini(INI)]
    return list(dict.fromkeys(names))


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
        from _quantplug.conformance.runner import run_case

        result = run_case(self.check, _session(self.config, self.backend), self.case)
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


_SESSIONS = pytest.StashKey[dict[str, Any]]()


def _session(config: pytest.Config, backend: str) -> Any:
    """One kit session per backend and test run (it caches exported samples)."""
    from _quantplug.conformance.checks import Session

    sessions = config.stash.setdefault(_SESSIONS, {})
    if backend not in sessions:
        sessions[backend] = Session(backend)
    return sessions[backend]


class ConformanceCollector(pytest.Collector):
    """The checks of one backend."""

    def __init__(self, *, backend: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend = backend

    def collect(self) -> Iterable[pytest.Item]:
        from _quantplug.conformance.checks import CHECKS
        from _quantplug.errors import QuantplugError
        from _quantplug.plugins.registry import load_backend

        try:
            load_backend(self.backend)
        except QuantplugError as exc:  # unknown or broken: one failing test that says so
            yield UnloadableBackend.from_parent(self, name="load", message=str(exc))
            return
        session = _session(self.config, self.backend)
        for check in CHECKS:
            try:
                cases = check.case_ids(session)
            except Exception as exc:
                yield UnloadableBackend.from_parent(
                    self, name=check.name, message=f"{type(exc).__name__}: {exc}"
                )
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
def quantplug_conformance() -> Callable[..., Any]:
    """``quantplug_conformance(name, **run_options)`` runs the kit and returns its report."""
    from _quantplug.conformance.runner import run_conformance

    return run_conformance
