"""Checking annotations against op constraints, before any observer exists.

Ports are numbered by the order of tensor inputs in the node's flattened arguments (``cat``'s
list counts element by element); the output port is ``"output"``. A shared spec is followed to
the concrete spec it points at, so a view whose output shares its input is checked against the
producer's grid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node

from quantplug.annotation.dtypes import INT2, INT4, UINT2, UINT4, bit_width
from quantplug.annotation.spec_view import SpecKind, is_per_channel, spec_kind, spec_range
from quantplug.annotation.specs import Q_ANNOTATION_KEY, SYMMETRIC_QSCHEMES
from quantplug.plugins.contract import op_name
from quantplug.validation.constraints import OUTPUT, OpConstraint, Port, PortConstraint
from quantplug.validation.report import ValidationReport, Violation

ConstraintLookup = Callable[[str, "str | None"], Sequence[OpConstraint]]


def tensor_inputs(node: Node) -> list[Node]:
    """The node's tensor inputs in port order (flattening list arguments)."""
    found: list[Node] = []

    def visit(a: Any) -> None:
        if isinstance(a, Node):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)

    for a in node.args:
        visit(a)
    return found


class _SpecResolver:
    """Follows shared specs to the concrete one, over all annotations of a graph."""

    def __init__(self, gm: GraphModule) -> None:
        self.by_key: dict[Any, Any] = {}
        for n in gm.graph.nodes:
            ann = n.meta.get(Q_ANNOTATION_KEY)
            if ann is None:
                continue
            for arg, spec in ann.input_qspec_map.items():
                if spec is not None:
                    self.by_key[(arg, n)] = spec
            if ann.output_qspec is not None:
                self.by_key[n] = ann.output_qspec

    def concrete(self, spec: Any) -> Any:
        seen = set()
        while spec is not None and spec_kind(spec) is SpecKind.SHARED:
            target = spec.edge_or_node
            key = (target[0], target[1]) if isinstance(target, tuple) else target
            if id(spec) in seen:
                return None
            seen.add(id(spec))
            spec = self.by_key.get(key)
        return spec


def _fmt_dtype(d: torch.dtype | None) -> str:
    return "float" if d is None else str(d).removeprefix("torch.")


def _check_port(pc: PortConstraint, spec: Any) -> list[tuple[str, str, str]]:
    """(rule, expected, actual) for each way ``spec`` breaks ``pc``.

    An unquantized port is not checked: which nodes stay float is a coverage matter, reported by
    ``Quantizer.coverage``, not a grid mismatch.
    """
    problems: list[tuple[str, str, str]] = []
    if spec is None:
        return problems
    kind = spec_kind(spec)
    dtype = spec.dtype
    if pc.dtypes is not None:
        allowed = set(pc.dtypes)
        qmin, qmax = spec_range(spec)
        bits = bit_width(dtype, qmin, qmax) if dtype in _BIT_DTYPES else None
        ok = dtype in allowed or any(_narrowed_match(d, dtype, bits) for d in allowed)
        if not ok:
            problems.append(
                (
                    "dtype",
                    " or ".join(sorted(_fmt_dtype(d) for d in pc.dtypes)),
                    f"{_fmt_dtype(dtype)}[{qmin},{qmax}]",
                )
            )
    qscheme = getattr(spec, "qscheme", None)
    if pc.symmetric is True and kind is not SpecKind.FIXED and qscheme not in SYMMETRIC_QSCHEMES:
        problems.append(("symmetric", "symmetric qscheme", str(qscheme)))
    if pc.symmetric is False and qscheme in SYMMETRIC_QSCHEMES:
        problems.append(("asymmetric", "affine qscheme", str(qscheme)))
    per_block = getattr(spec, "block_size", None) is not None
    if pc.per_tensor_only and (is_per_channel(spec) or per_block):
        problems.append(
            ("per-tensor only", "per-tensor encoding", "per-block" if per_block else "per-channel")
        )
    if pc.axes is not None and is_per_channel(spec):
        axis = getattr(spec, "ch_axis", None)
        if axis not in pc.axes:
            problems.append(("channel axis", f"axis in {sorted(pc.axes)}", f"axis {axis}"))
    expected_fixed: tuple[float, int] | None = None
    if pc.fixed_scale_fn is not None:
        expected_fixed = pc.fixed_scale_fn(*spec_range(spec))
    elif pc.fixed_scale is not None:
        expected_fixed = (pc.fixed_scale, pc.fixed_zero_point or 0)
    if expected_fixed is not None:
        scale, zp = getattr(spec, "scale", None), getattr(spec, "zero_point", None)
        if (
            kind is not SpecKind.FIXED
            or scale is None
            or abs(float(scale) - expected_fixed[0]) > 1e-12 * max(1.0, expected_fixed[0])
            or zp is None
            or int(zp) != int(expected_fixed[1])
        ):
            actual = f"scale={scale}, zero_point={zp}" if kind is SpecKind.FIXED else f"{kind.value} spec"
            problems.append(
                ("fixed encoding", f"scale={expected_fixed[0]:.10g}, zero_point={expected_fixed[1]}", actual)
            )
    if pc.zero_point_zero and kind is not SpecKind.FIXED and qscheme not in SYMMETRIC_QSCHEMES:
        problems.append(("zero offset", "symmetric encoding (zero point 0)", str(qscheme)))
    return problems


