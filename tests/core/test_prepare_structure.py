"""Shortcuts that keep prepare cheap give what the long way gives; no wall-clock assertions.

Each test pins one of them: the partition-matching patch scans only modules it has not seen,
observer copies from one prototype, the nonfinite settings written without ``nn.Module``'s
checks, the index-arithmetic search naming each op once.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.fx import Graph, Node

from _quantplug.graph import index_arithmetic as ia
from _quantplug.observers import nonfinite
from _quantplug.observers.copies import copier, fresh_copy
from _quantplug.observers.minmax import PerChannelMinMaxObserver
from _quantplug.peers import torchao_matching


def _binding_module(name: str) -> types.ModuleType:
    """A module binding torch's get_source_partitions, as a quantizer module imported later does."""
    module = types.ModuleType(name)
    module.get_source_partitions = torchao_matching._torch_get_source_partitions  # type: ignore[attr-defined]
    return module


def test_modules_imported_between_prepares_are_patched_too() -> None:
    originals = torchao_matching._originals()
    if "get_source_partitions" not in originals:
        pytest.skip("torch version not verified for the matching patch: nothing is patched")
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    with torchao_matching.fast_partition_matching(gm):  # everything loaded so far is scanned
        pass
    name = "_quantplug_test_late_quantizer"
    late = _binding_module(name)
    sys.modules[name] = late
    try:
        with torchao_matching.fast_partition_matching(gm):
            assert late.get_source_partitions is torchao_matching.get_source_partitions
        assert late.get_source_partitions is originals["get_source_partitions"]
        # removed, then back as another module object: scanned again
        del sys.modules[name]
        with torchao_matching.fast_partition_matching(gm):
            pass
        again = sys.modules[name] = _binding_module(name)
        with torchao_matching.fast_partition_matching(gm):
            assert again.get_source_partitions is torchao_matching.get_source_partitions
        assert again.get_source_partitions is originals["get_source_partitions"]
    finally:
        sys.modules.pop(name, None)
    with torchao_matching.fast_partition_matching(gm):  # and nothing is left of it
        assert name not in torchao_matching._scanned


def test_a_last_module_replaced_in_place_is_scanned_again() -> None:
    """sys.modules's mark (size, last entry) tells a scan is due: the last entry replaced by
    another module object, nothing added or removed, is such a change."""
    originals = torchao_matching._originals()
    if "get_source_partitions" not in originals:
        pytest.skip("torch version not verified for the matching patch: nothing is patched")
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    name = "_quantplug_test_replaced_quantizer"
    sys.modules[name] = types.ModuleType(name)  # binds nothing
    try:
        with torchao_matching.fast_partition_matching(gm):  # scanned: no binding
            pass
        size = len(sys.modules)
        replaced = sys.modules[name] = _binding_module(name)  # in place, still last
        assert len(sys.modules) == size and next(reversed(sys.modules)) == name
        with torchao_matching.fast_partition_matching(gm):
            assert replaced.get_source_partitions is torchao_matching.get_source_partitions
        assert replaced.get_source_partitions is originals["get_source_partitions"]
    finally:
        sys.modules.pop(name, None)


class _OwnSetattr(PerChannelMinMaxObserver):
    """An observer assigning its attributes its own way (the copy must go through it)."""

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__.setdefault("assigned", []).append(name)
        super().__setattr__(name, value)


def test_copies_from_one_prototype_are_independent_fresh_observers() -> None:
    prototype = PerChannelMinMaxObserver()
    make = copier(prototype)
    first: Any = make()
    second: Any = make()
    first(torch.randn(4, 3))
    assert int(first.num_batches) == 1 and int(second.num_batches) == 0 == int(prototype.num_batches)
    assert second.min_val.numel() == 0 and prototype.min_val.numel() == 0
    for copy in (first, second):
        assert type(copy) is PerChannelMinMaxObserver
        assert copy._buffers is not prototype._buffers and copy._parameters == {} == copy._modules
        assert copy._non_persistent_buffers_set is not prototype._non_persistent_buffers_set
        assert set(copy._buffers) == set(prototype._buffers)
    # a class with its own __setattr__ sees the copy's containers assigned through it
    own = _OwnSetattr()
    own.__dict__.pop("assigned")
    copy = fresh_copy(own)
    assert copy.__dict__["assigned"] == ["_buffers", "_non_persistent_buffers_set", "_parameters", "_modules"]


class _Settings(nn.Module):
    nonfinite = "error"
    where = ""
    observes_input = True
    observes_scores = False


class _SettingsOwnSetattr(_Settings):
    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, (value, "seen") if name == nonfinite.WHERE_ATTR else value)


class _Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.activation_post_process = inner


