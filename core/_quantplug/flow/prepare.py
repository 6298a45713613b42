"""prepare(): annotate -> resolve sharing -> validate -> one observer per group.

Works on a copy of the caller's graph, inserts observers with O(1) naming (group ``N``'s observer
is the top-level submodule ``activation_post_process_N``, torchao's prefix) and recompiles once.
Groups whose tensors are all parameters or buffers (weights, biases) are *parked*
(:mod:`_quantplug.observers.parked`): their observer's node reads the constant and the
constant's readers read the node, as torchao's, but it passes the constant through unobserved, so
calibration runs at float speed for weights; convert() measures them once. The node keeps the
observer reachable from the graph, so a rewrite that deletes uncalled submodules (torchao's
``move_exported_model_to_eval``) keeps it.
Every other group keeps an observer per key, as torchao's prepare_pt2e gives it, because foreign
observers may look for one (ExecuTorch's ConcatObserver finds each concat input's observer in the
graph): a group mixing a weight and activations (an embedding table whose looked-up rows share
its encoding), values computed from weights only (a transposed weight, an LSTM's ``zeros`` state)
and QAT weights. convert() still stores all of them as integers (see ``flow.constants``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from _quantplug.algorithms.config import Algorithms, configured
from _quantplug.algorithms.guard import FlowSteps, flat_batches
from _quantplug.algorithms.registry import resolve_algorithms
from _quantplug.algorithms.taps import install_collectors
from _quantplug.algorithms.transforms import run_transforms
from _quantplug.annotation.spec_view import SpecKind, is_float_spec, is_per_channel, spec_kind
from _quantplug.deprecated import warn_old_module_attribute
from _quantplug.errors import AnnotationError, QuantplugError
from _quantplug.flow.convert import convert
from _quantplug.flow.exported_modes import ExportedModes
from _quantplug.flow.loop_bodies import loop_bodies, replace_loop_bodies
from _quantplug.flow.qdq_meta import FROM_NODE, observes_output
from _quantplug.flow.state import Group, PreparedState
from _quantplug.graph.calls import Call, in_spec_of, input_misfit
from _quantplug.graph.constants import written
from _quantplug.graph.index_arithmetic import index_arithmetic
from _quantplug.graph.mutation import buffer_state_keys, buffer_writes, mutated_aliases
from _quantplug.graph.softmax_inputs import score_values
from _quantplug.graph.working_copy import add_node, compile_now, paused_gc, working_copy
from _quantplug.meta import (
    ALGORITHMS_KEY,
    BACKEND_KEY,
    DEBUG_HANDLE_KEY,
    GROUP_KEY,
    PARKED_KEY,
    STATE_KEY,
    observer_children,
)
from _quantplug.observers.copies import copier, fresh_copy
from _quantplug.observers.factory import create_observer
from _quantplug.observers.fixed import FixedQParamsObserver
from _quantplug.observers.nonfinite import check_policy
from _quantplug.observers.nonfinite import configure as configure_nonfinite
from _quantplug.observers.parked import park
from _quantplug.peers import torch_module_call  # noqa: F401  (installs the observers' call)
from _quantplug.peers.torch_codegen import generating_code
from _quantplug.peers.torchao_matching import fast_partition_matching
from _quantplug.peers.torchao_observers import accelerator, clonable
from _quantplug.quantizer.quantizer import Quantizer, coverage_of
from _quantplug.rewrites.pipeline import rewrite_for_annotation
from _quantplug.rewrites.qat_batchnorm import fuse_conv_bn_for_training
from _quantplug.sharing.keys import AnnotatedKeys, collect_keys, key_of
from _quantplug.sharing.problem import solve
from _quantplug.sharing.resolution import Key, SharingGroups, describe_key
from _quantplug.validation.engine import CalibratedPlan
from _quantplug.validation.report import ValidationReport

logger = logging.getLogger("quantplug.flow.prepare")


class PreparedModule(ExportedModes, GraphModule):
    """What :func:`prepare` returns: a GraphModule whose observer nodes also resolve by name.

    A sharing group has one observer (``activation_post_process_N``) called by a node per key, so
    the second node calling it is named ``activation_post_process_N_1``. Observers written for
    torchao's prepare, where each node's name is its own module's attribute name, look their peers
    up as ``getattr(gm, node.name)`` (ExecuTorch's ``ConcatObserver`` does, to widen its inputs'
    observers): here any attribute that is not found otherwise and names a ``call_module`` node
    resolves to the module that node calls. The lookup only runs on a miss and builds its name
    table once (again if the graph changed). ``train()``/``eval()`` raise as on an exported module
    (:mod:`_quantplug.flow.exported_modes`).
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run one calibration call; a call torch refuses is named by the input that does not fit.

        The check runs only after torch has refused the call, so calls that fit cost nothing and
        another batch size, which often runs on a static export, is still accepted.
        """
        try:
            return super().__call__(*args, **kwargs)
        except QuantplugError:
            raise
        except (TypeError, RuntimeError, ValueError, IndexError) as exc:
            misfit = input_misfit(self, Call(args, kwargs))
            if misfit is None:
                raise
            raise misfit from exc

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            target = self._module_name_table(name)
            if target is None or target == name:  # the node's own module, gone: nothing else to find
                raise
            return self.get_submodule(target)

    def _module_name_table(self, name: str) -> str | None:
        graph = self.__dict__.get("_graph")
        if graph is None:
            return None
        # rebuilt only when the graph changed since: every miss rebuilding it made the misses of a
        # caller probing for free names (convert names each constant it adds) quadratic
        stamp = _graph_stamp(graph)
        cached = self.__dict__.get("_quantplug_call_module_names")
        if cached is None or cached[0] != stamp:
            table = {n.name: str(n.target) for n in graph.nodes if n.op == "call_module"}
            cached = self.__dict__["_quantplug_call_module_names"] = (stamp, table)
        return cached[1].get(name)


def _graph_stamp(graph: Graph) -> tuple[Graph, int, int]:
    """Changes whenever a node is added, erased or renamed: torch.fx registers every name it
    gives (a node's, a rename's) in the graph's namespace and never takes one back. On a torch
    without that namespace every call is a new stamp (the table is rebuilt at each miss, as
    before: slower, never stale)."""
    namespace = getattr(graph, "_graph_namespace", None)
    used = getattr(namespace, "_used_names", None)
    return graph, len(graph.nodes), len(used) if used is not None else -next(_UNSTAMPED)


#: stamps of graphs without a name namespace: each one differs from every other
_UNSTAMPED = itertools.count(1)


class _Submodule:
    """``prepared.<name>`` for a top-level submodule, read from the module's ``_modules`` without
    the failed attribute look-up that precedes ``Module.__getattr__`` (an exception raised and
    caught inside Python: about 1 us, and the generated code reads an observer this way for
    every observer call, hundreds per forward; this: 0.15 us).

    A non-data descriptor on the instance's own class: the instance ``__dict__`` still comes first,
    and a name not (or no longer) among the submodules resolves exactly as without it
    (``Module.__getattr__``: parameters, buffers, modules; then :class:`PreparedModule`'s node
    names), so ``setattr``, ``delattr``, ``add_module`` and ``hasattr`` behave as on any module.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        found = obj.__dict__["_modules"].get(self.name, _ABSENT)
        return obj.__getattr__(self.name) if found is _ABSENT else found


