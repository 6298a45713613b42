"""Checking annotations against op constraints: the torch-facing side of validation.

Ports are numbered by the order of tensor inputs in the node's flattened arguments (``cat``'s
list counts element by element); the output port is ``"output"``. A shared spec is followed to
the concrete spec it points at, so a view whose output shares its input is checked against the
producer's grid.

At prepare, :func:`validate_graph` checks each port and, given the sharing groups, each relation
(``relations.check_static``); :func:`relation_merges` turns ``enforce="share"`` relations into
sharing merges; :func:`calibrated_plan` keeps, as plain data, what must be checked again on the
calibrated encodings at convert (``calibrated.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from _quantplug.annotation.dtypes import INT2, INT4, UINT2, UINT4, bit_width
from _quantplug.annotation.spec_view import SpecKind, is_per_channel, spec_kind, spec_range, spec_signature
from _quantplug.annotation.specs import Q_ANNOTATION_KEY, SYMMETRIC_QSCHEMES
from _quantplug.graph.op_names import op_name
from _quantplug.validation.constraints import OUTPUT, OpConstraint, Port, PortConstraint, PortRelation
from _quantplug.validation.relations import (
    Encoding,
    PortFacts,
    Problem,
    check_port_values,
    check_static,
    port_label,
    share_merges,
)
from _quantplug.validation.report import ValidationReport, Violation

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

    def __init__(self, graph: Graph) -> None:
        self.by_key: dict[Any, Any] = {}
        for n in graph.nodes:
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


@dataclass
class _NodePorts:
    """One annotated node's ports: the spec each carries (raw and concrete) and its sharing key."""

    node: Node
    inputs: list[Node]
    raw: dict[Port, Any]
    concrete: dict[Port, Any]
    keys: dict[Port, Hashable]


def _node_ports(node: Node, ann: Any, resolver: _SpecResolver) -> _NodePorts:
    inputs = tensor_inputs(node)
    raw: dict[Port, Any] = {}
    keys: dict[Port, Hashable] = {}
    for index, arg in enumerate(inputs):
        if arg in ann.input_qspec_map and index not in raw:
            raw[index] = ann.input_qspec_map[arg]
            if raw[index] is not None:
                keys[index] = (arg.name, node.name)
    raw[OUTPUT] = ann.output_qspec
    if ann.output_qspec is not None:
        keys[OUTPUT] = node.name
    concrete = {port: resolver.concrete(spec) for port, spec in raw.items()}
    return _NodePorts(node, inputs, raw, concrete, keys)


def _constrained_nodes(
    graph: Graph,
    lookup: ConstraintLookup,
    backend_ops: Mapping[str, str | None],
    report: ValidationReport | None = None,
) -> list[tuple[Node, Any, str, str | None, Sequence[OpConstraint]]]:
    """(node, annotation, op, backend_op, constraints) for each annotated node with constraints."""
    found = []
    for node in graph.nodes:
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
            if report is not None:
                report.unconstrained_ops.add(op)
            continue
        found.append((node, ann, op, backend_op, constraints))
    return found


def port_facts(spec: Any, group: int | None, group_of: Mapping[Any, int] | None) -> PortFacts:
    """The facts :func:`relations.check_static` needs about one port's concrete spec."""
    kind = spec_kind(spec)
    qmin, qmax = spec_range(spec)
    grid = (_fmt_dtype(spec.dtype), qmin, qmax)
    if getattr(spec, "is_dynamic", False):
        return PortFacts(group, "dynamic", grid)
    if kind is SpecKind.FIXED:
        encoding = Encoding((float(spec.scale),), (int(spec.zero_point),), grid[0], qmin, qmax)
        return PortFacts(group, "fixed", grid, encoding=encoding)
    if kind is SpecKind.DERIVED:
        sources: set[int] = set()
        for source in spec.derived_from:
            key = (
                (source[0].name, source[1].name)
                if isinstance(source, tuple)
                else getattr(source, "name", None)
            )
            gid = None if group_of is None else group_of.get(key)
            if gid is not None:
                sources.add(gid)
        return PortFacts(group, "derived", grid, derived_from=frozenset(sources))
    return PortFacts(group, "plain", grid)


def violation_of(
    node: str, op: str, backend_op: str | None, problem: Problem, *, stage: str, detail: str
) -> Violation:
    """A report entry for a problem found on ``node``."""
    return Violation(
        node=node,
        op=op,
        backend_op=backend_op,
        port=problem.ports,
        expected=problem.expected,
        actual=problem.actual,
        rule=problem.rule,
        stage=stage,
        detail=detail,
    )


def _detail(description: str, c: OpConstraint) -> str:
    parts = [description] if description else []
    if c.source and c.source != "built-in":
        parts.append(f"source: {c.source}")
    return "; ".join(parts)