@given(
    policy=st.sampled_from(nonfinite.POLICIES),
    observes_input=st.booleans(),
    observes_scores=st.booleans(),
    own_setattr=st.booleans(),
    wrapped=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_configure_sets_what_module_setattr_sets(
    policy: str, observes_input: bool, observes_scores: bool, own_setattr: bool, wrapped: bool
) -> None:
    def build() -> tuple[nn.Module, nn.Module]:
        leaf = _SettingsOwnSetattr() if own_setattr else _Settings()
        return (_Wrapper(leaf) if wrapped else leaf), leaf

    fast, fast_leaf = build()
    slow, slow_leaf = build()
    nonfinite.configure(fast, policy, "x", observes_input=observes_input, observes_scores=observes_scores)
    for module in slow.modules():  # nn.Module.__setattr__ for every setting: the long way
        if hasattr(module, nonfinite.POLICY_ATTR):
            setattr(module, nonfinite.POLICY_ATTR, policy)
            setattr(module, nonfinite.WHERE_ATTR, "x")
            setattr(module, nonfinite.INPUT_ATTR, observes_input)
            setattr(module, nonfinite.SCORES_ATTR, observes_scores)
    assert fast_leaf.__dict__ == slow_leaf.__dict__
    assert ("where" in fast.__dict__) == ("where" in slow.__dict__)


def _cast_graph(casts: list[bool]) -> Graph:
    """A chain of float index arithmetic, each link read by an integer cast or a float op."""
    graph = Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.zeros(3)
    outputs: list[Node] = []
    value = x
    for cast in casts:
        value = graph.call_function(torch.ops.aten.mul.Tensor, (value, 2.0))
        value.meta["val"] = torch.zeros(3)
        reader = graph.call_function(
            torch.ops.aten._to_copy.default if cast else torch.ops.aten.sigmoid.default,
            (value,),
            {"dtype": torch.int64} if cast else {},
        )
        reader.meta["val"] = torch.zeros(3, dtype=torch.int64 if cast else torch.float32)
        outputs.append(reader)
    graph.output(tuple(outputs))
    return graph


@given(casts=st.lists(st.booleans(), min_size=1, max_size=6))
@settings(max_examples=30, deadline=None)
def test_index_arithmetic_names_each_op_once(casts: list[bool]) -> None:
    graph = _cast_graph(casts)
    asked: list[Any] = []
    real = ia.op_name

    def counting(op: Any) -> str:
        asked.append(op)
        return real(op)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ia, "op_name", counting)
        found = ia.index_arithmetic(graph)
    assert len(asked) == len({id(op) for op in asked})
    # what the rule says, node by node (readers first)
    expected: dict[Node, str] = {}
    for node in reversed(list(graph.nodes)):
        if ia.is_integer_cast(node):
            expected[node] = ""
        elif node.op == "call_function" and ia.op_name(node.target) in ia.INDEX_OPS:
            readers = list(node.users)
            if readers and all(r in expected for r in readers):
                expected[node] = ""
    assert list(found) == list(expected)


class _DottedClassAttribute(nn.Module):
    pass


setattr(_DottedClassAttribute, "cls.attr", "from the class")  # a name with a dot: no identifier