_ABSENT = object()


def _as_prepared_module(gm: GraphModule) -> None:
    """Make ``gm`` a :class:`PreparedModule` in place (before its code is generated).

    GraphModule gives every instance its own class (its ``forward`` is installed on it); the
    per-instance class here is named like torch's, whose copying finds ``PreparedModule`` beneath it.
    Its top-level submodules (the observers among them) are read through :class:`_Submodule`.
    """

    class GraphModuleImpl(PreparedModule):
        pass

    for name in gm._modules:
        if name.isidentifier() and not hasattr(GraphModuleImpl, name):
            setattr(GraphModuleImpl, name, _Submodule(name))
    gm.__class__ = GraphModuleImpl


def _call(quantizer: Any, method: str, gm: GraphModule) -> Any:
    fn = getattr(quantizer, method, None)
    return fn(gm) if callable(fn) else None


def prepare(
    program: torch.export.ExportedProgram | GraphModule,
    quantizer: Any,
    *,
    qat: bool = False,
    nonfinite: str = "error",
    algorithms: Algorithms | Sequence[Any] | None = None,
    **deprecated: Any,
) -> GraphModule:
    """Annotate ``program`` with ``quantizer`` and insert observers (or fake-quants if ``qat``).

    Args:
        program: an ``ExportedProgram`` or its ``GraphModule``; never modified (nor are its
            tensors, by calibration: state the program writes, such as training-mode batch-norm
            statistics, is copied).
        quantizer: a quantplug ``Quantizer`` or any PT2E quantizer (``annotate``, ``validate``,
            optional ``transform_for_annotation``), e.g. torchao's X86InductorQuantizer or
            ExecuTorch's QnnQuantizer.
        qat: insert fake-quantize modules for quantization-aware training.
        nonfinite: what NaN/inf values reaching an observer do: ``"error"`` raises
            :class:`~_quantplug.errors.NonFiniteError` naming the node(s) for a NaN, or an
            infinity in the model's inputs, and leaves infinities the model computes (attention
            masks) out of the statistics; ``"strict"`` raises for every NaN/inf; ``"ignore"``
            leaves them all out and counts them (see :mod:`_quantplug.observers.nonfinite`).
        algorithms: accuracy algorithms, with their data and guard:
            :class:`~_quantplug.algorithms.config.Algorithms` (``quantplug.Algorithms``), or a
            plain list of them (names from ``quantplug.list_algorithms()``, ``(name, {option:
            value})`` pairs or configured objects), which is ``Algorithms(list)``. Unknown names
            raise :class:`~_quantplug.errors.UnknownAlgorithmError`.
        **deprecated: ``calibration=``, ``algorithm_guard=`` and ``held_out=``, the keywords
            ``Algorithms`` replaced, work until 0.4.0 with a ``DeprecationWarning``.

    Returns:
        A GraphModule to calibrate (or train) and pass to :func:`quantplug.convert`.
    """
    config = configured(algorithms, deprecated, function="prepare")
    if not callable(getattr(quantizer, "annotate", None)):
        raise QuantplugError(
            f"{type(quantizer).__name__} is not a quantizer (no annotate method); "
            "use quantplug.get_quantizer(name, ...) or a PT2E Quantizer"
        )
    _check_float_program(program)
    _check_qat_agrees(quantizer, qat)
    check_policy(nonfinite)
    chosen = resolve_algorithms(config.algorithms)  # issue 15: names -> configured objects, before any work
    with paused_gc():
        return _prepare(program, quantizer, qat=qat, nonfinite=nonfinite, algorithms=chosen, config=config)


