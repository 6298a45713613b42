"""``map_nodes``: an annotation carried onto convert's copies of the nodes it names.

Property: for any nesting of annotations, specs, dicts, lists and tuples, the mapped value is the
original with each node replaced by its copy (a node without a copy kept), the original is left as
it was, a part naming no node is the same object, and one memo maps a shared spec once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx import Graph, Node

from _quantplug.annotation.node_mapping import map_nodes
from _quantplug.annotation.specs import (
    DerivedQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    SharedQuantizationSpec,
)

OLD, NEW = Graph(), Graph()
OLD_NODES = [OLD.placeholder(f"n{i}") for i in range(4)]
UNCOPIED = OLD.placeholder("uncopied")
COPIES = {old: NEW.placeholder(old.name) for old in OLD_NODES}
SPEC = QuantizationSpec(dtype=torch.int8)

nodes = st.sampled_from([*OLD_NODES, UNCOPIED])
edges = st.tuples(nodes, nodes)
edge_or_node = st.one_of(nodes, edges)
specs = st.one_of(
    st.just(SPEC),
    st.builds(SharedQuantizationSpec, edge_or_node),
    st.builds(
        DerivedQuantizationSpec,
        derived_from=st.lists(edge_or_node, min_size=1, max_size=3),
        derive_qparams_fn=st.just(lambda observers: (torch.ones(1), torch.zeros(1))),
        dtype=st.just(torch.int32),
    ),
)
annotations = st.builds(
    QuantizationAnnotation,
    input_qspec_map=st.dictionaries(nodes, st.one_of(st.none(), specs), max_size=3),
    output_qspec=st.one_of(st.none(), specs),
)
values = st.recursive(
    st.one_of(nodes, st.integers(), st.text(max_size=3), specs, annotations),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(nodes, st.text(max_size=2)), inner, max_size=3),
    ),
    max_leaves=12,
)


def _shape(value: Any, node: Callable[[Node], Any]) -> Any:
    """``value`` written out for comparison by structure (not identity), each node as ``node``
    says."""
    if isinstance(value, Node):
        return ("node", node(value))
    if isinstance(value, dict):
        return ("dict", [(_shape(k, node), _shape(v, node)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_shape(v, node) for v in value])
    if hasattr(value, "__dataclass_fields__"):
        return (
            type(value).__name__,
            [(name, _shape(getattr(value, name), node)) for name in value.__dataclass_fields__],
        )
    return ("value", value if isinstance(value, (int, str)) else id(value))


def _expected(value: Any) -> Any:
    """``value`` as mapping should leave it: each copied node its copy."""
    return _shape(value, lambda n: id(COPIES.get(n, n)))


def _original(value: Any) -> Any:
    """``value`` naming its nodes as they are (what the original must still name afterwards)."""
    return _shape(value, id)


def _names_a_copied_node(value: Any) -> bool:
    return _expected(value) != _original(value)


@settings(max_examples=200, deadline=None)
@given(value=values)
def test_each_node_becomes_its_copy_and_nothing_else_changes(value: Any) -> None:
    before = _original(value)
    mapped = map_nodes(value, COPIES)
    assert _original(mapped) == _expected(value)
    assert _original(value) == before  # the original is not touched
    if not _names_a_copied_node(value):
        assert mapped is value  # nothing to map: not copied


@settings(max_examples=50, deadline=None)
@given(spec=specs.filter(_names_a_copied_node))
def test_one_memo_maps_a_shared_spec_once(spec: Any) -> None:
    memo: dict[int, Any] = {}
    first = map_nodes(QuantizationAnnotation(output_qspec=spec), COPIES, memo)
    second = map_nodes(QuantizationAnnotation(input_qspec_map={OLD_NODES[0]: spec}), COPIES, memo)
    assert first.output_qspec is second.input_qspec_map[COPIES[OLD_NODES[0]]]
    assert first.output_qspec is not spec
