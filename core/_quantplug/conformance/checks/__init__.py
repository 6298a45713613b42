"""The checks of the conformance kit: what a user of any backend relies on.

Each check is a function of a :class:`Session` (one backend, its options and profile) and a case
(an op for the per-op checks, ``""`` otherwise). It returns a message on success and raises
:class:`Failed` or :class:`Skipped` otherwise, so the command line, the pytest plugin and tests
run exactly the same code. Checks needing a capability the backend declares unsupported are
skipped with the backend's reason (``runner.run_case``).

The table names each check's function by module: reading it (the command's own process, which
runs an installed backend in the kit's process) imports neither torch nor the checks; :func:`load`
imports them all, where they run, before the first check's clock starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from _quantplug.conformance.checks.base import Check, Failed, Skipped

if TYPE_CHECKING:
    from _quantplug.conformance.checks.ops import check_op
    from _quantplug.conformance.checks.session import Session
    from _quantplug.conformance.checks.validation import check_validation


def _function(name: str) -> Callable[..., Any]:
    """The function ``name`` of this package's modules (:data:`_LAZY`), imported when first called."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return __getattr__(name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def load() -> tuple[Check, ...]:
    """:data:`CHECKS`, with every check's module imported (torch, quantplug's flow): where the
    checks run, so that no check's timeout pays for the imports."""
    for module in sorted(set(_LAZY.values())):
        importlib.import_module(f"{__name__}.{module}")
    return CHECKS


CHECKS: tuple[Check, ...] = (
    Check(
        "listed",
        "listed without importing the plugin; rules load lazily",
        _function("check_listed"),
    ),
    Check("options", "options resolved or rejected with OptionError", _function("check_options")),
    Check(
        "ops",
        "every claimed op is annotated on a real graph, above the SQNR floor",
        _function("check_op"),
        cases=_function("op_cases"),
    ),
    Check("sharing", "observer groups are consistent", _function("check_sharing")),
    Check(
        "validation",
        "a config the hardware cannot run is reported",
        _function("check_validation"),
        requires=("constraints",),
    ),
    Check(
        "untouched",
        "the caller's program, model and process-wide state are never modified",
        _function("check_untouched"),
    ),
    Check(
        "integer-weights",
        "convert stores weights as integers",
        _function("check_integer_weights"),
        requires=("integer_weights",),
    ),
    Check(
        "lowering",
        "lower() and save() write the declared files",
        _function("check_lowering"),
        requires=("lowering",),
    ),
    Check(
        "deterministic",
        "two runs give identical encodings, outputs and files",
        _function("check_deterministic"),
    ),
    Check("no-leak", "no model is kept alive by the backend", _function("check_no_leak")),
)

#: names read from the modules of the checks when first asked for (every name this package
#: imported from them in 0.1.0)
_LAZY = {
    "Session": "session",
    "check_listed": "discovery",
    "check_options": "discovery",
    "check_deterministic": "flow",
    "check_integer_weights": "flow",
    "check_lowering": "flow",
    "check_no_leak": "flow",
    "check_untouched": "flow",
    "check_op": "ops",
    "op_cases": "ops",
    "check_sharing": "sharing",
    "check_validation": "validation",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = ["CHECKS", "Check", "Failed", "Session", "Skipped", "check_op", "check_validation", "load"]
