"""prepare(): annotate -> validate -> resolve sharing -> one observer per group.

Works on a copy of the caller's graph, inserts observers with O(1) naming into one container
module, and recompiles once. Groups whose tensors are all parameters or buffers (weights,
biases) get no observer in the graph: convert() measures them once, so calibration runs at float
speed for weights instead of re-observing them every batch. Every other group keeps an observer
per key, as torchao's prepare_pt2e gives it, because foreign observers may look for one (ExecuTorch's
ConcatObserver finds each concat input's observer in the graph): a group mixing a weight and
activations (an embedding table whose looked-up rows share its encoding), values computed from
weights only (a transposed weight, an LSTM's ``zeros`` state) and QAT weights. convert() still
stores all of them as integers (see ``flow.constants``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from quantplug.annotation.spec_view import SpecKind, spec_kind
from quantplug.errors import AnnotationError, QuantplugError
from quantplug.flow.batchnorm import fold_batch_norm
from quantplug.flow.fast_matching import fast_partition_matching
from quantplug.flow.graph_copy import compile_now, paused_gc, working_copy
from quantplug.observers.accelerated import accelerate, clonable, fresh_copy
from quantplug.observers.factory import create_observer
from quantplug.sharing.keys import AnnotatedKeys, collect_keys, key_of
from quantplug.sharing.problem import solve
from quantplug.sharing.resolution import Key, SharingGroups, describe_key
from quantplug.validation.report import ValidationReport

STATE_KEY = "quantplug_prepared"
OBSERVERS = "quantplug_observers"
#: node meta naming the float-program node a node descends from (kept through prepare/convert)
DEBUG_HANDLE_KEY = "quantplug_debug_handle"


@dataclass
class Group:
    """One sharing group: its spec, its keys, and whether only parameters/buffers flow through it.

    ``constant`` groups are quantized at convert from the parameters' values (no observer runs
    during calibration); in QAT no group is, since training changes the weights.
    """

    gid: int
    spec: Any
    keys: list[Key]
    constant: bool
    dynamic: bool

    @property
    def target(self) -> str:
        return f"{OBSERVERS}.g{self.gid}"

    def describe(self) -> str:
        shown = ", ".join(describe_key(k) for k in self.keys[:3])
        more = f" and {len(self.keys) - 3} more" if len(self.keys) > 3 else ""
        return shown + more


@dataclass
class PreparedState:
    """What convert() needs beyond the prepared graph itself (kept in ``gm.meta``)."""

    groups: list[Group]
    group_of: dict[Key, int]
    qat: bool
    backend: str | None
    validation: ValidationReport | None = None
    #: keys of constant groups, quantized by convert as observers would have been:
    #: node outputs (name -> group id) and input edges ((producer, consumer) -> group id)
    constant_outputs: dict[str, int] = field(default_factory=dict)
    constant_edges: dict[tuple[str, str], int] = field(default_factory=dict)

    def observer(self, gm: GraphModule, gid: int) -> nn.Module:
        return getattr(getattr(gm, OBSERVERS), f"g{gid}")


def _call(quantizer: Any, method: str, gm: GraphModule) -> Any:
    fn = getattr(quantizer, method, None)
    return fn(gm) if callable(fn) else None


def prepare(
    program: torch.export.ExportedProgram | GraphModule, quantizer: Any, *, qat: bool = False
) -> GraphModule:
    """Annotate ``program`` with ``quantizer`` and insert observers (or fake-quants if ``qat``).

    Args:
        program: an ``ExportedProgram`` or its ``GraphModule``; never modified.
        quantizer: a quantplug ``Quantizer`` or any PT2E quantizer (``annotate``, ``validate``,
            optional ``transform_for_annotation``), e.g. torchao's X86InductorQuantizer or
            ExecuTorch's QnnQuantizer.
        qat: insert fake-quantize modules for quantization-aware training.

    Returns:
        A GraphModule to calibrate (or train) and pass to :func:`quantplug.convert`.
    """
    if not callable(getattr(quantizer, "annotate", None)):
        raise QuantplugError(
            f"{type(quantizer).__name__} is not a quantizer (no annotate method); "
            "use quantplug.get_quantizer(name, ...) or a PT2E Quantizer"
        )
    with paused_gc():
        return _prepare(program, quantizer, qat=qat)


def _prepare(
    program: torch.export.ExportedProgram | GraphModule, quantizer: Any, *, qat: bool
) -> GraphModule:
    gm = working_copy(program, lazy=True)  # compiled once, below, after observers are in
    for node in gm.graph.nodes:  # survives every copy; the numeric debugger matches on it
        node.meta.setdefault(DEBUG_HANDLE_KEY, node.name)
    if qat:
        _own_parameters(gm)  # training must not write the caller's weights
    else:
        fold_batch_norm(gm)
    transformed = _call(quantizer, "transform_for_annotation", gm)
    if isinstance(transformed, GraphModule):
        gm = transformed
    with fast_partition_matching(gm):  # same partitions, found from an index (see fast_matching)
        _call(quantizer, "annotate", gm)
    report = _call(quantizer, "validate", gm)
    keys = collect_keys(gm.graph)
    problem = keys.problem(gm.graph)
    resolver = getattr(quantizer, "resolve_sharing", None)
    groups = resolver(problem) if callable(resolver) else solve(problem)
    state = _build_groups(gm, keys, groups, qat=qat, backend=getattr(quantizer, "backend", None))
    state.validation = report if isinstance(report, ValidationReport) else None
    observers = _create_observers(state, keys)
    callback = getattr(quantizer, "prepare_obs_or_fq_callback", None)
    if callable(callback):
        observers = _run_pt2e_callback(gm, callback, state, observers)
    container = nn.Module()
    for gid, obs in observers.items():
        container.add_module(f"g{gid}", accelerate(obs))
    if hasattr(gm, OBSERVERS):
        raise QuantplugError(
            "this model is already prepared (it has quantplug observers); prepare the float program"
        )
    gm.add_module(OBSERVERS, container)
    _insert_observer_nodes(gm, state)
    compile_now(gm)
    gm.meta[STATE_KEY] = state
    return gm


def _own_parameters(gm: GraphModule) -> None:
    """Give the prepared module private copies of its parameters and buffers (QAT updates them)."""
    for module in gm.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(param.detach().clone(), param.requires_grad)
        for name, buf in list(module._buffers.items()):
            if buf is not None:  # batch-norm statistics move during training too
                module._buffers[name] = buf.detach().clone()


def _build_groups(
    gm: GraphModule, keys: AnnotatedKeys, groups: SharingGroups, *, qat: bool, backend: str | None
) -> PreparedState:
    attrs = {n.name for n in gm.graph.nodes if n.op == "get_attr"} if not qat else set()

    def from_constant(key: Key) -> bool:
        return (key[0] if isinstance(key, tuple) else key) in attrs

    result: list[Group] = []
    for gid, members in enumerate(groups.members):
        spec = keys.specs[groups.representative[gid]]
        dynamic = bool(getattr(spec, "is_dynamic", False))
        constant = not dynamic and all(from_constant(k) for k in members)
        result.append(Group(gid=gid, spec=spec, keys=list(members), constant=constant, dynamic=dynamic))
    state = PreparedState(groups=result, group_of=dict(groups.group_of), qat=qat, backend=backend)
    for key, gid in groups.group_of.items():
        if not result[gid].constant:
            continue
        if not isinstance(key, tuple):
            state.constant_outputs[key] = gid
        elif groups.group_of.get(key[0]) != gid:  # an edge in its producer's group reads its output
            state.constant_edges[key] = gid
    return state


def _create_observers(state: PreparedState, keys: AnnotatedKeys) -> dict[int, nn.Module]:
    observers: dict[int, nn.Module] = {}
    pending = [g for g in state.groups]
    prototypes: dict[int, nn.Module] = {}  # id(spec) -> an untouched observer built from it
    # derived groups need their sources' observers; resolve in dependency order
    while pending:
        progressed = False
        rest = []
        for group in pending:
            spec = group.spec
            if spec_kind(spec) is SpecKind.DERIVED:
                src_gids = [state.group_of[key_of(k)] for k in spec.derived_from]
                if any(g not in observers for g in src_gids):
                    rest.append(group)
                    continue
                observers[group.gid] = create_observer(
                    spec, qat=state.qat, sources=[observers[g] for g in src_gids]
                )
            else:
                prototype = prototypes.get(id(spec))
                if prototype is not None:  # groups sharing one spec object: copy, don't construct
                    observers[group.gid] = fresh_copy(prototype)
                else:
                    observers[group.gid] = create_observer(spec, qat=state.qat)
                    if clonable(observers[group.gid]):
                        prototypes[id(spec)] = fresh_copy(observers[group.gid])
            progressed = True
        if not progressed:
            raise AnnotationError(
                "derived specs depend on each other in a cycle: " + "; ".join(g.describe() for g in rest)
            )
        pending = rest
    return observers


def _run_pt2e_callback(
    gm: GraphModule, callback: Any, state: PreparedState, observers: dict[int, nn.Module]
) -> dict[int, nn.Module]:
    """PT2E's ``prepare_obs_or_fq_callback``: it sees and may replace per-key observers."""
    nodes = {n.name: n for n in gm.graph.nodes}

    def edge_or_node(key: Key) -> Any:
        return (nodes[key[0]], nodes[key[1]]) if isinstance(key, tuple) else nodes[key]

    mapping = {edge_or_node(k): observers[g] for k, g in state.group_of.items()}
    callback(gm, mapping)
    for group in state.groups:
        chosen = mapping[edge_or_node(group.keys[0])]
        observers[group.gid] = chosen
    return observers


