"""Observer-sharing resolution: which keys share one observer. Pure: keys in, groups out.

A *key* is a node's output (``"conv"``) or one input edge of a node (``("x", "conv")``). Each
annotated key gets exactly one observer, shared by every key of its group:

1. explicit: a key whose spec is ``SharedQuantizationSpec(t)`` joins ``t``'s group;
2. implicit: an input edge ``(a, n)`` joins the group of ``a``'s output and of ``a``'s other
   annotated consumer edges when their specs have the same *signature* (dtype, range, scheme,
   axis, dynamic-ness, fixed qparams), unless ``n`` opted out of implicit sharing;
3. extra merges requested by a backend (e.g. concat unification) must join agreeing groups.

The explicit phase runs first and yields trees each rooted at the one concrete spec they share
(a tree rooted at a shared spec is a cycle with nothing concrete: an error). Signatures compare
by equality, an equivalence relation, so the implicit phase can bucket edges per producer and the
result does not depend on the order keys are listed in.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Union

from _quantplug.errors import AnnotationError

NodeKey = str
EdgeKey = tuple[str, str]
Key = Union[NodeKey, EdgeKey]


@dataclass(frozen=True)
class KeySpec:
    """The facts about one key's spec that sharing needs, and nothing torch-specific.

    Exactly one of ``signature`` (a concrete, fixed or derived spec) or ``shared_with`` is set.
    """

    signature: Hashable | None = None
    shared_with: Key | None = None
    derived_from: tuple[Key, ...] = ()

    @staticmethod
    def concrete(signature: Hashable) -> KeySpec:
        return KeySpec(signature=signature)

    @staticmethod
    def shared(target: Key) -> KeySpec:
        return KeySpec(shared_with=target)

    @staticmethod
    def derived(signature: Hashable, sources: Iterable[Key]) -> KeySpec:
        return KeySpec(signature=signature, derived_from=tuple(sources))


@dataclass
class SharingGroups:
    """The partition of keys into observer groups.

    ``representative[g]`` is the key whose concrete spec builds group ``g``'s observer: the
    first concrete key of the group in the caller's key order.

    ``observed_per_pass`` holds groups whose several tensors are one tensor seen at several
    places in one forward pass (an unrolled recurrence's gate at every step): their observer is
    told how many calls make one pass, so a moving average averages calibration batches, not
    calls (where the first call, a step from the zero state, would outweigh the rest). A backend
    sets it in ``quantplug_resolve_sharing``; other groups' observers average every call, as
    torchao's do.
    """

    group_of: dict[Key, int] = field(default_factory=dict)
    members: list[list[Key]] = field(default_factory=list)
    representative: list[Key] = field(default_factory=list)
    observed_per_pass: set[int] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.members)


def describe_key(key: Key) -> str:
    """Human wording of a key for error messages."""
    if isinstance(key, tuple):
        return f"input {key[0]!r} of node {key[1]!r}"
    return f"output of node {key!r}"


class _UnionFind:
    __slots__ = ("parent",)

    def __init__(self, keys: Iterable[Key]) -> None:
        self.parent: dict[Key, Key] = {k: k for k in keys}

    def find(self, key: Key) -> Key:
        parent = self.parent
        root = key
        while parent[root] != root:
            root = parent[root]
        while parent[key] != root:  # path compression
            parent[key], key = root, parent[key]
        return root

    def attach(self, child_root: Key, parent_root: Key) -> None:
        self.parent[child_root] = parent_root


def resolve_sharing(
    specs: Mapping[Key, KeySpec],
    *,
    no_implicit_consumers: Collection[str] = (),
    extra_merges: Sequence[tuple[Key, Key]] = (),
    describe: Callable[[Key], str] = describe_key,
) -> SharingGroups:
    """Partition annotated keys into observer groups.

    Args:
        specs: every annotated key with its spec facts, in graph order (order only picks the
            representative among agreeing specs; membership does not depend on it).
        no_implicit_consumers: nodes whose annotation set ``allow_implicit_sharing=False``.
        extra_merges: key pairs a backend wants in one group; their specs must agree.
        describe: renders a key in error messages.

    Raises:
        AnnotationError: a shared spec pointing at an unannotated key, a derived spec whose
            sources are not annotated, a cycle of shared specs with no concrete spec, or an
            extra merge of groups whose specs disagree. The message names the keys.
    """
    _check_references(specs, describe)
    uf = _UnionFind(specs)

    # 1. explicit sharing. Each shared key is still its own root when processed (only its own
    # link moves it), so linking it under its target's root can only close a cycle, never merge
    # two concrete trees.
    for key, spec in specs.items():
        if spec.shared_with is not None:
            target_root = uf.find(spec.shared_with)
            if target_root != key:
                uf.attach(key, target_root)

    signature: dict[Key, Hashable] = {}
    for key in specs:
        root = uf.find(key)
        if root in signature:
            continue
        root_spec = specs[root]
        if root_spec.signature is None:
            cycle = sorted((k for k in specs if uf.find(k) == root), key=str)
            raise AnnotationError(
                "shared quantization specs form a cycle with no concrete spec: "
                + ", ".join(describe(k) for k in cycle)
                + ". Give one of them a QuantizationSpec."
            )
        signature[root] = root_spec.signature

    # 2. implicit sharing, bucketed per producer and signature (linear in the number of edges).
    edges_by_producer: dict[str, list[EdgeKey]] = defaultdict(list)
    for key in specs:
        if isinstance(key, tuple):
            edges_by_producer[key[0]].append(key)
    blocked = set(no_implicit_consumers)
    for producer, edges in edges_by_producer.items():
        buckets: dict[Hashable, list[EdgeKey]] = defaultdict(list)
        for edge in edges:
            buckets[signature[uf.find(edge)]].append(edge)
        out_sig = signature[uf.find(producer)] if producer in specs else None
        for sig, bucket in buckets.items():
            if all(edge[1] in blocked for edge in bucket):
                continue
            anchor = uf.find(bucket[0])
            for edge in bucket[1:]:
                root = uf.find(edge)
                if root != anchor:
                    uf.attach(root, anchor)
            if out_sig is not None and out_sig == sig:
                producer_root = uf.find(producer)
                if producer_root != anchor:
                    uf.attach(anchor, producer_root)

    # 3. backend-requested merges.
    for a, b in extra_merges:
        for k in (a, b):
            if k not in specs:
                raise AnnotationError(f"a sharing merge names {describe(k)}, which is not annotated")
        ra, rb = uf.find(a), uf.find(b)
        if ra == rb:
            continue
        if signature[ra] != signature[rb]:
            raise AnnotationError(
                f"cannot share one observer between {describe(a)} and {describe(b)}: their specs "
                f"disagree ({signature[ra]} vs {signature[rb]}). Use the same dtype and range for both."
            )
        uf.attach(rb, ra)

    return _number_groups(specs, uf)


def _check_references(specs: Mapping[Key, KeySpec], describe: Callable[[Key], str]) -> None:
    for key, spec in specs.items():
        if spec.shared_with is not None and spec.shared_with not in specs:
            raise AnnotationError(
                f"{describe(key)} shares its quantization with {describe(spec.shared_with)}, "
                "which has no quantization spec. Annotate that key too, or share with an annotated one."
            )
        missing = [s for s in spec.derived_from if s not in specs]
        if missing:
            raise AnnotationError(
                f"{describe(key)} derives its qparams from "
                + ", ".join(describe(m) for m in missing)
                + ", which has no quantization spec. Annotate the sources (e.g. the input and weight)."
            )


def _number_groups(specs: Mapping[Key, KeySpec], uf: _UnionFind) -> SharingGroups:
    result = SharingGroups()
    root_to_group: dict[Key, int] = {}
    representative: list[Key | None] = []
    for key, spec in specs.items():
        root = uf.find(key)
        gid = root_to_group.get(root)
        if gid is None:
            gid = root_to_group[root] = len(result.members)
            result.members.append([])
            representative.append(None)
        if representative[gid] is None and spec.signature is not None:
            representative[gid] = key
        result.group_of[key] = gid
        result.members[gid].append(key)
    # every group has a concrete root (checked above), so every representative is set
    result.representative = [k for k in representative if k is not None]
    return result
