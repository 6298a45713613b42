"""From graph annotations to sharing keys: the thin torch-facing layer over ``resolution``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, Node

from _quantplug.annotation.spec_view import SpecKind, spec_kind, spec_signature
from _quantplug.annotation.specs import Q_ANNOTATION_KEY
from _quantplug.errors import AnnotationError, TensorKwargError
from _quantplug.sharing.problem import SharingProblem
from _quantplug.sharing.resolution import Key, KeySpec


@dataclass
class AnnotatedKeys:
    """Every annotated key of a graph with its original spec object, in graph order."""

    specs: dict[Key, Any] = field(default_factory=dict)
    no_implicit: set[str] = field(default_factory=set)

    def problem(self, graph: Graph) -> SharingProblem:
        facts: dict[Key, KeySpec] = {}
        for key, spec in self.specs.items():
            kind = spec_kind(spec)
            if kind is SpecKind.SHARED:
                facts[key] = KeySpec.shared(key_of(spec.edge_or_node, where=key))
            elif kind is SpecKind.DERIVED:
                sources = [key_of(s, where=key) for s in spec.derived_from]
                facts[key] = KeySpec.derived(spec_signature(spec), sources)
            else:
                facts[key] = KeySpec.concrete(spec_signature(spec))
        return SharingProblem(specs=facts, no_implicit_consumers=frozenset(self.no_implicit), graph=graph)


def key_of(edge_or_node: Any, *, where: Key | None = None) -> Key:
    """The key of a PT2E ``EdgeOrNode``: a node name or a ``(producer, consumer)`` name pair."""
    if isinstance(edge_or_node, Node):
        return edge_or_node.name
    if (
        isinstance(edge_or_node, tuple)
        and len(edge_or_node) == 2
        and all(isinstance(n, Node) for n in edge_or_node)
    ):
        return (edge_or_node[0].name, edge_or_node[1].name)
    at = f" (in the spec of {where})" if where is not None else ""
    raise AnnotationError(
        f"{edge_or_node!r}{at} is not a node or a (producer, consumer) edge; SharedQuantizationSpec and "
        "DerivedQuantizationSpec must reference graph nodes"
    )


def _tensor_args(node: Node) -> set[Node]:
    found: set[Node] = set()
    _collect_nodes(node.args, found)
    _collect_nodes(node.kwargs, found)
    return found


def _collect_nodes(a: Any, found: set[Node]) -> None:
    """Add the nodes in ``a`` (nested lists, tuples and dict values) to ``found``; a module-level
    function: a recursive closure would leave a reference cycle per call for the collector."""
    if isinstance(a, Node):
        found.add(a)
    elif isinstance(a, (list, tuple)):
        for x in a:
            _collect_nodes(x, found)
    elif isinstance(a, dict):
        for x in a.values():
            _collect_nodes(x, found)


#: what a keyword node may stand for without being a tensor to quantize (a size, a flag)
_NOT_TENSORS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def _keyword_nodes(value: Any) -> list[Node]:
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _keyword_nodes(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _keyword_nodes(v)]
    return []


def _check_keyword_arguments(node: Node) -> None:
    """torchao's prepare_pt2e refuses an annotated node with a node among its keyword arguments
    (observers go on positional inputs only, so it would stay float unnoticed); so does quantplug.
    Sizes (a ``SymInt`` node) are not tensors and pass."""
    for name, value in node.kwargs.items():
        for arg in _keyword_nodes(value):
            if isinstance(arg.meta.get("val"), _NOT_TENSORS):
                continue
            raise TensorKwargError(
                f"node {node.name!r} ({node.target}) is annotated and takes {arg.name!r} as keyword argument "
                f"{name!r}: quantization observes positional inputs only, so it would stay unquantized; "
                "use the functional form of the op (no out=) or pass the tensor positionally (torch.export "
                "does), or leave the node unannotated"
            )


def collect_keys(graph: Graph) -> AnnotatedKeys:
    """Read every node's annotation (ours or PT2E's); input edges first, then the output."""
    keys = AnnotatedKeys()
    for node in graph.nodes:
        ann = node.meta.get(Q_ANNOTATION_KEY)
        if ann is None:
            continue
        _check_keyword_arguments(node)
        input_map = getattr(ann, "input_qspec_map", None) or {}
        if input_map:
            args = _tensor_args(node)
            for arg, spec in input_map.items():
                if spec is None:
                    continue
                if arg not in args:
                    arg_name = arg.name if isinstance(arg, Node) else repr(arg)
                    raise AnnotationError(
                        f"node {node.name!r} has a spec for input {arg_name!r}, "
                        "which is not one of its inputs; "
                        "key input_qspec_map by the argument nodes of the annotated node"
                    )
                keys.specs[(arg.name, node.name)] = spec
        out = getattr(ann, "output_qspec", None)
        if out is not None:
            keys.specs[node.name] = out
        if not getattr(ann, "allow_implicit_sharing", True):
            keys.no_implicit.add(node.name)
    return keys