def __getattr__(name: str) -> Any:
    """``OBSERVERS``, the name of 0.1.0's observer container (``quantplug.flow.prepare.OBSERVERS``),
    resolves until 0.4.0 with a DeprecationWarning: there is no container any more."""
    if name == "OBSERVERS":
        warn_old_module_attribute(
            "quantplug.flow.prepare.OBSERVERS",
            "observers are top-level modules named activation_post_process_N (quantplug.backend."
            "prepared_state(prepared).groups[i].target names group i's); no 'quantplug_observers' "
            "container exists",
        )
        return "quantplug_observers"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: prepare and convert as the algorithm guard quantizes with them (the algorithms, a layer below
#: flow, are handed these and never import flow)
STEPS = FlowSteps(prepare=prepare, convert=convert)


def _check_float_program(program: Any) -> None:
    """A prepared module given again fails here, not deep inside annotation.

    A program that already holds quantize/dequantize ops (a converted program, or one embedding
    a converted part, re-exported) is prepared as torchao's ``prepare_pt2e`` prepares it: those
    ops are ops like any other, the quantizer annotates what it wants around them, and convert
    leaves them as they are (re-entrant quantization). A *prepared* module is refused: its
    observers have not been turned into Q/DQ ops yet, and observing observers gives nested
    encodings no backend runs (torchao nests them).
    """
    gm = program.graph_module if isinstance(program, torch.export.ExportedProgram) else program
    if isinstance(gm, GraphModule) and (STATE_KEY in gm.meta or observer_children(gm)):
        raise QuantplugError(
            "this module is already prepared (it holds quantplug observers); convert it first "
            "(quantplug.convert), then prepare the converted program to quantize more of it, or prepare "
            "the float program (the ExportedProgram you exported)"
        )


def _check_qat_agrees(quantizer: Any, qat: bool) -> None:
    """A quantizer built with its backend's QAT option wants prepare(qat=True), and vice versa."""
    info = getattr(quantizer, "info", None)
    option = getattr(info, "qat_option", None)
    options = getattr(quantizer, "options", None)
    if not option or not isinstance(options, dict) or not isinstance(options.get(option), bool):
        return
    if options[option] != qat:
        backend = getattr(quantizer, "backend", "?")
        if qat:
            raise QuantplugError(
                f"prepare(..., qat=True) with a {backend!r} quantizer built without {option}=True: its "
                f"configs are the post-training ones; build it with get_quantizer({backend!r}, {option}=True)"
            )
        raise QuantplugError(
            f"the {backend!r} quantizer was built with {option}=True (quantization-aware training configs) "
            f"but prepare() was called without qat=True; call prepare(program, quantizer, qat=True), or "
            f"drop {option}=True for post-training quantization"
        )


def _prepare(
    program: torch.export.ExportedProgram | GraphModule,
    quantizer: Any,
    *,
    qat: bool,
    nonfinite: str,
    algorithms: list[Any],
    config: Algorithms,
) -> GraphModule:
    gm = working_copy(program, lazy=True)  # compiled once, below, after observers are in
    rewrite_for_annotation(gm, qat=qat, algorithms=bool(algorithms))
    guard = config.guard
    given = None if isinstance(config.held_out, str) else config.held_out
    split = config.held_out is None  # the default: every 4th calibration batch held out
    judged = (  # the guard's held-out batches, flat and checked against the program
        flat_batches(gm, given, in_spec_of(program), "held_out", nonfinite)
        if algorithms and guard and given is not None
        else None
    )
    if algorithms:  # algorithm hook 1: float-program transforms (CLE, SmoothQuant) on this copy
        gm, undone = run_transforms(
            gm,
            algorithms,
            config.calibration,
            in_spec_of(program),
            quantizer,
            guard=STEPS if guard and not qat else None,  # a QAT model is trained after: nothing to judge now
            nonfinite=nonfinite,
            held_out=judged,
            split=split,
            guard_loss=config.guard_loss,
        )
    transformed = _call(quantizer, "transform_for_annotation", gm)
    if isinstance(transformed, GraphModule):
        gm = transformed
    with fast_partition_matching(gm):  # same partitions, found from an index (see fast_matching)
        _call(quantizer, "annotate", gm)
    if qat:  # conv + batch norm simulate their folding under fake-quantize (PT2E's QAT fusion)
        fuse_conv_bn_for_training(gm)
    keys = collect_keys(gm.graph)
    _check_channel_axes(keys)
    bodies = loop_bodies(gm)
    if not keys.specs and not bodies:  # a loop body's own prepare warns for the body
        _warn_nothing_quantized(gm, quantizer)
    problem = keys.problem(gm.graph)
    resolver = getattr(quantizer, "resolve_sharing", None)
    groups = resolver(problem) if callable(resolver) else solve(problem)
    report, checks = _validate(quantizer, gm, groups)
    # in-place writes into buffers (the op must get the buffer), and every read of such a buffer:
    # state, which no quantize may clamp to the range of its first values (whatever annotated it)
    unobserved: set[Key] = {*buffer_writes(gm.graph), *buffer_state_keys(gm.graph)}
    state = _build_groups(gm, keys, groups, qat=qat, backend=getattr(quantizer, "backend", None))
    state.validation = report if isinstance(report, ValidationReport) else None
    state.calibrated_checks = checks
    observers = _create_observers(state, keys)
    for group in state.groups:  # only keys left unobserved (buffer writes and reads): no Q/DQ reads it
        if all(key in unobserved for key in group.keys):
            observers[group.gid] = FixedQParamsObserver(1.0, 0)
    callback = getattr(quantizer, "prepare_obs_or_fq_callback", None)
    if callable(callback):
        observers = _run_pt2e_callback(gm, callback, state, observers)
    inputs = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    scores = score_values(gm.graph)
    accelerate = accelerator()
    for gid, obs in observers.items():
        obs = accelerate(obs)
        group = state.groups[gid]
        producers = {k[0] if isinstance(k, tuple) else k for k in group.keys}
        configure_nonfinite(
            obs,
            nonfinite,
            group.describe(),
            observes_input=bool(producers & inputs),
            observes_scores=bool(producers & scores),
        )
        if group.constant:
            park(obs)
        gm.add_module(group.target, obs)
    _insert_observer_nodes(gm, state, unobserved)
    _count_calls_per_pass(gm, state)
    if algorithms:  # algorithm hook 2: taps feeding the algorithms' per-layer collectors
        gm.meta[ALGORITHMS_KEY] = install_collectors(
            gm,
            state,
            algorithms,
            nonfinite,
            guard,
            held_out=judged,
            split=split,
            guard_loss=config.guard_loss,
        )
        gm.meta[ALGORITHMS_KEY].undone = undone
    if bodies:  # torchao's prepare_pt2e: each loop body prepared with the same quantizer
        each = partial(_prepare, quantizer=quantizer, qat=qat, nonfinite=nonfinite, algorithms=[])
        replace_loop_bodies(gm, gm, partial(each, config=config))
    _as_prepared_module(gm)
    with generating_code(gm.graph):
        compile_now(gm)
    gm.meta[STATE_KEY] = state
    gm.meta[BACKEND_KEY] = state.backend
    return gm


def _check_channel_axes(keys: AnnotatedKeys) -> None:
    """A static per-channel spec needs its ``ch_axis``: without one its observer fails on the first
    tensor it sees (torchao's with a TypeError, in calibration or, for a weight, in convert). Named
    here, at prepare, by the key that carries it. (Dynamic per-channel specs mean per token.)"""
    for key, spec in keys.specs.items():
        if (
            spec_kind(spec) is SpecKind.PLAIN
            and is_per_channel(spec)
            and getattr(spec, "ch_axis", None) is None
            and not getattr(spec, "is_dynamic", False)
            and _observer_axis(spec) is None  # torchao's observers default to one (axis 0): used
        ):
            raise AnnotationError(
                f"the per-channel spec of {describe_key(key)} has no ch_axis: set "
                "QuantizationSpec(..., ch_axis=N), the dimension that holds the channels (0 for a "
                "conv or linear weight, 1 for a transposed conv's)"
            )


def _observer_axis(spec: Any) -> int | None:
    """The channel axis the spec's observer takes when the spec names none, as torchao's prepare
    builds it: a ``PerChannel...`` observer class gets the spec's ``ch_axis`` (None: it fails on its
    first tensor), any other (a fake-quantize wrapping one) keeps its own default. None when
    there is no axis to take."""
    ctor = getattr(spec, "observer_or_fake_quant_ctr", None)
    partial = getattr(ctor, "p", None)
    cls = getattr(partial, "func", ctor)
    if "PerChannel" in getattr(cls, "__name__", ""):
        return None
    try:
        observer = ctor() if callable(ctor) else None
    except Exception:  # an observer that cannot be built without more: decided where it is built
        return 0
    axis = getattr(observer, "ch_axis", None)
    return axis if isinstance(axis, int) else None


def _warn_nothing_quantized(gm: GraphModule, quantizer: Any) -> None:
    """A preset whose scope misses every op of a model (weight-only int4, which quantizes linear
    layers, on a network of convolutions) would otherwise convert to the float model in silence,
    and the report would read an infinite SQNR as a perfect quantization."""
    report = coverage_of(gm)
    ops = ", ".join(f"{op} x{n}" for op, n in report.float_ops().most_common(5))
    reasons = sorted({n.reason for n in report.float_nodes})[:3]
    logger.warning(
        "prepare: %r quantizes no node of this program, so convert gives back the float model. "
        "Its most common ops: %s (%s). Choose a preset or backend whose scope covers them; "
        "quantizer.coverage(program).format() gives the reason for every node.",
        quantizer,
        ops or "none",
        "; ".join(reasons) or "no op nodes",
    )


def _validate(quantizer: Any, gm: GraphModule, groups: SharingGroups) -> tuple[Any, CalibratedPlan | None]:
    """Constraint validation (raises when strict) and the checks convert repeats on calibrated
    encodings. A quantplug Quantizer checks relations between ports against the resolved groups;
    a foreign PT2E quantizer gets its own ``validate(model)``."""
    if isinstance(quantizer, Quantizer):
        return quantizer.validate(gm, sharing=groups), quantizer.calibrated_checks(gm, groups)
    return _call(quantizer, "validate", gm), None


def _build_groups(
    gm: GraphModule, keys: AnnotatedKeys, groups: SharingGroups, *, qat: bool, backend: str | None
) -> PreparedState:
    # parameters and buffers that no op of the graph writes (a buffer updated in place, a running
    # state, changes at every forward: its group keeps its observer and is quantized at run time)
    attrs = {n.name for n in gm.graph.nodes if n.op == "get_attr" and not written(n)} if not qat else set()

    def from_constant(key: Key) -> bool:
        return (key[0] if isinstance(key, tuple) else key) in attrs

    result: list[Group] = []
    for gid, members in enumerate(groups.members):
        spec = keys.specs[groups.representative[gid]]
        dynamic = bool(getattr(spec, "is_dynamic", False))
        floating = is_float_spec(spec)  # observed in the graph as torchao does (a placeholder observer)
        constant = not dynamic and not floating and all(from_constant(k) for k in members)
        result.append(
            Group(
                gid=gid,
                spec=spec,
                keys=list(members),
                constant=constant,
                dynamic=dynamic,
                per_pass=gid in groups.observed_per_pass,
                floating=floating,
            )
        )
    state = PreparedState(groups=result, group_of=dict(groups.group_of), qat=qat, backend=backend)
    for key, gid in groups.group_of.items():
        if not result[gid].constant:
            continue
        if not isinstance(key, tuple):
            state.constant_outputs[key] = gid
        elif groups.group_of.get(key[0]) != gid:  # an edge in its producer's group reads its output
            state.constant_edges[key] = gid
    return state


def _count_calls_per_pass(gm: GraphModule, state: PreparedState) -> None:
    """Tell the observer of each per-pass group how many of its calls make one forward pass (its
    call sites in the graph: every node runs once per pass), or in QAT of the observer its
    fake-quant module wraps. Observers without a ``calls_per_pass`` (min-max ones, whose result
    does not depend on it) are left alone."""
    per_pass = {g.target: g for g in state.groups if g.per_pass and not g.constant}  # parked: never called
    if not per_pass:
        return
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in per_pass:
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    for target, count in calls.items():
        obs = state.observer(gm, per_pass[target].gid)
        obs = getattr(obs, "activation_post_process", obs)  # QAT: the observer a fake-quant wraps
        if hasattr(obs, "calls_per_pass"):
            setattr(obs, "calls_per_pass", count)  # noqa: B010 (nn.Module's typed __setattr__)


def _create_observers(state: PreparedState, keys: AnnotatedKeys) -> dict[int, nn.Module]:
    observers: dict[int, nn.Module] = {}
    pending = [g for g in state.groups]
    prototypes: dict[int, Callable[[], nn.Module]] = {}  # id(spec) -> copies of an observer built from it
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
                copy_prototype = prototypes.get(id(spec))
                if copy_prototype is not None:  # groups sharing one spec object: copy, don't construct
                    observers[group.gid] = copy_prototype()
                else:
                    observers[group.gid] = create_observer(spec, qat=state.qat)
                    if clonable(observers[group.gid]):
                        prototypes[id(spec)] = copier(fresh_copy(observers[group.gid]))
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


def _insert_observer_nodes(gm: GraphModule, state: PreparedState, unobserved: set[Key]) -> None:
    graph = gm.graph
    nodes = list(graph.nodes)
    by_name = {n.name: n for n in nodes}
    last_placeholder = None
    for n in nodes:
        if n.op == "placeholder":
            last_placeholder = n

    calls: dict[int, int] = {}  # group id -> its observer's nodes so far

    def new_observer(source: Node, group: Group, before: Node | None = None) -> Node:
        anchor = last_placeholder if source.op == "placeholder" and last_placeholder is not None else source
        # named explicitly: torch.fx would name a second call of activation_post_process_5 as
        # activation_post_process_6 (it counts up the numeric suffix), which is another group's
        # observer, and code resolving getattr(gm, node.name) would find the wrong one
        count = calls[group.gid] = calls.get(group.gid, -1) + 1
        name = group.target if not count else f"{group.target}_{count}"
        with graph.inserting_before(before) if before is not None else graph.inserting_after(anchor):
            obs = add_node(graph, "call_module", group.target, (source,), None, name)
        if obs.name != name:  # the program already had a node of that name
            raise QuantplugError(
                f"cannot name the observer node of {group.describe()} {name!r}: the program already has "
                "a node of that name; rename it (activation_post_process_* names belong to observers)"
            )
        for k in ("val", "tensor_meta", "nn_module_stack", "stack_trace", DEBUG_HANDLE_KEY):
            if k in source.meta:
                obs.meta[k] = source.meta[k]
        obs.meta[GROUP_KEY] = group.gid
        return obs

    # index arithmetic left float reads a quantized producer's float value: a dequantized whole
    # number can come back just below itself and its cast to integers would truncate it
    edges_observed = {key[1] for key in state.group_of if isinstance(key, tuple)}
    float_readers = {n.name for n in index_arithmetic(graph)} - edges_observed
    _insert_parked_observers(graph, state, new_observer, float_readers)
    output_obs: dict[str, Node] = {}
    for n in nodes:
        gid = state.group_of.get(n.name)
        if gid is None or state.groups[gid].constant or n.name in unobserved:
            continue
        obs = new_observer(n, state.groups[gid])
        if observes_output(n):  # torchao's provenance: the numeric debugger traces it to n
            obs.meta[FROM_NODE] = n.meta[FROM_NODE]
        n.replace_all_uses_with(
            obs, delete_user_cb=lambda user, obs=obs: user is not obs and user.name not in float_readers
        )
        output_obs[n.name] = obs

    # a tensor the program writes in place later (``out = zeros_like(h); out[:, t] = ...``) holds
    # its final values only once the writes ran: its readers observe it just before they read it,
    # each on its own, not where it was made (where the observer saw zeros and convert's quantize
    # copied them: RWKV's attention read an all-zero output, -2.2 dB at int8)
    written_later = {n.name for n in mutated_aliases(graph)}
    edge_obs: dict[tuple[str, int], Node] = {}
    for key, gid in state.group_of.items():
        if not isinstance(key, tuple):
            continue
        group = state.groups[gid]
        producer_name, consumer_name = key
        if group.constant or state.group_of.get(producer_name) == gid or key in unobserved:
            continue
        current = output_obs.get(producer_name, by_name[producer_name])
        consumer = by_name[consumer_name]
        if producer_name in written_later:
            consumer.replace_input_with(current, new_observer(current, group, before=consumer))
            continue
        edge_observer = edge_obs.get((producer_name, gid))
        if edge_observer is None:
            edge_observer = edge_obs[(producer_name, gid)] = new_observer(current, group)
        consumer.replace_input_with(current, edge_observer)


def _insert_parked_observers(
    graph: Graph,
    state: PreparedState,
    new_observer: Callable[..., Node],
    float_readers: set[str],
) -> None:
    """A constant group's observer is parked (:mod:`_quantplug.observers.parked`): one node per
    constant it measures, and that constant's readers in the group read it, as torchao's weight
    observers are read (``linear(x, activation_post_process_1(weight), bias)``); it passes the
    constant through, so calibration runs at float speed.

    Each node sits just before its first reader (the algorithms' checkpoints resume before a
    weight's first read: a node at the top of the graph would make every resume a full run).
    Every parked node reads the constant itself (convert and :func:`~_quantplug.graph.attrs.
    behind_parked` find the constant as its argument); a reader's edge in another group than the
    constant's own output group reads that edge's node instead of the output's.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_name = {n.name: n for n in order}
    readers: dict[tuple[str, int], list[Node]] = {}  # (constant, group) -> its readers through it
    for key, gid in state.group_of.items():
        if not state.groups[gid].constant:
            continue
        if isinstance(key, tuple):
            if state.group_of.get(key[0]) != gid:  # else the constant's output node is read
                readers.setdefault((key[0], gid), []).append(by_name[key[1]])
        else:
            users = [u for u in by_name[key].users if u.name not in float_readers]
            readers.setdefault((key, gid), []).extend(users)

    first = {key: min(users, key=order.__getitem__) if users else None for key, users in readers.items()}

    def place(key: tuple[str, int]) -> tuple[int, int, str, int]:
        """Before its first reader, in that reader's argument order (no reader: after it)."""
        constant, reader = by_name[key[0]], first[key] or by_name[key[0]]
        inputs = reader.all_input_nodes
        return order[reader], inputs.index(constant) if constant in inputs else -1, *key

    parked: dict[tuple[str, int], Node] = {}
    for name, gid in sorted(readers, key=place):
        node = parked[(name, gid)] = new_observer(by_name[name], state.groups[gid], before=first[(name, gid)])
        node.meta[PARKED_KEY] = True
    outputs = {}  # constant -> its output group's parked node, read unless an edge has its own
    for (name, gid), node in parked.items():
        if state.group_of.get(name) == gid:
            outputs[name] = node
            for user in readers[(name, gid)]:
                user.replace_input_with(by_name[name], node)
    for (name, gid), node in parked.items():
        if state.group_of.get(name) != gid:
            for user in readers[(name, gid)]:
                user.replace_input_with(outputs.get(name, by_name[name]), node)
