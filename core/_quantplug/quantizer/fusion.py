"""Fusion the core understands: a producer and the op that runs inside its kernel.

A conv followed by a relu often runs as one kernel: no encoding exists between them, only the
relu's output is quantized. A backend declares such pairs as :class:`FusionPattern` data (hook
``quantplug_fusion_patterns``); the core then decides, from the configs the user's overrides
select for *both* nodes, what each node becomes:

* both quantized: fused. The head's output and the tail's input from it carry no encoding (the
  core removes them if a rule wrote them); only the tail's output is quantized;
* the tail kept float (``set_node_name("relu", None)``, or no rule for it): the pattern cannot
  run fused, and the backend's ``when_tail_float`` says what runs instead: ``"quantize_head"``
  (the head alone, its output quantized) or ``"float"`` (the whole pattern float);
* the head kept float: no fusion; the tail is annotated on its own.

A pattern may carry a condition (``when``): the pair fuses only where it holds, on the nodes and
the options (a hardtanh that fuses only when its minimum is 0, no fusion at 16-bit symmetric
activations). A pair whose condition fails is no pattern: each node is annotated on its own.

Rules read the decision with :func:`fused_tail` / :func:`fused_head`, and ``coverage()``
reports it. :func:`plan_fusions` is the pure decision over names and op names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch.fx import Graph, Node

from _quantplug.annotation.spec_view import SpecKind, spec_kind
from _quantplug.annotation.specs import get_annotation
from _quantplug.graph.op_names import op_name
from _quantplug.meta import FUSED_HEAD_KEY, FUSED_TAIL_KEY

if TYPE_CHECKING:
    from _quantplug.quantizer.context import BackendContext

#: a pattern's condition: ``when(head, tail, context)``, the two nodes and the backend's context
FusionCondition = Callable[[Node, Node, "BackendContext"], bool]

#: node meta: on a fused head, the name of its tail; on a fused tail, the name of its head

#: what runs when the user keeps a pattern's tail float
WHEN_TAIL_FLOAT = ("quantize_head", "float")


@dataclass(frozen=True)
class FusionPattern:
    """A head op whose only consumer, a tail op, runs in the same kernel.

    ``heads`` and ``tails`` take op names or overloads (as ``RulesModule``). The pair matches
    when the head's output has exactly one user, of a tail op, reading it as its first input.
    ``when_tail_float`` is the fallback when the tail stays float: ``"quantize_head"`` quantizes
    the head's output instead (the head runs alone); ``"float"`` keeps the head float too (the
    hardware only has the fused kernel). ``when(head, tail, context)``, if given, must hold for a
    pair to match (``context.config_for(node)`` gives a node's config, ``context.options`` the
    options); it is called while annotating, on the graph being annotated.
    """

    heads: frozenset[str]
    tails: frozenset[str]
    when_tail_float: str = "quantize_head"
    name: str = ""
    when: FusionCondition | None = field(default=None, compare=False)

    def __init__(
        self,
        heads: Iterable[Any],
        tails: Iterable[Any],
        *,
        when_tail_float: str = "quantize_head",
        name: str = "",
        when: FusionCondition | None = None,
    ) -> None:
        if when_tail_float not in WHEN_TAIL_FLOAT:
            raise ValueError(
                f"FusionPattern.when_tail_float must be one of {WHEN_TAIL_FLOAT}, got {when_tail_float!r}"
            )
        object.__setattr__(self, "heads", frozenset(op_name(o) for o in heads))
        object.__setattr__(self, "tails", frozenset(op_name(o) for o in tails))
        object.__setattr__(self, "when_tail_float", when_tail_float)
        object.__setattr__(self, "name", name)
        if when is not None and not callable(when):
            raise ValueError(f"FusionPattern.when must be callable(head, tail, context), got {when!r}")
        object.__setattr__(self, "when", when)
        if not self.heads or not self.tails:
            raise ValueError("FusionPattern needs at least one head op and one tail op")


@dataclass(frozen=True)
class OpNode:
    """What fusion planning needs of a node: its name, op, users and first tensor input."""

    name: str
    op: str
    users: tuple[str, ...]
    first_input: str | None


@dataclass(frozen=True)
class FusionPlan:
    """The decision for every matched pair (head name -> tail name)."""

    fused: Mapping[str, str] = field(default_factory=dict)
    #: the tail stays float and the backend declares the whole pattern float
    float_heads: Mapping[str, str] = field(default_factory=dict)
    #: the tail stays float; the head runs alone with its output quantized
    split: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.fused or self.float_heads or self.split)


def plan_fusions(
    nodes: Sequence[OpNode],
    patterns: Sequence[FusionPattern],
    quantized: Callable[[str], bool],
    holds: Callable[[FusionPattern, str, str], bool] | None = None,
) -> FusionPlan:
    """Decide every head/tail pair of a graph (``nodes`` in graph order).

    ``quantized(name)`` says whether the user's configs (and the backend's rules) quantize a
    node on its own; ``holds(pattern, head, tail)`` whether a conditional pattern's condition
    holds on a pair (``FusionPattern.when``; unconditional patterns always hold). Pairs are
    decided from the end of the graph, so a tail that is itself a head made float by its own
    tail counts as float. When several patterns match a head, the last declared wins (an
    extension's pattern overrides the backend's).
    """
    by_name = {n.name: n for n in nodes}
    fused: dict[str, str] = {}
    float_heads: dict[str, str] = {}
    split: dict[str, str] = {}
    for head in reversed(nodes):
        if len(head.users) != 1:
            continue
        tail = by_name.get(head.users[0])
        if tail is None or tail.first_input != head.name:
            continue
        pattern = next(
            (
                p
                for p in reversed(patterns)
                if head.op in p.heads
                and tail.op in p.tails
                and (p.when is None or holds is None or holds(p, head.name, tail.name))
            ),
            None,
        )
        if pattern is None or not quantized(head.name):
            continue
        if quantized(tail.name) and tail.name not in float_heads:
            fused[head.name] = tail.name
        elif pattern.when_tail_float == "float":
            float_heads[head.name] = tail.name
        else:
            split[head.name] = tail.name
    return FusionPlan(fused=fused, float_heads=float_heads, split=split)


def fused_tail(node: Node) -> Node | None:
    """The op fused after ``node`` (its output then carries no encoding), or None."""
    name = node.meta.get(FUSED_TAIL_KEY)
    if name is None:
        return None
    return next((u for u in node.users if u.name == name), None)


def fused_head(node: Node) -> Node | None:
    """The producer ``node`` is fused into (``node``'s input from it carries no encoding), or None."""
    name = node.meta.get(FUSED_HEAD_KEY)
    first = node.args[0] if node.args else None
    return first if isinstance(first, Node) and first.name == name else None


def remove_fused_encodings(graph: Graph, fused: Mapping[str, str]) -> None:
    """No encoding inside a fused pair: drop the head's output spec and the tail's input spec
    from the head, if a rule wrote them. A tail output that shared one of them takes the spec it
    pointed at."""
    nodes = {n.name: n for n in graph.nodes}
    for head_name, tail_name in fused.items():
        head, tail = nodes[head_name], nodes[tail_name]
        head_ann, tail_ann = get_annotation(head), get_annotation(tail)
        removed = []
        if tail_ann is not None and head in tail_ann.input_qspec_map:
            removed.append(tail_ann.input_qspec_map.pop(head))
        if head_ann is not None and head_ann.output_qspec is not None:
            removed.append(head_ann.output_qspec)
            head_ann.output_qspec = None
        out = None if tail_ann is None else tail_ann.output_qspec
        if (
            tail_ann is not None
            and out is not None
            and spec_kind(out) is SpecKind.SHARED
            and out.edge_or_node in (head, (head, tail))
        ):
            tail_ann.output_qspec = next(
                (s for s in removed if s is not None and spec_kind(s) is not SpecKind.SHARED), None
            )