def _insert_observer_nodes(gm: GraphModule, state: PreparedState) -> None:
    graph = gm.graph
    nodes = list(graph.nodes)
    by_name = {n.name: n for n in nodes}
    last_placeholder = None
    for n in nodes:
        if n.op == "placeholder":
            last_placeholder = n

    def new_observer(source: Node, group: Group) -> Node:
        anchor = last_placeholder if source.op == "placeholder" and last_placeholder is not None else source
        with graph.inserting_after(anchor):
            obs = graph.call_module(group.target, (source,))
        for k in ("val", "tensor_meta", "nn_module_stack", "stack_trace", DEBUG_HANDLE_KEY):
            if k in source.meta:
                obs.meta[k] = source.meta[k]
        obs.meta["quantplug_group"] = group.gid
        return obs

    output_obs: dict[str, Node] = {}
    for n in nodes:
        gid = state.group_of.get(n.name)
        if gid is None or state.groups[gid].constant:
            continue
        obs = new_observer(n, state.groups[gid])
        n.replace_all_uses_with(obs, delete_user_cb=lambda user, obs=obs: user is not obs)
        output_obs[n.name] = obs

    edge_obs: dict[tuple[str, int], Node] = {}
    for key, gid in state.group_of.items():
        if not isinstance(key, tuple):
            continue
        group = state.groups[gid]
        producer_name, consumer_name = key
        if group.constant or state.group_of.get(producer_name) == gid:
            continue
        current = output_obs.get(producer_name, by_name[producer_name])
        edge_observer = edge_obs.get((producer_name, gid))
        if edge_observer is None:
            edge_observer = edge_obs[(producer_name, gid)] = new_observer(current, group)
        by_name[consumer_name].replace_input_with(current, edge_observer)
