"""Observer-sharing resolution: properties against a brute-force closure, and every failure mode."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Hashable, Mapping

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantplug
from _quantplug.annotation.specs import annotate_node
from _quantplug.flow.inspect import encodings
from _quantplug.sharing.resolution import Key, KeySpec, resolve_sharing
from quantplug import AnnotationError, QuantizationSpec, SharedQuantizationSpec

# --- brute force ---------------------------------------------------------------------------------


def _concrete_signature(key: Key, specs: Mapping[Key, KeySpec]) -> Hashable | None:
    seen = set()
    while specs[key].shared_with is not None:
        if key in seen:
            return None
        seen.add(key)
        key = specs[key].shared_with  # type: ignore[assignment]
    return specs[key].signature


def brute_force(specs: Mapping[Key, KeySpec], blocked: set[str]) -> set[frozenset[Key]]:
    """Connected components of the sharing relation, computed the slow obvious way."""
    adjacency: dict[Key, set[Key]] = defaultdict(set)

    def link(a: Key, b: Key) -> None:
        adjacency[a].add(b)
        adjacency[b].add(a)

    for k, s in specs.items():
        if s.shared_with is not None:
            link(k, s.shared_with)
    sig = {k: _concrete_signature(k, specs) for k in specs}
    edges = [k for k in specs if isinstance(k, tuple)]
    for e in edges:
        a, n = e
        if n in blocked:
            continue
        for other in edges:
            if other != e and other[0] == a and sig[other] == sig[e]:
                link(e, other)
        if a in specs and sig[a] == sig[e]:
            link(e, a)
    components: set[frozenset[Key]] = set()
    seen: set[Key] = set()
    for k in specs:
        if k in seen:
            continue
        stack, comp = [k], set()
        while stack:
            x = stack.pop()
            if x in comp:
                continue
            comp.add(x)
            stack.extend(adjacency[x] - comp)
        seen |= comp
        components.add(frozenset(comp))
    return components


@st.composite
def sharing_problems(draw: st.DrawFn) -> tuple[dict[Key, KeySpec], set[str]]:
    """Random DAG-shaped graphs with random specs; shared specs only point at concrete-rooted chains."""
    n = draw(st.integers(min_value=1, max_value=9))
    names = [f"n{i}" for i in range(n)]
    specs: dict[Key, KeySpec] = {}
    signatures = draw(st.lists(st.sampled_from(["u8", "i8", "u16"]), min_size=1, max_size=3))
    for i, name in enumerate(names):
        inputs = draw(st.lists(st.integers(0, max(0, i - 1)), max_size=3, unique=True)) if i else []
        for j in inputs:
            if draw(st.booleans()):
                specs[(names[j], name)] = KeySpec.concrete(draw(st.sampled_from(signatures)))
        if draw(st.booleans()):
            specs[name] = KeySpec.concrete(draw(st.sampled_from(signatures)))
    keys = list(specs)
    # turn some keys into shared specs pointing at earlier OR later keys (order must not matter),
    # keeping the pointer graph acyclic so every chain ends at a concrete key
    order = draw(st.permutations(keys)) if keys else []
    rank = {k: r for r, k in enumerate(order)}
    for k in keys:
        if draw(st.integers(0, 3)) == 0:
            targets = [t for t in keys if rank[t] > rank[k] and specs[t].shared_with is None]
            if targets:
                specs[k] = KeySpec.shared(draw(st.sampled_from(targets)))
    blocked = set(draw(st.lists(st.sampled_from(names), max_size=2)))
    return specs, blocked


@settings(max_examples=300, deadline=None)
@given(sharing_problems(), st.randoms(use_true_random=False))
def test_resolution_matches_brute_force_in_any_order(
    problem: tuple[dict[Key, KeySpec], set[str]], rnd: random.Random
) -> None:
    specs, blocked = problem
    expected = brute_force(specs, blocked)
    for _ in range(3):
        items = list(specs.items())
        rnd.shuffle(items)
        groups = resolve_sharing(dict(items), no_implicit_consumers=blocked)
        got = {frozenset(m) for m in groups.members}
        assert got == expected
        for gid, members in enumerate(groups.members):
            rep = groups.representative[gid]
            assert rep in members and specs[rep].signature is not None
            assert all(groups.group_of[k] == gid for k in members)


def test_shared_with_later_key_and_chains() -> None:
    specs = {
        "a": KeySpec.shared("c"),  # points forward in order
        "b": KeySpec.shared("a"),  # chain b -> a -> c
        "c": KeySpec.concrete("u8"),
    }
    groups = resolve_sharing(specs)
    assert len(groups) == 1 and groups.representative == ["c"]


def test_cycle_without_concrete_spec_names_the_keys() -> None:
    specs = {"a": KeySpec.shared("b"), "b": KeySpec.shared(("x", "a")), ("x", "a"): KeySpec.shared("a")}
    with pytest.raises(AnnotationError, match=r"cycle.*'a'.*'b'"):
        resolve_sharing(specs)


def test_cycle_with_a_concrete_member_is_one_group() -> None:
    # a <-> b shared with each other, but c (concrete) joins through an edge of the same producer
    specs = {"a": KeySpec.shared("b"), "b": KeySpec.shared("a"), "c": KeySpec.concrete("u8")}
    with pytest.raises(AnnotationError, match="cycle"):
        resolve_sharing(specs)


def test_shared_spec_pointing_at_unannotated_key() -> None:
    with pytest.raises(AnnotationError, match=r"'conv'.*has no quantization spec"):
        resolve_sharing({"relu": KeySpec.shared("conv")})


def test_derived_spec_with_missing_sources() -> None:
    specs = {
        ("b", "conv"): KeySpec.derived("d", [("x", "conv"), ("w", "conv")]),
        ("x", "conv"): KeySpec.concrete("u8"),
    }
    with pytest.raises(AnnotationError, match=r"input 'w' of node 'conv'"):
        resolve_sharing(specs)


def test_extra_merge_of_disagreeing_groups_names_both() -> None:
    specs = {"a": KeySpec.concrete("u8"), "b": KeySpec.concrete("u16")}
    with pytest.raises(AnnotationError, match=r"'a'.*'b'.*disagree"):
        resolve_sharing(specs, extra_merges=[("a", "b")])
    assert (
        len(
            resolve_sharing(
                {"a": KeySpec.concrete("u8"), "b": KeySpec.concrete("u8")}, extra_merges=[("a", "b")]
            )
        )
        == 1
    )


def test_implicit_sharing_respects_opt_out_and_signature() -> None:
    specs = {
        "x": KeySpec.concrete("u8"),
        ("x", "p"): KeySpec.concrete("u8"),
        ("x", "q"): KeySpec.concrete("u16"),
        ("x", "r"): KeySpec.concrete("u8"),
    }
    groups = resolve_sharing(specs, no_implicit_consumers={"r"})
    g = groups.group_of
    assert g["x"] == g[("x", "p")]
    assert g[("x", "q")] != g["x"]  # different grid: requantized, not merged
    # r opted out, but p's edge still reaches it (sharing is initiated by the allowing edge)
    assert g[("x", "r")] == g["x"]
    groups = resolve_sharing(
        {"x": KeySpec.concrete("u8"), ("x", "r"): KeySpec.concrete("u8")}, no_implicit_consumers={"r"}
    )
    assert groups.group_of["x"] != groups.group_of[("x", "r")]


# --- through real graphs -----------------------------------------------------------------------


class CatTwice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)
        return torch.cat([y, y], dim=1).sigmoid()


def _annotating_backend(annotate):  # type: ignore[no-untyped-def]
    spec = QuantizationSpec(dtype=torch.uint8, qscheme=torch.per_tensor_affine)
    info = quantplug.BackendInfo(name="t_sharing", description="test")

    class Plugin:
        @quantplug.hookimpl
        def quantplug_backend_info(self):  # type: ignore[no-untyped-def]
            return info

        @quantplug.hookimpl
        def quantplug_quantization_config(self, preset, context):  # type: ignore[no-untyped-def]
            return quantplug.QuantizationConfig(spec, spec, None, None)

    class Callback:
        def __call__(self, gm, context):  # type: ignore[no-untyped-def]
            annotate(gm, spec)

    return Plugin(), Callback()


def _nodes(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def test_cat_of_the_same_producer_twice_prepares_and_converts() -> None:
    def annotate(gm, spec):  # type: ignore[no-untyped-def]
        n = _nodes(gm)
        annotate_node(n["relu"], {n["x"]: spec}, spec)
        annotate_node(
            n["cat"],
            {n["relu"]: SharedQuantizationSpec(n["relu"])},
            SharedQuantizationSpec((n["relu"], n["cat"])),
        )

    plugin, callback = _annotating_backend(annotate)
    ep = torch.export.export(CatTwice(), (torch.randn(2, 3),))
    with quantplug.registered_backend("t_sharing", plugin):
        q = quantplug.get_quantizer("t_sharing").add_annotation_callback(callback)
        prepared = quantplug.prepare(ep, q)
        x = torch.randn(2, 3)
        prepared(x)
        converted = quantplug.convert(prepared)
    # cat keeps one encoding for both copies: error within one uint8 step of relu's range
    step = float(torch.relu(x).max()) / 255
    torch.testing.assert_close(converted(x), CatTwice()(x), atol=step, rtol=0)


def test_shared_spec_to_a_later_node_in_a_real_graph() -> None:
    def annotate(gm, spec):  # type: ignore[no-untyped-def]
        n = _nodes(gm)
        # relu's output shares with the output of sigmoid, which comes later in graph order
        annotate_node(n["relu"], {n["x"]: spec}, SharedQuantizationSpec(n["sigmoid"]))
        annotate_node(n["sigmoid"], {n["cat"]: spec}, spec)

    plugin, callback = _annotating_backend(annotate)
    ep = torch.export.export(CatTwice(), (torch.randn(2, 3),))
    with quantplug.registered_backend("t_sharing", plugin):
        q = quantplug.get_quantizer("t_sharing").add_annotation_callback(callback)
        prepared = quantplug.prepare(ep, q)
        prepared(torch.randn(2, 3))
        converted = quantplug.convert(prepared)
    enc = {e["tensor"]: e for e in encodings(converted)}
    assert enc["relu"]["scale"] == enc["sigmoid"]["scale"]


def test_shared_spec_to_unannotated_node_in_a_real_graph_names_it() -> None:
    def annotate(gm, spec):  # type: ignore[no-untyped-def]
        n = _nodes(gm)
        annotate_node(n["sigmoid"], {n["cat"]: SharedQuantizationSpec(n["relu"])}, spec)

    plugin, callback = _annotating_backend(annotate)
    ep = torch.export.export(CatTwice(), (torch.randn(2, 3),))
    with quantplug.registered_backend("t_sharing", plugin):
        q = quantplug.get_quantizer("t_sharing").add_annotation_callback(callback)
        with pytest.raises(AnnotationError, match=r"input 'cat' of node 'sigmoid'.*'relu'"):
            quantplug.prepare(ep, q)


def test_spec_for_a_node_that_is_not_an_input() -> None:
    def annotate(gm, spec):  # type: ignore[no-untyped-def]
        n = _nodes(gm)
        annotate_node(n["sigmoid"], {n["x"]: spec}, spec)

    plugin, callback = _annotating_backend(annotate)
    ep = torch.export.export(CatTwice(), (torch.randn(2, 3),))
    with quantplug.registered_backend("t_sharing", plugin):
        q = quantplug.get_quantizer("t_sharing").add_annotation_callback(callback)
        with pytest.raises(AnnotationError, match=r"'sigmoid'.*input 'x'"):
            quantplug.prepare(ep, q)
