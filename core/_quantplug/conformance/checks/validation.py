"""Validation reports a config the hardware cannot run: strict raises, lenient warns."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.fx import GraphModule, Node

import quantplug
from _quantplug.annotation.spec_view import SpecKind, spec_kind
from _quantplug.annotation.specs import Q_ANNOTATION_KEY, QuantizationConfig, QuantizationSpec
from _quantplug.conformance.checks.session import (
    Failed,
    Session,
    Skipped,
)
from _quantplug.errors import ConstraintViolationError, QuantplugError
from _quantplug.graph.op_names import op_name
from _quantplug.meta import RULE_KEY, STATE_KEY
from _quantplug.validation.constraints import OUTPUT

#: grids tried, in order, to break an activation port's ``dtypes`` (int32 and int4 are valid
#: grids that activation ports rarely allow)
_GRIDS = (torch.uint8, torch.int8, torch.uint16, torch.int16, torch.int32, getattr(torch, "int4"))  # noqa: B009


def _violating_config(
    constraints: list[Any], config: QuantizationConfig, ports: set[Any]
) -> tuple[QuantizationConfig, str] | None:
    """A config breaking a constraint on one of ``ports`` (input 0 and/or the output, those the
    node's default annotation quantizes) through the activation specs."""
    for c in constraints:
        for port, pc in c.ports.items():
            if port not in ports:
                continue
            where = "output" if port == OUTPUT else "input 0"
            spec: QuantizationSpec | None = None
            what = ""
            bad = next((d for d in _GRIDS if d not in pc.dtypes), None) if pc.dtypes is not None else None
            if bad is not None:
                spec = QuantizationSpec(dtype=bad, qscheme=torch.per_tensor_affine)
                what = f"{where} dtype {str(bad).removeprefix('torch.')}"
            elif pc.symmetric is not None:
                dtype = sorted(pc.dtypes, key=str)[0] if pc.dtypes else torch.int8
                scheme = torch.per_tensor_affine if pc.symmetric else torch.per_tensor_symmetric
                spec = QuantizationSpec(dtype=dtype, qscheme=scheme)
                what = f"{where} qscheme {str(scheme).removeprefix('torch.')}"
            if spec is None:
                continue
            try:
                bad_config = dataclasses.replace(config, input_activation=spec, output_activation=spec)
            except TypeError:
                bad_config = QuantizationConfig(spec, spec, config.weight, config.bias)
            return bad_config, what
    return None


@contextmanager
def _captured(logger: str) -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger(logger)
    saved = (log.handlers[:], log.level, log.propagate)
    log.handlers[:] = [Handler(logging.WARNING)]  # the kit provokes these: keep them off the console
    log.propagate = False
    log.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        log.handlers[:] = saved[0]
        log.setLevel(saved[1])
        log.propagate = saved[2]


def check_validation(session: Session, case: str) -> str:
    options = session.option_sets()[0]
    q = session.quantizer(options)
    constrained = []
    for op in session.claimed_ops():
        sample = session.sample(op)
        if sample is None or op in session.profile.skip_ops:
            continue
        gm = q.transform_for_annotation(_copy(session.program(sample)))
        q.annotate(gm)
        for node in gm.graph.nodes:
            rule = node.meta.get(RULE_KEY)
            if node.op != "call_function" or rule is None or op_name(node.target) != op:
                continue
            constraints = q.constraints(op, rule.backend_op)
            config = q.config_for(node)
            if not constraints or config is None:
                continue
            constrained.append(op)
            found = _violating_config(constraints, config, _activation_ports(node))
            if found is None:
                continue
            bad_config, what = found
            strict = session.quantizer(options).set_node_name(node.name, bad_config)
            try:
                quantplug.prepare(session.program(sample), strict)
            except ConstraintViolationError as exc:
                named = [v for v in exc.report.violations if v.node == node.name]
                if not named:
                    raise Failed(f"{op}: the violation report names other nodes, not {node.name!r}") from exc
            except QuantplugError as exc:
                raise Failed(
                    f"{op} with {what}: {type(exc).__name__} instead of ConstraintViolationError: {exc}"
                ) from exc
            else:
                raise Failed(
                    f"{op} with {what} breaks the backend's constraint, yet strict prepare() accepted it"
                )
            lenient = session.quantizer(options, strict=False).set_node_name(node.name, bad_config)
            with _captured("quantplug.validation") as records:
                prepared = quantplug.prepare(session.program(sample), lenient)
            report = prepared.meta[STATE_KEY].validation
            if report is None or report.ok:
                raise Failed(
                    f"{op} with {what}: strict=False kept no violation in the prepared model's report"
                )
            if not any(node.name in r.getMessage() for r in records):
                raise Failed(f"{op} with {what}: strict=False logged no warning naming {node.name!r}")
            return (
                f"{op} with {what}: strict prepare raised ConstraintViolationError naming {node.name!r}; "
                "strict=False warned and kept the report"
            )
    if not constrained:
        raise Failed(
            "quantplug_op_constraints returns no constraint for any op the rules claim (check the "
            "rules' backend_op names); declare constraints, or the capability 'constraints' as unsupported"
        )
    raise Skipped(
        f"{len(set(constrained))} constrained op(s), but no dtype or symmetry restriction on an activation "
        "port that a config could break"
    )


def _activation_ports(node: Node) -> set[Any]:
    """Which of input 0 and the output the node's annotation quantizes with a spec of its own
    (plain): a shared, derived or fixed encoding does not follow the node's config, so a
    config cannot break it there (a split's pieces share the split's input encoding)."""
    ann = node.meta.get(Q_ANNOTATION_KEY)
    if ann is None:
        return set()
    ports: set[Any] = set()
    first = next((a for a in node.all_input_nodes), None)
    if first is not None and _plain(ann.input_qspec_map.get(first)):
        ports.add(0)
    if _plain(ann.output_qspec):
        ports.add(OUTPUT)
    return ports


def _plain(spec: Any) -> bool:
    return spec is not None and spec_kind(spec) is SpecKind.PLAIN


def _copy(program: Any) -> GraphModule:
    from _quantplug.graph.working_copy import working_copy

    return working_copy(program)