@given(
    where=st.sampled_from(["dict", "parameters", "buffers", "modules", "class", "nowhere", "undotted"]),
    body=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_attribute_lookup_is_getattr(where: str, body: bool) -> None:
    from _quantplug.graph.attrs import module_getattr

    gm: Any = torch.fx.GraphModule(_DottedClassAttribute(), Graph())
    gm.__class__ = type("Impl", (_DottedClassAttribute, type(gm)), {})  # torch's per-instance class
    name = "undotted" if where == "undotted" else ("cls.attr" if where == "class" else "a.b")
    value: Any = torch.fx.symbolic_trace(nn.ReLU()) if body else nn.ReLU()
    if where == "dict":
        gm.__dict__[name] = value
    elif where == "parameters":
        gm._parameters[name] = nn.Parameter(torch.ones(1))
    elif where == "buffers":
        gm._buffers[name] = torch.ones(1)
    elif where in ("modules", "undotted"):
        gm._modules[name] = value
    for target in (name, "x.y", "a"):
        assert module_getattr(gm, target, None) is getattr(gm, target, None)


def test_accelerator_swaps_as_accelerate_does() -> None:
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    from _quantplug.peers.torchao_observers import accelerate, accelerator
    from _quantplug.peers.versions import verified

    swap = accelerator()
    for make in (
        ao.HistogramObserver,
        ao.PerChannelMinMaxObserver,
        ao.MinMaxObserver,
        PerChannelMinMaxObserver,
    ):
        one, other = make(), make()
        assert swap(one) is one and type(one) is type(accelerate(other))
        if verified("torchao_observers") and make is not PerChannelMinMaxObserver:
            from _quantplug.peers.torchao_observer_classes import ACCELERATED

            assert type(one) is ACCELERATED.get(make, make)
    assert type(swap(ao.HistogramObserver())) is not ao.HistogramObserver or not verified("torchao_observers")


@given(
    op=st.sampled_from(
        [
            torch.ops.aten.add_.Tensor,
            torch.ops.aten.add.Tensor,
            torch.ops.aten.fill_.Scalar,
            torch.ops.aten.copy_.default,
            torch.ops.aten.relu.default,
            torch.ops.aten.batch_norm.default,
        ]
    ),
    stale=st.booleans(),
    training=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_written_args_follow_the_schema_whatever_the_cache_holds(
    op: Any, stale: bool, training: bool
) -> None:
    from _quantplug.graph import mutation

    graph = Graph()
    inputs = [graph.placeholder(f"x{i}") for i in range(5)]
    if op is torch.ops.aten.batch_norm.default:
        args: tuple[Any, ...] = (*inputs, training, 0.1, 1e-5, False)
    elif op is torch.ops.aten.fill_.Scalar:
        args = (inputs[0], 1.0)
    elif op is torch.ops.aten.relu.default:
        args = (inputs[0],)
    else:
        args = (inputs[0], inputs[1])
    node = graph.call_function(op, args)
    expected = [
        node.args[i]
        for i, a in enumerate(op._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    if op is torch.ops.aten.batch_norm.default and training:
        expected += [inputs[3], inputs[4]]
    with pytest.MonkeyPatch.context() as patch:
        if stale:  # an entry left by another object at the op's id (one that died since)
            patch.setitem(mutation._written_cache, id(op), (object(), (((0, "input"),), ((), 1 << 30))))
        else:
            patch.delitem(mutation._written_cache, id(op), raising=False)
        assert mutation.written_args(node) == expected
        assert mutation.written_args(node) == expected  # from the cache now


class _Outputs(nn.Module):
    """``n_args`` positional and ``n_kwargs`` keyword inputs, outputs nested ``depth`` deep."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> Any:
        t = sum(args) + sum(kwargs.values())
        out: Any = t
        for i in range(self.depth):
            out = (out, {"k": t * (i + 1)}) if i % 2 else [out, t + i]
        return out


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 3), st.integers(0, 2), st.integers(0, 3))
def test_call_specs_are_the_call_spec_propertys(n_args: int, n_kwargs: int, depth: int) -> None:
    from _quantplug.graph.working_copy import call_specs

    args = tuple(torch.randn(2) for _ in range(n_args))
    kwargs = {f"k{i}": torch.randn(2) for i in range(n_kwargs)}
    ep = torch.export.export(_Outputs(depth), args, kwargs)
    spec = ep.call_spec
    assert call_specs(ep) == (spec.in_spec, spec.out_spec)


def test_call_specs_ask_the_property_off_the_common_path() -> None:
    """No module call graph, or a first entry that is not the root: the property's answer or
    error, as ``ep.call_spec`` gives them."""
    from _quantplug.graph.working_copy import call_specs

    class _Program:
        def __init__(self, graph: list[Any]) -> None:
            self.module_call_graph = graph
            self.asked = 0

        @property
        def call_spec(self) -> Any:
            self.asked += 1
            if self.module_call_graph:
                raise AssertionError("expected first module_call_graph fqn to be empty string")
            return types.SimpleNamespace(in_spec=None, out_spec=None)

    empty = _Program([])
    assert call_specs(empty) == (None, None) and empty.asked == 1  # type: ignore[arg-type]
    entry = types.SimpleNamespace(fqn="inner", signature=types.SimpleNamespace(in_spec=1, out_spec=2))
    with pytest.raises(AssertionError, match="fqn"):
        call_specs(_Program([entry]))  # type: ignore[arg-type]


class _FakeNode:
    """What ``_sequential`` reads of a node: its users."""

    def __init__(self) -> None:
        self.users: dict[_FakeNode, None] = {}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_sequential_partitions_are_the_connected_tuples_of_the_product_in_order(data: Any) -> None:
    """torchao's find_sequential_partitions keeps, in itertools.product order, the tuples whose
    consecutive partitions are connected (a node of one has a user in the next)."""
    import itertools

    nodes = [_FakeNode() for _ in range(data.draw(st.integers(1, 8)))]
    index = st.integers(0, len(nodes) - 1)
    for a, b in data.draw(st.lists(st.tuples(index, index))):
        nodes[a].users[nodes[b]] = None
    part = st.lists(st.sampled_from(nodes), min_size=1, max_size=3, unique=True).map(
        lambda members: types.SimpleNamespace(nodes=members)
    )
    typed = data.draw(st.lists(st.lists(part, max_size=4), min_size=1, max_size=4))

    def connected(a: Any, b: Any) -> bool:
        return any(user in b.nodes for node in a.nodes for user in node.users)

    expected = [t for t in itertools.product(*typed) if all(map(connected, t, t[1:]))]
    found = torchao_matching._sequential(typed)
    assert [[id(p) for p in t] for t in found] == [[id(p) for p in t] for t in expected]
