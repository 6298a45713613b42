"""Source-partition matching for PT2E annotators, indexed once instead of rescanned per pattern.

Quantizers written for torchao find op patterns with ``torch.fx``'s ``get_source_partitions``
(one scan of the whole graph per call; X86InductorQuantizer makes 32 calls) and torchao's
``find_sequential_partitions`` (every element of an ``itertools.product`` of candidate partitions,
so quadratic in model size: 131k pair checks on a 128-block decoder). While ``prepare`` runs a
quantizer's ``annotate``, :func:`fast_partition_matching` swaps both functions, wherever a loaded
module binds them, for versions that read a per-graph index (built once, dropped as soon as a node
is created or erased) and follow graph edges between consecutive partitions. They return the same
partitions in the same order: same dict keys in the same order, same node lists, same tuples in
``itertools.product`` order, so annotations are unchanged. The originals are put back on exit.

Only the torch and torchao versions this was checked against are patched (their matching rules
are re-implemented here; :mod:`_quantplug.peers.versions`); with any other version the originals
run unchanged.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from operator import itemgetter
from typing import Any

from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.utils.source_matcher_utils import SourcePartition
from torch.fx.passes.utils.source_matcher_utils import get_source_partitions as _torch_get_source_partitions

from _quantplug.peers.versions import verified

_lock = threading.RLock()
_depth = 0
_patched: list[tuple[dict[str, Any], str, Any]] = []
_active: dict[int, Graph] = {}  # graphs inside an active context, by id
_indexes: dict[int, _Index] = {}  # their current indexes (dropped when a node is created or erased)
_NO_MATCH = object()
_scanned: dict[str, Any] = {}  # module name -> the module object last scanned for bindings
_bindings: dict[str, list[str]] = {}  # module name -> names of originals it binds
_scanned_for: list[frozenset[str]] = [frozenset()]  # the originals the scan above looked for
_scanned_mark: list[tuple[int, Any, Any] | None] = [None]  # sys.modules's mark when last scanned


def _originals() -> dict[str, Any]:
    """name -> original function object, for the functions this module can replace."""
    found: dict[str, Any] = {}
    if verified("torchao_matching", peers=("torch",)):
        found["get_source_partitions"] = _torch_get_source_partitions
    graph_utils = sys.modules.get("torchao.quantization.pt2e.graph_utils")
    if (
        graph_utils is not None
        and verified("torchao_matching", peers=("torchao",))
        and callable(getattr(graph_utils, "_valid_type_sequence", None))
        and callable(getattr(graph_utils, "_get_matching_types", None))
    ):
        found["find_sequential_partitions"] = graph_utils.find_sequential_partitions
    return found


@contextmanager
def fast_partition_matching(gm: GraphModule) -> Iterator[None]:
    """Within the block, partition matching on ``gm.graph`` reads an index built once."""
    global _depth
    graph = gm.graph
    key = id(graph)

    def invalidate(_: Node) -> None:
        _indexes.pop(key, None)

    hooks = []
    for register, unregister in (
        ("_register_create_node_hook", "_unregister_create_node_hook"),
        ("_register_erase_node_hook", "_unregister_erase_node_hook"),
    ):
        if callable(getattr(gm, register, None)) and callable(getattr(gm, unregister, None)):
            getattr(gm, register)(invalidate)
            hooks.append(unregister)
    with _lock:
        if _depth == 0:
            _patch()
        _depth += 1
        if len(hooks) == 2:  # without both hooks a stale index could survive a graph edit
            _active[key] = graph
    try:
        yield
    finally:
        with _lock:
            _active.pop(key, None)
            _indexes.pop(key, None)
            _depth -= 1
            if _depth == 0:
                _unpatch()
        for unregister in hooks:
            getattr(gm, unregister)(invalidate)


def _patch() -> None:
    originals = _originals()
    fast_versions = {
        "get_source_partitions": get_source_partitions,
        "find_sequential_partitions": find_sequential_partitions,
    }
    if frozenset(originals) != _scanned_for[0]:  # another set of originals: scan everything again
        _scanned.clear()
        _bindings.clear()
        _scanned_for[0] = frozenset(originals)
        _scanned_mark[0] = None
    if not _same_mark(_scanned_mark[0], _modules_mark()):
        _rescan(originals)
    for module_name, names in _bindings.items():
        namespace = getattr(sys.modules.get(module_name), "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name in names:
            if name in originals and namespace.get(name) is originals[name]:
                namespace[name] = fast_versions[name]
                _patched.append((namespace, name, originals[name]))


def _modules_mark() -> tuple[int, Any, Any]:
    """``sys.modules``'s size and its last entry: an import adds an entry at the end, a removal
    changes the size, a module removed and imported again comes back last (a new object).

    Comparing ``sys.modules`` with the copy of it the last scan kept reads all ~3k entries of both
    dicts: 30 us in a warm cache, but 0.3 ms of every prepare after a ``gc.collect()`` (which is
    when a caller times one). The mark misses only an entry replaced in place, behind others,
    with nothing added or removed since: a module there binding an original then keeps torch's
    or torchao's function (the same partitions, slower) until ``sys.modules`` next changes; the
    modules it does patch are checked to still hold the original first."""
    modules = sys.modules
    last = next(reversed(modules), None)
    return len(modules), last, modules.get(last) if last is not None else None


def _same_mark(seen: tuple[int, Any, Any] | None, now: tuple[int, Any, Any]) -> bool:
    return seen is not None and seen[0] == now[0] and seen[1] == now[1] and seen[2] is now[2]


def _rescan(originals: dict[str, Any]) -> None:
    """Bring ``_bindings`` (the modules binding an original) up to date with ``sys.modules``."""
    # which modules bind an original: scan each module once (about 3k of them once torchao is in).
    # ``_scanned`` is then a copy of ``sys.modules``: while it still equals it (one comparison in
    # C, ~30 us, where walking the modules in Python took 0.2-0.8 ms of every prepare) no module
    # was added, replaced or removed, and nothing is left to scan
    if _scanned != sys.modules:
        for module_name, module in list(sys.modules.items()):
            if _scanned.get(module_name) is module:
                continue
            _scanned[module_name] = module
            namespace = getattr(module, "__dict__", None)
            names = [n for n in originals if isinstance(namespace, dict) and namespace.get(n) is originals[n]]
            if names:
                _bindings[module_name] = names
            else:
                _bindings.pop(module_name, None)
        # modules since removed: forgotten (scanned again if they come back)
        for module_name in [name for name in _scanned if name not in sys.modules]:
            del _scanned[module_name]
            _bindings.pop(module_name, None)
    _scanned_mark[0] = _modules_mark()


def _unpatch() -> None:
    while _patched:
        namespace, name, original = _patched.pop()
        namespace[name] = original


# ----------------------------------------------------------------------------- get_source_partitions


class _Index:
    """Nodes of one graph grouped by what ``get_source_partitions`` matches them on.

    A node with ``source_fn_stack`` meta matches on its innermost source; one without matches on
    its ``torch_fn`` name, else (call_function only) on its innermost ``nn_module_stack`` class.
    Nodes sharing those keys match the same wanted sources, so a query tests each key once.
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.by_source: dict[Any, list[tuple[int, Any, Any, Node]]] = {}
        # (has torch_fn, torch_fn name, has module stack, innermost class) -> [(i, fn fqn, module fqn, node)]
        self.by_signature: dict[tuple[Any, ...], list[tuple[int, Any, Any, Node]]] = {}
        for i, node in enumerate(graph.nodes):
            stack = node.meta.get("source_fn_stack", None)
            if stack is not None:
                fqn, source = stack[-1]
                self.by_source.setdefault(source, []).append((i, source, fqn, node))
                continue
            torch_fn = node.meta.get("torch_fn", None)
            name = fn_fqn = None
            if torch_fn is not None:
                fn_fqn, source_fn = torch_fn
                name = source_fn.split(".")[1]
            module_fqn = module_cls = None
            has_stack = False
            if node.op == "call_function":
                nn_module_stack = node.meta.get("nn_module_stack", None)
                if nn_module_stack:
                    module_fqn, module_cls = list(nn_module_stack.values())[-1]
                    has_stack = True
            if torch_fn is None and not has_stack:
                continue
            signature = (torch_fn is not None, name, has_stack, module_cls)
            self.by_signature.setdefault(signature, []).append((i, fn_fqn, module_fqn, node))

    def matches(self, wanted_sources: Sequence[Any]) -> Iterator[tuple[int, Any, Any, Node]]:
        """(position, partition key, fqn, node) of every matching node, in graph order."""
        streams: list[Any] = []
        seen: set[int] = set()
        for source in wanted_sources:
            entries = self.by_source.get(source)
            if entries is not None and id(entries) not in seen:
                seen.add(id(entries))
                streams.append(entries)
        for (has_fn, name, has_stack, module_cls), entries in self.by_signature.items():
            if has_fn and name in wanted_sources:
                streams.append([(i, name, fn_fqn, n) for i, fn_fqn, _, n in entries])
                continue
            if has_stack:
                source = _module_match(module_cls, wanted_sources)
                if source is not _NO_MATCH:
                    streams.append([(i, source, module_fqn, n) for i, _, module_fqn, n in entries])
        return heapq.merge(*streams, key=itemgetter(0))