_BIT_DTYPES = (
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.uint16,
    INT4,
    UINT4,
    INT2,
    UINT2,
)
_NARROW = {
    INT4: (torch.int8, 4),
    UINT4: (torch.uint8, 4),
    INT2: (torch.int8, 2),
    UINT2: (torch.uint8, 2),
}


def _narrowed_match(allowed: torch.dtype, dtype: torch.dtype, bits: int | None) -> bool:
    """An int8 container with a 4-bit range satisfies an allowed ``torch.int4`` (PT2E's idiom)."""
    if allowed in _NARROW:
        container, width = _NARROW[allowed]
        return dtype == container and bits is not None and bits <= width
    return False


def validate_graph(
    gm: GraphModule,
    lookup: ConstraintLookup,
    backend_ops: Mapping[str, str | None],
    *,
    arch: int | None = None,
) -> ValidationReport:
    """Check every annotated node whose op has a rule against the backend's constraints.

    Args:
        gm: the annotated graph.
        lookup: ``(op, backend_op) -> constraints`` (the backend hook, cached by the caller).
        backend_ops: ATen op name -> backend op name, for ops with a rule.
        arch: the target architecture, for ``ArchRequirement`` gates (None: gates are skipped).
    """
    report = ValidationReport()
    resolver = _SpecResolver(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        ann = node.meta.get(Q_ANNOTATION_KEY)
        if ann is None:
            continue
        op = op_name(node.target)
        if op not in backend_ops:
            continue
        backend_op = backend_ops[op]
        constraints = lookup(op, backend_op)
        if not constraints:
            report.unconstrained_ops.add(op)
            continue
        report.checked_nodes += 1
        inputs = tensor_inputs(node)
        port_specs: dict[Port, Any] = {}
        raw: dict[Port, Any] = {}
        for index, arg in enumerate(inputs):
            if arg in ann.input_qspec_map and index not in raw:
                raw[index] = ann.input_qspec_map[arg]
                port_specs[index] = resolver.concrete(raw[index])
        raw[OUTPUT] = ann.output_qspec
        port_specs[OUTPUT] = resolver.concrete(ann.output_qspec)

        def add(
            port: Port,
            rule: str,
            expected: str,
            actual: str,
            c: OpConstraint,
            node: Node = node,
            op: str = op,
            backend_op: str | None = backend_op,
        ) -> None:
            report.violations.append(
                Violation(
                    node=node.name,
                    op=op,
                    backend_op=backend_op,
                    port="output" if port == OUTPUT else f"input {port}",
                    expected=expected,
                    actual=actual,
                    rule=rule,
                )
            )

        for c in constraints:
            for port, pc in c.ports.items():
                for rule, expected, actual in _check_port(pc, port_specs.get(port)):
                    add(port, rule, expected, actual, c)
            if c.must_share_input_output and raw.get(OUTPUT) is not None and inputs:
                out = raw[OUTPUT]
                first = inputs[0]
                shares = spec_kind(out) is SpecKind.SHARED and out.edge_or_node in (first, (first, node))
                if not shares:
                    add(
                        OUTPUT,
                        "must share input encoding",
                        f"SharedQuantizationSpec of input {first.name!r}",
                        f"{spec_kind(out).value} spec",
                        c,
                    )
            if arch is not None:
                for req in c.arch:
                    if arch < req.min_arch and (req.when is None or req.when(port_specs)):
                        add(
                            OUTPUT,
                            "architecture",
                            f"arch >= {req.min_arch} ({req.reason})",
                            f"arch {arch}",
                            c,
                        )
    return report
