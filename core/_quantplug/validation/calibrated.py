"""Constraints checked again at convert, on the calibrated encodings of every sharing group.

``prepare`` records what to check as plain data (:class:`~_quantplug.validation.engine.CalibratedPlan`:
per node, its ports' sharing groups, port limits and relations); ``convert`` computes each
group's qparams once and calls :func:`check_calibrated`, which turns them into
:class:`~_quantplug.validation.relations.Encoding` values and runs the pure checks of
``relations.py``. The result follows the quantizer's ``strict`` setting, as at prepare.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from _quantplug.meta import CALIBRATED_REPORT_KEY as CALIBRATED_REPORT_KEY  # here since 0.1.0
from _quantplug.validation.engine import CalibratedPlan, violation_of
from _quantplug.validation.relations import Encoding, check_port_values, check_values
from _quantplug.validation.report import ValidationReport

#: key of the calibrated validation report in the converted program's ``meta``


def encoding_of(qparams: Any) -> Encoding | None:
    """A group's qparams (``flow.convert.QParams``) as plain values; None when dynamic."""
    if qparams.granularity in ("dynamic", "token"):
        return None
    scale = tuple(float(s) for s in qparams.scale.reshape(-1).tolist())
    zero_point = tuple(int(z) for z in qparams.zero_point.reshape(-1).tolist())
    dtype = str(qparams.dtype).removeprefix("torch.")
    return Encoding(scale, zero_point, dtype, int(qparams.quant_min), int(qparams.quant_max))


def check_encodings(plan: CalibratedPlan, encodings: Mapping[int, Encoding | None]) -> ValidationReport:
    """Every planned check on the groups' encodings (pure: group id -> encoding in, report out)."""
    report = ValidationReport()
    for checks in plan.nodes:
        report.checked_nodes += 1
        by_port = {
            port: enc for port, gid in checks.groups.items() if (enc := encodings.get(gid)) is not None
        }
        found = [
            (problem, detail)
            for port, scale_range, zp_range, detail in checks.limits
            if port in by_port
            for problem in check_port_values(port, by_port[port], scale_range, zp_range)
        ]
        found += [
            (problem, detail)
            for relation, detail in checks.relations
            for problem in check_values(relation, by_port)
        ]
        report.violations.extend(
            violation_of(checks.node, checks.op, checks.backend_op, problem, stage="convert", detail=detail)
            for problem, detail in found
        )
    return report


def check_calibrated(plan: CalibratedPlan | None, qparams: Mapping[int, Any]) -> ValidationReport | None:
    """The calibrated check of a prepared model's plan; raises in strict mode, warns otherwise."""
    if plan is None or not plan.nodes:
        return None
    report = check_encodings(plan, {gid: encoding_of(qp) for gid, qp in qparams.items()})
    return report.enforce(plan.strict)
