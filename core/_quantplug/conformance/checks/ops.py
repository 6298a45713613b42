"""Every op the rules claim: annotated on a real graph, converted, above the SQNR floor."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import Node

import quantplug
from _quantplug.annotation.specs import Q_ANNOTATION_KEY
from _quantplug.conformance.checks.session import (
    CALIBRATION_BATCHES,
    Failed,
    Session,
    Skipped,
    case_options,
    options_label,
)
from _quantplug.errors import ConstraintViolationError
from _quantplug.flow.prepare import PreparedState
from _quantplug.graph.op_names import op_name
from _quantplug.meta import FLOAT_REASON_KEY, STATE_KEY


def op_cases(session: Session) -> list[str]:
    sets = session.option_sets()
    ops = session.claimed_ops()
    cases = list(ops)
    for extra in sets[1:]:
        cases.extend(f"{op} @ {options_label(extra)}" for op in ops)
    return cases


def _keys_of(node: Node) -> list[Any]:
    ann = node.meta.get(Q_ANNOTATION_KEY)
    if ann is None:
        return []
    keys: list[Any] = [(a.name, node.name) for a, s in ann.input_qspec_map.items() if s is not None]
    if ann.output_qspec is not None:
        keys.append(node.name)
    return keys


def _has_float_tensor(node: Node) -> bool:
    def is_float(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and v.is_floating_point()

    values = [a.meta.get("val") for a in node.all_input_nodes]
    out = node.meta.get("val")
    values.extend(out if isinstance(out, (tuple, list)) else [out])
    return any(is_float(v) for v in values)


def float_outputs(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result] if result.is_floating_point() else []
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in float_outputs(r)]
    if isinstance(result, dict):
        return [t for r in result.values() for t in float_outputs(r)]
    return []


def sqnr_db(reference: list[torch.Tensor], quantized: list[torch.Tensor]) -> float:
    """Signal-to-quantization-noise ratio of all float outputs together (dB; inf when exact)."""
    if len(reference) != len(quantized):
        raise Failed(f"{len(quantized)} float outputs, the float program has {len(reference)}")
    signal = noise = 0.0
    for r, q in zip(reference, quantized):
        if r.shape != q.shape:
            raise Failed(f"output shape {tuple(q.shape)}, the float program gives {tuple(r.shape)}")
        r64, q64 = r.detach().double(), q.detach().double()
        finite = torch.isfinite(r64)
        if not torch.equal(torch.isfinite(q64), finite):
            raise Failed("the quantized program gives non-finite values where the float one does not")
        signal += float((r64[finite] ** 2).sum())
        noise += float(((r64[finite] - q64[finite]) ** 2).sum())
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def check_op(session: Session, case: str) -> str:
    op, options = case_options(session, case)
    reason = session.profile.skip_ops.get(op)
    if reason is not None:
        raise Skipped(f"excluded by the backend: {reason}")
    sample = session.sample(op)
    if sample is None:
        raise Failed(
            "the kit has no sample graph for this op; give one in ConformanceProfile.samples, "
            "or exclude it with a reason in ConformanceProfile.skip_ops"
        )
    q = session.quantizer(options)
    try:
        prepared = quantplug.prepare(session.program(sample), q)
    except ConstraintViolationError as exc:
        raise Failed(
            f"the default config breaks the backend's own constraints: {exc.report.format().strip()}"
        ) from exc
    state: PreparedState = prepared.meta[STATE_KEY]
    nodes = [n for n in prepared.graph.nodes if n.op == "call_function" and op_name(n.target) == op]
    if not nodes:
        return "rewritten by the backend's passes before annotation (no node left to annotate)"
    float_nodes = [
        n for n in nodes if _has_float_tensor(n) and not any(k in state.group_of for k in _keys_of(n))
    ]
    if float_nodes:
        why = "; ".join(
            f"{n.name}: {n.meta.get(FLOAT_REASON_KEY) or 'its encodings were dropped by observer sharing'}"
            for n in float_nodes
        )
        raise Failed(f"claimed but left float on its sample graph ({why})")
    if not any(_has_float_tensor(n) for n in nodes):
        return "annotated (no float tensor to quantize)"
    with torch.no_grad():
        for seed in range(CALIBRATION_BATCHES):
            prepared(*sample.batch(seed))
        converted = quantplug.convert(prepared)
        if sample.random:
            converted(*sample.batch(0))
            return "annotated and converted (a random op: outputs not compared)"
        expected = float_outputs(sample.model(*sample.batch(0)))
        got = float_outputs(converted(*sample.batch(0)))
    sqnr = sqnr_db(expected, got)
    floor = session.profile.sqnr_floor(op)
    if sqnr < floor:
        raise Failed(f"SQNR {sqnr:.1f} dB is below the floor of {floor:.1f} dB")
    return f"annotated; SQNR {sqnr:.1f} dB (floor {floor:.1f})"
