"""The backend conformance kit: what every quantplug backend must do for its users.

Run it from the command line (``quantplug conformance NAME [--json]``), from pytest
(``pytest --quantplug-conformance=NAME``, or the ``quantplug_conformance`` ini option; the plugin
ships with quantplug), or from Python::

    from quantplug.conformance import run_conformance
    report = run_conformance("my_chip")
    assert report.ok, report.format()

A backend states what it does not support, and what its artifact contains, in a
:class:`ConformanceProfile` returned from its ``quantplug_conformance_profile`` hook.
"""

from __future__ import annotations

from typing import Any

from quantplug.conformance.profile import CAPABILITIES, ConformanceProfile

__all__ = ["CAPABILITIES", "CHECKS", "ConformanceProfile", "ConformanceReport", "run_conformance"]


def __getattr__(name: str) -> Any:
    """The checks and the runner import torch: only on first use."""
    if name == "run_conformance":
        from quantplug.conformance.runner import run_conformance

        return run_conformance
    if name == "CHECKS":
        from quantplug.conformance.checks import CHECKS

        return CHECKS
    if name == "ConformanceReport":
        from quantplug.conformance.report import ConformanceReport

        return ConformanceReport
    raise AttributeError(f"module 'quantplug.conformance' has no attribute {name!r}")
