"""The checks of the conformance kit: what a user of any backend relies on.

Each check is a function of a :class:`Session` (one backend, its options and profile) and a case
(an op for the per-op checks, ``""`` otherwise). It returns a message on success and raises
:class:`Failed` or :class:`Skipped` otherwise, so the command line, the pytest plugin and tests
run exactly the same code. Checks needing a capability the backend declares unsupported are
skipped with the backend's reason (``runner.run_case``).
"""

from __future__ import annotations

from _quantplug.conformance.checks.discovery import check_listed, check_options
from _quantplug.conformance.checks.flow import (
    check_deterministic,
    check_integer_weights,
    check_lowering,
    check_no_leak,
    check_untouched,
)
from _quantplug.conformance.checks.ops import check_op, op_cases
from _quantplug.conformance.checks.session import Check, Failed, Session, Skipped
from _quantplug.conformance.checks.sharing import check_sharing
from _quantplug.conformance.checks.validation import check_validation

CHECKS: tuple[Check, ...] = (
    Check("listed", "listed without importing the plugin; rules load lazily", check_listed),
    Check("options", "options resolved or rejected with OptionError", check_options),
    Check(
        "ops", "every claimed op is annotated on a real graph, above the SQNR floor", check_op, cases=op_cases
    ),
    Check("sharing", "observer groups are consistent", check_sharing),
    Check(
        "validation",
        "a config the hardware cannot run is reported",
        check_validation,
        requires=("constraints",),
    ),
    Check(
        "untouched",
        "the caller's program, model and process-wide state are never modified",
        check_untouched,
    ),
    Check(
        "integer-weights",
        "convert stores weights as integers",
        check_integer_weights,
        requires=("integer_weights",),
    ),
    Check("lowering", "lower() and save() write the declared files", check_lowering, requires=("lowering",)),
    Check("deterministic", "two runs give identical encodings, outputs and files", check_deterministic),
    Check("no-leak", "no model is kept alive by the backend", check_no_leak),
)

__all__ = ["CHECKS", "Check", "Failed", "Session", "Skipped", "check_op", "check_validation"]