def validate_graph(
    gm: GraphModule,
    lookup: ConstraintLookup,
    backend_ops: Mapping[str, str | None],
    *,
    arch: int | None = None,
    sharing: Mapping[Any, int] | None = None,
) -> ValidationReport:
    """Check every annotated node whose op has a rule against the backend's constraints.

    Args:
        gm: the annotated graph.
        lookup: ``(op, backend_op) -> constraints`` (the backend hook, cached by the caller).
        backend_ops: ATen op name -> backend op name, for ops with a rule.
        arch: the target architecture, for ``ArchRequirement`` gates (None: gates are skipped).
        sharing: key -> sharing group, once resolved; relations between ports that depend on the
            groups (same scale, same encoding) are checked only when it is given. A key missing
            from it (dropped by a backend's sharing hook) counts as unquantized.
    """
    report = ValidationReport()
    resolver = _SpecResolver(gm.graph)
    for node, ann, op, backend_op, constraints in _constrained_nodes(gm.graph, lookup, backend_ops, report):
        report.checked_nodes += 1
        ports = _node_ports(node, ann, resolver)

        def add(
            problem: Problem, detail: str, node: Node = node, op: str = op, bop: str | None = backend_op
        ) -> None:
            report.violations.append(
                violation_of(node.name, op, bop, problem, stage="prepare", detail=detail)
            )

        for c in constraints:
            for port, pc in c.ports.items():
                spec = ports.concrete.get(port)
                for rule, expected, actual in _check_port(pc, spec):
                    add(Problem(rule, port_label(port), expected, actual), _detail(pc.description, c))
                if spec is not None and spec_kind(spec) is SpecKind.FIXED:
                    facts = port_facts(spec, None, None)
                    if facts.encoding is not None:
                        for problem in check_port_values(
                            port, facts.encoding, pc.scale_range, pc.zero_point_range
                        ):
                            add(problem, _detail(pc.description, c))
            if c.must_share_input_output and ports.raw.get(OUTPUT) is not None and ports.inputs:
                out = ports.raw[OUTPUT]
                first = ports.inputs[0]
                shares = spec_kind(out) is SpecKind.SHARED and out.edge_or_node in (first, (first, node))
                if not shares:
                    add(
                        Problem(
                            "must share input encoding",
                            "output",
                            f"SharedQuantizationSpec of input {first.name!r}",
                            f"{spec_kind(out).value} spec",
                        ),
                        _detail("", c),
                    )
            if c.relations:
                facts_by_port = _facts_by_port(ports, sharing)
                for relation in c.relations:
                    for problem in check_static(relation, facts_by_port):
                        add(problem, _detail(relation.description, c))
            if arch is not None:
                for req in c.arch:
                    if arch < req.min_arch and (req.when is None or req.when(ports.concrete)):
                        add(
                            Problem(
                                "architecture",
                                "output",
                                f"arch >= {req.min_arch} ({req.reason})",
                                f"arch {arch}",
                            ),
                            _detail("", c),
                        )
    return report


def _facts_by_port(ports: _NodePorts, sharing: Mapping[Any, int] | None) -> dict[Port, PortFacts]:
    facts: dict[Port, PortFacts] = {}
    for port, key in ports.keys.items():
        spec = ports.concrete.get(port)
        if spec is None:
            continue
        if sharing is not None and key not in sharing:
            continue  # dropped by the backend's sharing: the port stays float
        facts[port] = port_facts(spec, None if sharing is None else sharing[key], sharing)
    return facts


def relation_merges(
    graph: Graph, lookup: ConstraintLookup, backend_ops: Mapping[str, str | None]
) -> list[tuple[Hashable, Hashable]]:
    """Sharing merges requested by ``enforce="share"`` relations, over every constrained node."""
    merges: list[tuple[Hashable, Hashable]] = []
    resolver: _SpecResolver | None = None
    for node, ann, _op, _bop, constraints in _constrained_nodes(graph, lookup, backend_ops):
        relations = [r for c in constraints for r in c.relations if r.enforce == "share"]
        if not relations:
            continue
        if resolver is None:
            resolver = _SpecResolver(graph)
        ports = _node_ports(node, ann, resolver)
        signatures = {
            port: _signature(ports.concrete[port])
            for port in ports.keys
            if ports.concrete.get(port) is not None
        }
        keys = {port: key for port, key in ports.keys.items() if port in signatures}
        for relation in relations:
            merges.extend(share_merges(relation, keys, signatures))
    return merges


def _signature(spec: Any) -> Hashable:
    """What the resolution compares; a derived spec never merges (its qparams are its sources')."""
    return spec_signature(spec) if spec_kind(spec) is not SpecKind.DERIVED else ("derived", object())


# --- what convert checks again, as plain data ----------------------------------------------------


@dataclass(frozen=True)
class NodeValueChecks:
    """One node's checks on calibrated encodings: its ports' groups, port limits, relations."""

    node: str
    op: str
    backend_op: str | None
    groups: Mapping[Port, int]
    limits: tuple[tuple[Port, tuple[float, float] | None, tuple[int, int] | None, str], ...] = ()
    relations: tuple[tuple[PortRelation, str], ...] = ()


@dataclass
class CalibratedPlan:
    """Everything convert checks on calibrated encodings (no graph objects: it survives copies)."""

    strict: bool = True
    nodes: list[NodeValueChecks] = field(default_factory=list)


def calibrated_plan(
    graph: Graph,
    lookup: ConstraintLookup,
    backend_ops: Mapping[str, str | None],
    group_of: Mapping[Any, int],
    *,
    strict: bool,
) -> CalibratedPlan:
    """The value checks (scale/zero-point limits, relations) of every constrained node."""
    plan = CalibratedPlan(strict=strict)
    resolver: _SpecResolver | None = None
    for node, ann, op, backend_op, constraints in _constrained_nodes(graph, lookup, backend_ops):
        limits = [
            (port, pc.scale_range, pc.zero_point_range, _detail(pc.description, c))
            for c in constraints
            for port, pc in c.ports.items()
            if pc.scale_range is not None or pc.zero_point_range is not None
        ]
        relations = [(r, _detail(r.description, c)) for c in constraints for r in c.relations]
        if not limits and not relations:
            continue
        if resolver is None:
            resolver = _SpecResolver(graph)
        ports = _node_ports(node, ann, resolver)
        groups = {port: group_of[key] for port, key in ports.keys.items() if key in group_of}
        plan.nodes.append(NodeValueChecks(node.name, op, backend_op, groups, tuple(limits), tuple(relations)))
    return plan