def _module_match(module_cls: Any, wanted_sources: Sequence[Any]) -> Any:
    """The first wanted source an ``nn_module_stack`` class matches (the fallback rule)."""
    for source in wanted_sources:
        if isinstance(source, type):
            if isinstance(module_cls, type) and issubclass(module_cls, source):
                return source
            elif isinstance(module_cls, str):
                if module_cls == source.__module__ + "." + source.__qualname__:
                    return source
        elif module_cls == source:
            return source
    return _NO_MATCH


def _index_for(graph: Graph) -> _Index:
    index = _indexes.get(id(graph))
    if index is not None and index.graph is graph:
        return index
    index = _Index(graph)
    if _active.get(id(graph)) is graph:
        _indexes[id(graph)] = index
    return index


def get_source_partitions(
    graph: Graph, wanted_sources: list[Any], filter_fn: Callable[[Node], bool] | None = None
) -> dict[Any, list[Any]]:
    """``torch.fx.passes.utils.source_matcher_utils.get_source_partitions``, from the index."""
    try:
        matched = list(_index_for(graph).matches(wanted_sources))
    except Exception:  # an unhashable source, a malformed torch_fn: let torch's version decide
        return _torch_get_source_partitions(graph, wanted_sources, filter_fn)

    modules: dict[Any, dict[Any, list[Node]]] = {}
    for _, source, fqn, node in matched:
        modules.setdefault(source, {}).setdefault(fqn, []).append(node)

    def make_partition(nodes: list[Node], module_type: Any) -> Any:
        input_nodes = set()
        output_nodes = set()
        params = set()
        for node in nodes:
            for arg in node.args:
                if isinstance(arg, Node) and arg not in nodes and arg.op != "get_attr":
                    input_nodes.add(arg)
            if node.op == "get_attr":
                params.add(node)
                continue
            for user in node.users:
                if user not in nodes:
                    output_nodes.add(node)
        return SourcePartition(nodes, module_type, list(input_nodes), list(output_nodes), list(params))

    if filter_fn:
        modules = {
            source: {name: part for name, part in by_name.items() if all(map(filter_fn, part))}
            for source, by_name in modules.items()
        }
    return {
        source: [make_partition(p, source) for p in by_name.values()] for source, by_name in modules.items()
    }


# ----------------------------------------------------------------------------- find_sequential_partitions


def find_sequential_partitions(
    gm: GraphModule,
    partition_types: list[Any],
    include_functional_equivalent: bool = True,
    filter_fn: Callable[[Node], bool] | None = None,
) -> list[tuple[Any, ...]]:
    """torchao's ``find_sequential_partitions`` without enumerating the whole product."""
    graph_utils = sys.modules["torchao.quantization.pt2e.graph_utils"]
    if not graph_utils._valid_type_sequence(partition_types):
        raise ValueError(
            f"Invalid partition types: {partition_types}. Each type in the sequence must be unique"
        )
    typed: list[list[Any]] = []
    for partition_type in partition_types:
        types_to_match = graph_utils._get_matching_types(partition_type)
        partitions = get_source_partitions(gm.graph, types_to_match, filter_fn)
        typed.append(list(itertools.chain.from_iterable(partitions.values())))
    return _sequential(typed)


def _sequential(typed: list[list[Any]]) -> list[tuple[Any, ...]]:
    """The tuples of ``itertools.product(*typed)`` whose consecutive partitions are connected.

    "Connected" is torch's ``check_subgraphs_connected(a, b)``: some node of ``a`` has a user in
    ``b``. Successors are found through users, and each level is walked in index order, so the
    tuples come out in the product's (lexicographic) order.
    """
    if not typed:
        return [()]
    if any(not level for level in typed):
        return []
    successors: list[list[list[int]]] = []
    for level, following in itertools.pairwise(typed):
        owners: dict[Node, list[int]] = {}
        for q, part in enumerate(following):
            for node in part.nodes:
                owners.setdefault(node, []).append(q)
        per_part = []
        for part in level:
            hits: set[int] = set()
            for node in part.nodes:
                for user in node.users:
                    hits.update(owners.get(user, ()))
            per_part.append(sorted(hits))
        successors.append(per_part)

    # depth first, each level's successors pushed last to first so they come off in index order.
    # A loop, not a recursive closure: that closure (a cell holding the function that holds the
    # cell) stayed in a reference cycle with every partition of the query, for the collector
    result: list[tuple[Any, ...]] = []
    depth = len(typed)
    stack = [[first] for first in reversed(range(len(typed[0])))]
    while stack:
        prefix = stack.pop()
        length = len(prefix)
        if length == depth:
            result.append(tuple(typed[j][i] for j, i in enumerate(prefix)))
            continue
        stack.extend([*prefix, i] for i in reversed(successors[length - 1][prefix[-1]]))
    return result
