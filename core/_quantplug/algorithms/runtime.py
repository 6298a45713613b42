"""Where prepare() and convert() call the algorithms' hooks (the torch-facing glue).

* :func:`run_transforms`: each algorithm's ``transform_program`` on prepare's working copy.
* :func:`install_collectors`: one tap node per weight site whose layer input some algorithm
  collects; the tap feeds the collectors and returns nothing (convert drops it).
* :func:`choose_weights`: at convert, each weight site's grid from its spec and observer, every
  algorithm's ``choose_weight`` in order, each choice checked against the grid.

The state between prepare and convert (algorithms, sites, collectors) lives in
``prepared.meta[RUN_KEY]``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Interpreter, Node

from _quantplug.algorithms import weight_layers
from _quantplug.algorithms.experts import (
    ExpertsLayer,
    experts_forward,
    experts_forward_in_out,
    experts_layer,
    packed_rows,
    routed_rows,
)
from _quantplug.algorithms.finite_inputs import finite_samples
from _quantplug.algorithms.guard import (
    GUARD_BATCHES,
    GUARD_BYTES,
    Candidate,
    ModelGuard,
    decibels,
    guard_batches,
    lower,
    output_tensors,
    quantized_error,
)
from _quantplug.algorithms.sequential import InputStore, QuantizedSimulation, stages
from _quantplug.algorithms.spec import LayerInputs, TransformContext, WeightChoice, WeightGrid, WeightSite
from _quantplug.algorithms.weight_layers import (
    HeldHessian,
    LayerHessian,
    hessian_memory_problem,
    share_hessians,
)
from _quantplug.annotation.spec_view import SpecKind, is_per_channel, spec_kind, spec_range
from _quantplug.errors import AlgorithmError, NonFiniteError, QuantplugError
from _quantplug.graph.attrs import fetch_attr, put_attr
from _quantplug.graph.recurrent import RecurrentLayout, RecurrentRole, recurrent_layout
from _quantplug.meta import ALGORITHM_TAP_KEY, FOLDED_FROM, TAPS
from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY
from _quantplug.observers.nonfinite import nonfinite_counts

logger = logging.getLogger("quantplug.algorithms")


#: ops whose weight (argument 1) acts on an input (argument 0) that quantplug can re-run
LAYER_OPS = frozenset(
    {
        "aten.linear.default",
        "aten.conv1d.default",
        "aten.conv2d.default",
        "aten.conv3d.default",
        "aten.conv_transpose1d.input",
        "aten.conv_transpose2d.input",
        "aten.conv_transpose3d.input",
    }
)


def algorithm_name(algorithm: Any) -> str:
    return str(getattr(algorithm, "name", "") or type(algorithm).__name__)


def flat_batches(
    gm: GraphModule, batches: Sequence[Any], in_spec: Any, what: str, nonfinite: str = "error"
) -> list[tuple[Any, ...]]:
    """The guard's held-out batches as the program's flat inputs (copies, so the caller may reuse
    its tensors), each checked against the program, and capped as the guard caps calibration
    batches (:func:`~_quantplug.algorithms.guard.guard_batches`). NaN/inf in them raise as they
    would in calibration data, unless ``nonfinite="ignore"`` (the guard then leaves the outputs
    they reach out of its measure)."""
    from _quantplug.graph.calls import Call, check_flat_inputs

    flat: list[tuple[Any, ...]] = []
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    for index, batch in enumerate(batches):
        inputs = Call.of(batch).flat(in_spec, what=f"{what} batch {index}")
        check_flat_inputs(gm, inputs, what=f"{what} batch {index}")
        for name, value in zip(placeholders, inputs):
            if nonfinite == "ignore" or not isinstance(value, torch.Tensor) or not value.is_floating_point():
                continue
            nan, inf, _ = nonfinite_counts(value)
            if nan or inf:
                raise NonFiniteError(
                    f"{what} batch {index}: input {name!r} holds {nan} NaN and {inf} infinite value(s); "
                    "the guard judges the algorithms on these batches: give finite data, or "
                    "nonfinite='ignore' to leave the outputs they reach out of its measure",
                    where=name,
                    nan=nan,
                    inf=inf,
                    reached=f"{what} batch {index}",
                )
        flat.append(tuple(v.detach().clone() if isinstance(v, torch.Tensor) else v for v in inputs))
    if not flat:
        raise AlgorithmError(f"{what} holds no batch; give at least one, or leave it out")
    return guard_batches(flat)


def run_transforms(
    gm: GraphModule,
    algorithms: Sequence[Any],
    calibration: Sequence[Any] | None,
    in_spec: Any = None,
    quantizer: Any = None,
    guard: bool = False,
    nonfinite: str = "error",
    held_out: Sequence[tuple[Any, ...]] | None = None,
) -> tuple[GraphModule, list[tuple[str, float, float]]]:
    """Every algorithm's ``transform_program``, in order, on the float working copy.

    ``calibration`` batches come as the user gives them to the prepared module (a tuple, a dict of
    keyword inputs, one tensor); the transforms see them as the program's flat inputs. With
    ``guard`` (and calibration batches), a transform whose quantized model, calibrated on the
    first batches, does worse on them (or on the flat ``held_out`` batches, when given) than
    without it is undone (:func:`_quantplug.algorithms.guard.quantized_error`); those come back as
    ``(algorithm, error with it, error without it)``.
    """
    misfit = ""  # the first calibration batch whose shape or dtype the program did not record
    if calibration is not None:
        from _quantplug.graph.calls import Call, check_flat_inputs

        flat = []
        for index, batch in enumerate(calibration):
            inputs = Call.of(batch).flat(in_spec, what=f"calibration batch {index}")
            if not misfit:  # not refused: a static batch size often runs at another size
                try:
                    check_flat_inputs(gm, inputs, what=f"calibration batch {index}")
                except QuantplugError as exc:
                    misfit = str(exc)
            flat.append(tuple(inputs))
        calibration = flat
    judged = guard_batches(calibration) if guard and calibration and quantizer is not None else []
    measured = list(held_out) if held_out is not None else judged
    reference: list[list[torch.Tensor]] = []
    if judged:
        with torch.no_grad(), _naming(misfit, "the algorithm guard"):
            reference = [output_tensors(Interpreter(gm).run(*batch)) for batch in measured]
    error: float | None = None  # the quantized error of the program as transformed so far
    left_out: list[tuple[str, float, float]] = []
    for algorithm in algorithms:
        hook = getattr(algorithm, "transform_program", None)
        if not callable(hook):
            continue
        name = algorithm_name(algorithm)
        before = _constants(gm) if judged else {}
        code = gm.code
        with _naming(misfit, f"algorithm {name!r}"):
            result = hook(gm, TransformContext(name, calibration, quantizer))
        if isinstance(result, GraphModule):
            gm = result
        gm.graph.lint()
        gm.recompile()
        now = _constants(gm) if judged else {}
        changed = {t: v for t, v in before.items() if now.get(t) is not v}  # target -> the old tensor
        if not changed or gm.code != code:
            continue  # nothing to judge, or a rewritten graph (kept as it is)
        if error is None:  # the program before this transform, quantized (later: the last kept one)
            for target, value in changed.items():
                put_attr(gm, target, value)
            with _naming(misfit, "the algorithm guard"):
                error = quantized_error(gm, quantizer, judged, reference, nonfinite, measured)
            for target in changed:
                put_attr(gm, target, now[target])
        with _naming(misfit, "the algorithm guard"):
            found = quantized_error(gm, quantizer, judged, reference, nonfinite, measured)
        if not lower(error, found):  # not worse beyond the tie margin: kept
            error = found
            continue
        for target, value in changed.items():  # undone: the program as it was before
            put_attr(gm, target, value)
        left_out.append((name, found, error))
        logger.info(
            "algorithm guard: %s undone: it lowered the quantized model's output SQNR on the "
            "%s batches by %.2f dB",
            name,
            "held-out" if held_out is not None else "calibration",
            -decibels(found, error),
        )
    return gm, left_out


@contextlib.contextmanager
def _naming(misfit: str, who: str) -> Iterator[None]:
    """Where running the program fails and a calibration batch does not fit it (``misfit``: what
    :func:`~_quantplug.graph.calls.check_flat_inputs` said), a QuantplugError naming that batch."""
    try:
        yield
    except QuantplugError:
        raise
    except Exception as exc:
        if not misfit:
            raise
        raise QuantplugError(
            f"{who} failed running the program on the calibration batches, and {misfit} "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _constants(gm: GraphModule) -> dict[str, Any]:
    """Every tensor the program reads through get_attr, by target (the objects, not copies)."""
    return {str(n.target): fetch_attr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"}


class Tap(nn.Module):
    """Feeds one layer's input to the collectors of that layer (returns nothing).

    ``site`` names the weight (:attr:`WeightSite.label`), ``owners[i]`` the algorithm of
    ``collectors[i]``; ``batches`` counts the batches fed (what a repeated distributed sync checks
    for new data). Samples holding NaN or inf follow ``nonfinite``
    (:mod:`_quantplug.algorithms.finite_inputs`); ``ignored`` counts those left out.
    """

    def __init__(self, site: str, collectors: list[Any], owners: list[str], nonfinite: str = "error") -> None:
        super().__init__()
        self.site = site
        self.collectors = collectors
        self.owners = owners
        self.nonfinite = nonfinite
        self.batches = 0
        self.ignored = 0

    def forward(self, x: torch.Tensor) -> None:
        self.batches += 1
        with torch.no_grad():
            value, dropped = finite_samples(x.detach(), self.nonfinite, self.site, self.owners)
            self.ignored += dropped
            if value is not None:
                self._feed(value)

    def _feed(self, value: torch.Tensor) -> None:
        for collector in self.collectors:
            collector.update(value)


class ExpertsTap(Tap):
    """The tap of a mixture-of-experts weight (:mod:`_quantplug.algorithms.experts`): called with
    the product's input rows and the expert ids, it feeds the collectors each expert's rows,
    packed (:func:`~_quantplug.algorithms.experts.packed_rows`). Rows holding NaN or inf follow
    ``nonfinite`` one by one, as a linear's samples do."""

    def __init__(
        self,
        site: str,
        collectors: list[Any],
        owners: list[str],
        layer: ExpertsLayer,
        nonfinite: str = "error",
    ) -> None:
        super().__init__(site, collectors, owners, nonfinite)
        self.layer = layer

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> None:  # type: ignore[override]
        self.batches += 1
        with torch.no_grad():
            rows, owner = routed_rows(x.detach(), ids.detach(), self.layer.in_out)
            finite = torch.isfinite(rows).all(dim=1)
            if not bool(finite.all()):
                # raises unless "ignore"
                _, dropped = finite_samples(rows, self.nonfinite, self.site, self.owners)
                self.ignored += dropped
                rows, owner = rows[finite], owner[finite]
            if rows.shape[0]:
                self._feed(packed_rows(rows, owner, self.layer.experts))


class RecurrentTap(nn.Module):
    """Feeds the :class:`Tap` of each weight of one recurrent op (called with the op's arguments):
    the rows each weight multiplies, computed by re-running the op layer by layer
    (:mod:`_quantplug.graph.recurrent`). The taps it feeds are the container's own children
    (what :func:`taps` finds, merges and counts), referenced here, not owned."""

    def __init__(self, layout: RecurrentLayout, fed: Sequence[tuple[RecurrentRole, Tap]]) -> None:
        super().__init__()
        self.layout = layout
        self.fed = list(fed)

    def forward(self, *args: Any) -> None:
        rows = self.layout.layer_inputs(args, {role for role, _ in self.fed})
        for role, tap in self.fed:
            if role in rows:
                tap(rows[role])


#: a recurrent op's layout and the taps of its weights, by role
RecurrentFeeds = tuple[RecurrentLayout, list[tuple[RecurrentRole, Tap]]]


@dataclass
class AlgorithmRun:
    """What convert needs from prepare: the algorithms and, per weight site, their collectors."""

    algorithms: list[Any]
    #: weight site key (weight target, gid) -> {algorithm index: collector}
    collectors: dict[tuple[str, int], dict[int, Any]] = field(default_factory=dict)
    #: the calibration batches kept for algorithms that want sequential layer inputs
    inputs: InputStore | None = None
    #: batches fed to the taps and the store when ``sync_observers`` last merged them (None: never)
    synced_at: int | None = None
    #: what NaN/inf in a layer's input does (``prepare(..., nonfinite=...)``)
    nonfinite: str = "error"
    #: whether convert keeps a site's choice only where the model does no worse
    #: (``prepare(..., algorithm_guard=...)``, :mod:`_quantplug.algorithms.guard`)
    guard: bool = True
    #: the guard's verdicts at the last convert (None: no guard ran)
    guarded: ModelGuard | None = None
    #: transforms the guard undid at prepare: ``(algorithm, error with it, error without it)``
    undone: list[tuple[str, float, float]] = field(default_factory=list)
    #: the held-out batches (flat) the guard judges on instead of the stored calibration batches
    #: (``prepare(..., held_out=...)``); None: the calibration batches
    held_out: list[tuple[Any, ...]] | None = None


def is_sequential(algorithm: Any) -> bool:
    """Whether ``algorithm`` wants its layers' inputs from the partly quantized model (see
    :mod:`_quantplug.algorithms.sequential`) rather than from float calibration."""
    return bool(getattr(algorithm, "sequential", False))


def _layer_call(gm: GraphModule, node: Node) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``f(x, w)`` re-running ``node`` with input ``x`` and weight ``w`` (other arguments constants)."""
    if str(node.target) not in LAYER_OPS or len(node.args) < 2:
        return None
    rest: list[Any] = []
    for arg in node.args[2:]:
        if isinstance(arg, Node):
            if arg.op != "get_attr":
                return None
            rest.append(fetch_attr(gm, str(arg.target)))
        else:
            rest.append(arg)
    if any(isinstance(v, Node) for v in node.kwargs.values()):
        return None
    target = node.target
    kwargs = dict(node.kwargs)

    def call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return target(x, w, *rest, **kwargs)  # type: ignore[operator]

    return call


def _weight_call(
    gm: GraphModule, node: Node, weight: Node
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``node`` as ``f(x, w)`` when it multiplies ``weight`` as a layer's weight (its second
    argument), else None (an embedding's lookup, an operand of a plain product...)."""
    weight_index = next((i for i, a in enumerate(node.args) if a is weight), None)
    return _layer_call(gm, node) if weight_index == 1 else None


def _same_layer(a: Node, b: Node) -> bool:
    """Whether ``a`` and ``b`` apply their (shared) weight as one layer: the same op with the same
    arguments after the input (the same bias node, stride, padding...)."""
    rest_a, rest_b = a.args[2:], b.args[2:]
    return (
        a.target == b.target
        and len(rest_a) == len(rest_b)
        and all(
            x is y if isinstance(x, Node) or isinstance(y, Node) else x == y for x, y in zip(rest_a, rest_b)
        )
        and a.kwargs == b.kwargs
    )


def _constant(gm: GraphModule, node: Any) -> tuple[str | None, torch.Tensor | None]:
    if isinstance(node, Node) and node.op == "get_attr":
        return str(node.target), fetch_attr(gm, str(node.target))
    return None, None


def _bias_of(gm: GraphModule, node: Node) -> tuple[str | None, torch.Tensor | None]:
    if str(node.target) not in LAYER_OPS or len(node.args) < 3:
        return None, None
    return _constant(gm, node.args[2])


@dataclass(frozen=True)
class _RecurrentWeight:
    """A recurrent op's ``w_ih``/``w_hh`` as a linear layer over rows the op computes inside."""

    layout: RecurrentLayout
    role: RecurrentRole
    bias_target: str | None
    bias: torch.Tensor | None

    def call(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def _recurrent_weight(gm: GraphModule, node: Node, weight: Node) -> _RecurrentWeight | None:
    """``weight`` as a linear layer of the recurrent op ``node`` (its ``w_ih``/``w_hh``), else None."""
    layout = recurrent_layout(node)
    if layout is None:
        return None
    params = list(node.args[2])  # type: ignore[arg-type]
    index = next((i for i, p in enumerate(params) if p is weight), None)
    role = None if index is None else layout.role(index)
    if role is None:
        return None
    bias_index = layout.bias_index(role)
    bias_target, bias = (None, None) if bias_index is None else _constant(gm, params[bias_index])
    return _RecurrentWeight(layout, role, bias_target, None if bias is None else bias.detach())


@dataclass(frozen=True)
class _SiteRef:
    site: WeightSite
    weight_node: str
    bias_target: str | None
    #: set for a recurrent op's weight: the tap computes its rows from the op's arguments
    recurrent: _RecurrentWeight | None = None
    #: set for a mixture-of-experts weight: the tap packs each expert's rows
    experts: ExpertsLayer | None = None


def weight_sites(gm: GraphModule, state: Any) -> list[_SiteRef]:
    """Every quantized constant weight (a plain-spec constant group, tensor of 2+ dims) and its op.

    Works on keys and specs only, so any backend's annotations (or a foreign quantizer's) yield
    the same sites. A weight consumed by several ops is one site: the first consumer (by node
    name) that multiplies it as a layer's weight, else its first consumer; the other consumers
    applying it as the same layer (an unrolled recurrence's steps) are its ``tied`` nodes, whose
    inputs the collectors see too. A language model's
    tied embedding and head is its head's layer, whose inputs the algorithms can measure: by
    name the lookup came first, and GPTQ, AdaRound and SeqMSE chose nothing for the weight that
    writes the logits (GPT-2 at reference weight_only_int4: +0.00 dB; +0.66 measured at the head).
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    folded: dict[str, str] = gm.meta.get(FOLDED_FROM, {})
    result: list[_SiteRef] = []
    for group in state.groups:
        if not group.constant or spec_kind(group.spec) is not SpecKind.PLAIN:
            continue
        edges = sorted(k for k in group.keys if isinstance(k, tuple))
        producers = sorted({k[0] for k in edges})
        for producer in producers:
            value = fetch_attr(gm, str(nodes[producer].target))
            if not isinstance(value, torch.Tensor) or value.dim() < 2 or not value.is_floating_point():
                continue
            consumers = [nodes[c] for p, c in edges if p == producer]
            calls = ((c, _weight_call(gm, c, nodes[producer])) for c in consumers)
            layers = [(c, f) for c, f in calls if f is not None]
            node, call = layers[0] if layers else (consumers[0], None)
            tied = tuple(c.name for c, _ in layers[1:] if _same_layer(c, node))
            bias_target, bias = _bias_of(gm, node) if call is not None else (None, None)
            recurrent, experts = None, None
            if call is None:
                cells = ((c, _recurrent_weight(gm, c, nodes[producer])) for c in consumers)
                node, recurrent = next(((c, r) for c, r in cells if r is not None), (node, None))
                if recurrent is not None:
                    call, bias_target, bias = recurrent.call, recurrent.bias_target, recurrent.bias
            if call is None:
                gathers = (experts_layer(c, nodes[producer]) for c in consumers)
                experts = next((e for e in gathers if e is not None), None)
                if experts is not None:  # its layer: the gather, then the product reading it
                    node, tied = nodes[experts.gather], (experts.product,)
                    call = experts_forward_in_out if experts.in_out else experts_forward
            target = str(nodes[producer].target)
            others = tuple(str(nodes[p].target) for p in producers if p != producer)
            site = WeightSite(
                name=target,
                node=node.name,
                op=str(node.target),
                weight=value.detach(),
                bias=None if bias is None else bias.detach(),
                group=group.gid,
                shared_with=others,
                input_index=0 if call is not None and recurrent is None and experts is None else None,
                folded_from=folded.get(target),
                tied=tied,
                in_out=experts is not None and experts.in_out,
                _call=call,
            )
            result.append(_SiteRef(site, producer, bias_target, recurrent, experts))
    return result


def install_collectors(
    gm: GraphModule,
    state: Any,
    algorithms: Sequence[Any],
    nonfinite: str = "error",
    guard: bool = True,
    held_out: Sequence[tuple[Any, ...]] | None = None,
) -> AlgorithmRun:
    """Ask each algorithm for a collector per weight site and tap the layers' inputs for them.

    The program's inputs are tapped too (an :class:`InputStore`) when convert will re-run stored
    batches: for sequential layer inputs, or for the guard (:mod:`_quantplug.algorithms.guard`)
    when some algorithm chooses weights and no ``held_out`` batches (flat) were given to judge on.
    """
    run = AlgorithmRun(
        list(algorithms),
        nonfinite=nonfinite,
        guard=guard,
        held_out=list(held_out) if guard and held_out is not None else None,
    )
    container = nn.Module()
    gm.add_module(TAPS, container)
    nodes = {n.name: n for n in gm.graph.nodes}
    planned: list[tuple[WeightSite, dict[int, Any]]] = []
    recurrent: dict[str, _RecurrentWeight] = {}  # weight target -> its role in a recurrent op
    experts: dict[str, ExpertsLayer] = {}  # weight target -> its mixture-of-experts layer
    for ref in weight_sites(gm, state):
        wanted: dict[int, Any] = {}
        for index, algorithm in enumerate(algorithms):
            hook = getattr(algorithm, "collector", None)
            collector = hook(ref.site) if callable(hook) else None
            if collector is not None:
                wanted[index] = collector
        planned.append((ref.site, wanted))
        if ref.recurrent is not None:
            recurrent[ref.site.name] = ref.recurrent
        if ref.experts is not None:
            experts[ref.site.name] = ref.experts
    sequential_layers = any(
        site.has_layer and any(is_sequential(algorithms[i]) for i in wanted) for site, wanted in planned
    )
    judged_on_store = (
        guard
        and run.held_out is None
        and bool(planned)
        and any(callable(getattr(a, "choose_weight", None)) for a in algorithms)
    )
    _share_hessians(planned, algorithms, nodes)
    count = 0
    if sequential_layers or judged_on_store:  # batches kept for convert to re-run
        run.inputs = InputStore() if sequential_layers else InputStore(GUARD_BATCHES, GUARD_BYTES)
        container.add_module("inputs", run.inputs)
        user_inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        with gm.graph.inserting_after(user_inputs[-1] if user_inputs else None):
            store = gm.graph.call_module(f"{TAPS}.inputs", tuple(user_inputs))
        store.meta[ALGORITHM_TAP_KEY] = "inputs"
        count += 1
    cells: dict[str, RecurrentFeeds] = {}  # recurrent op node -> its weights' taps
    for site, wanted in planned:
        if not wanted:
            continue
        run.collectors[(site.name, site.group)] = wanted
        fed = [i for i in wanted if _fed_in_calibration(algorithms[i])]
        if not site.has_layer or not fed:
            continue  # no layer input to see (the collectors give their empty result), or fed at convert
        name = f"t{count}"
        count += 1
        owners = [algorithm_name(algorithms[i]) for i in fed]
        moe = experts.get(site.name)
        if moe is not None:  # one tap before the product, given its rows and the expert ids
            container.add_module(
                name, ExpertsTap(site.label, [wanted[i] for i in fed], owners, moe, nonfinite)
            )
            product = nodes[moe.product]
            with gm.graph.inserting_before(product):
                tap = gm.graph.call_module(f"{TAPS}.{name}", (product.args[moe.input_index], nodes[moe.ids]))
            tap.meta[ALGORITHM_TAP_KEY] = site.name
            continue
        container.add_module(name, Tap(site.label, [wanted[i] for i in fed], owners, nonfinite))
        cell = recurrent.get(site.name)
        if cell is not None:  # fed by the op's RecurrentTap, inserted below
            cells.setdefault(site.node, (cell.layout, []))[1].append((cell.role, getattr(container, name)))
            continue
        for layer in site.layer_nodes:  # one tap, called before each node applying the layer
            consumer = nodes[layer]
            with gm.graph.inserting_before(consumer):
                tap = gm.graph.call_module(f"{TAPS}.{name}", (consumer.args[site.input_index or 0],))
            tap.meta[ALGORITHM_TAP_KEY] = site.name
    for node_name, (layout, fed_taps) in cells.items():
        consumer = nodes[node_name]
        name = f"r{count}"
        count += 1
        container.add_module(name, RecurrentTap(layout, fed_taps))
        with gm.graph.inserting_before(consumer):
            tap = gm.graph.call_module(f"{TAPS}.{name}", consumer.args)
        tap.meta[ALGORITHM_TAP_KEY] = node_name
    if not count:
        delattr(gm, TAPS)
    return run


def _fed_in_calibration(algorithm: Any) -> bool:
    """Whether ``algorithm``'s collectors are fed by calibration (else by convert's sequential pass)."""
    return not is_sequential(algorithm) or bool(getattr(algorithm, "float_inputs", False))


def _share_hessians(
    planned: Sequence[tuple[WeightSite, dict[int, Any]]], algorithms: Sequence[Any], nodes: dict[str, Node]
) -> None:
    """One set of Hessian sums per distinct layer input fed during calibration
    (:func:`~_quantplug.algorithms.weight_layers.share_hessians`): algorithms on the same layer,
    and linears reading the same input, share it. Then a warning, before calibration allocates
    them, when those sums may not fit in the machine's memory."""
    fed = [
        (algorithm_name(algorithms[i]), collector)
        for site, wanted in planned
        if site.has_layer
        for i, collector in wanted.items()
        if isinstance(collector, LayerHessian) and _fed_in_calibration(algorithms[i])
    ]
    share_hessians([(_rows_key(c.site, nodes, c), c) for _, c in fed])
    held = [HeldHessian(name, c.site.label, c.columns, c.stack) for name, c in fed if c.leads]
    problem = hessian_memory_problem(held, weight_layers.physical_memory())
    if problem is not None:
        logger.warning("%s", problem)


def _rows_key(site: WeightSite, nodes: dict[str, Node], collector: LayerHessian) -> Hashable:
    """Which rows ``collector`` sums: a linear's input node and width, a convolution's own layer
    (its patches depend on its stride and padding) and whether it sums a grouped one's stack.
    Equal keys, equal sums."""
    if collector.kind == "linear" and site.input_index is not None:
        rows = tuple(str(nodes[layer].args[site.input_index]) for layer in site.layer_nodes)
        return ("linear", rows, collector.columns)
    return ("site", site.name, site.group, collector.grouped)


def is_tap(node: Node) -> bool:
    return node.op == "call_module" and str(node.target).startswith(TAPS + ".")


def taps(prepared: nn.Module) -> tuple[list[Tap], InputStore | None]:
    """The collector taps of a prepared module, in creation order (the same on every rank that
    prepared the same program), and its store of batches for sequential inputs."""
    container = getattr(prepared, TAPS, None)
    if not isinstance(container, nn.Module):
        return [], None
    found = sorted(
        ((int(name[1:]), m) for name, m in container.named_children() if isinstance(m, Tap)),
        key=lambda pair: pair[0],
    )
    store = getattr(container, "inputs", None)
    return [m for _, m in found], store if isinstance(store, InputStore) else None


@dataclass
class WeightOverrides:
    """What convert uses instead of its defaults: chosen codes per (weight target, gid), and
    corrected biases by target."""

    codes: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    biases: dict[str, torch.Tensor] = field(default_factory=dict)


def _grid(group: Any, raw: tuple[Any, Any], observe: Callable[[torch.Tensor], Any]) -> WeightGrid:
    spec = group.spec
    qmin, qmax = spec_range(spec)
    scale = torch.as_tensor(raw[0]).detach().to(torch.float32)
    zero_point = torch.as_tensor(raw[1]).detach()
    qscheme = getattr(spec, "qscheme", None)
    block = getattr(spec, "block_size", None)
    if block is not None:
        granularity, axis = "block", None
    elif is_per_channel(spec) and (scale.numel() > 1 or getattr(spec, "ch_axis", None) is not None):
        granularity, axis = "channel", getattr(spec, "ch_axis", 0)
    else:
        granularity, axis = "tensor", None
        scale, zero_point = scale.reshape(-1)[:1], zero_point.reshape(-1)[:1]
    symmetric = qscheme in (torch.per_tensor_symmetric, torch.per_channel_symmetric) or (
        block is not None and not bool(zero_point.any())
    )
    return WeightGrid(
        quant_min=qmin,
        quant_max=qmax,
        dtype=spec.dtype,
        qscheme=qscheme,
        granularity=granularity,
        scale=scale,
        zero_point=zero_point,
        symmetric=symmetric,
        ch_axis=axis,
        block_size=tuple(block) if block is not None else None,
        _observe=observe,
    )


def choose_weights(
    prepared: GraphModule,
    state: Any,
    observers: dict[int, nn.Module],
    qparams_of: Callable[[int], tuple[Any, Any]],
    set_qparams: Callable[[int, tuple[Any, Any]], None],
) -> WeightOverrides:
    """Run every algorithm's ``choose_weight`` on every weight site (convert's hook).

    ``qparams_of(gid)`` gives a group's calibrated ``(scale, zero_point)``; ``set_qparams``
    replaces it (before derived biases read it). ``observers[gid]`` is the group's weight observer,
    copied fresh for :meth:`WeightGrid.observe`. With sequential algorithms the sites are chosen
    stage by stage, each stage's layer inputs taken from the model quantized so far
    (:mod:`_quantplug.algorithms.sequential`).
    """
    run: AlgorithmRun | None = prepared.meta.get(RUN_KEY)
    overrides = WeightOverrides()
    if run is None or not any(callable(getattr(a, "choose_weight", None)) for a in run.algorithms):
        return overrides
    warn_underdetermined(run)
    sequential = {i for i, a in enumerate(run.algorithms) if is_sequential(a)}
    both = {i for i in sequential if getattr(run.algorithms[i], "float_inputs", False)}
    groups = {g.gid: g for g in state.groups}
    refs = weight_sites(prepared, state)
    grids = [
        _grid(groups[ref.site.group], qparams_of(ref.site.group), _observer(observers, ref)) for ref in refs
    ]
    batches = run.inputs.batches if run.inputs is not None else []
    wants = [
        [i for i in run.collectors.get((ref.site.name, ref.site.group), {}) if i in sequential]
        if ref.site.has_layer
        else []
        for ref in refs
    ]
    if run.held_out is not None:  # prepare(..., held_out=...): batches the algorithms never saw
        judged = run.held_out
    else:
        judged = guard_batches(batches) if run.guard else []
    simulate = (bool(batches) and any(wants)) or bool(judged)
    order = (
        stages(list(prepared.graph.nodes), [ref.site.layer_nodes for ref in refs])
        if simulate
        else [list(range(len(refs)))]
    )
    current: dict[str, torch.Tensor] = {}  # what the simulation reads for each weight (and bias)
    if simulate:
        for ref, grid in zip(refs, grids):
            current[ref.site.name] = grid.dequantize(grid.quantize(ref.site.weight)).to(ref.site.weight.dtype)
    activation = _activation_encodings(state, qparams_of) if simulate else {}
    guard = _model_guard(prepared, activation, judged, run.held_out is not None) if judged else None
    base = dict(current)  # every weight rounded to nearest: the default
    chosen: list[tuple[int, WeightGrid, torch.Tensor, torch.Tensor | None]] = []  # (site index, ...)
    ignored = {tap.site: tap.ignored for tap in taps(prepared)[0] if tap.ignored}
    nodes = {n.name: n for n in prepared.graph.nodes}
    for stage in order:
        feeds: dict[str, list[Callable[[Sequence[Any]], None]]] = {}
        sequential_taps: list[Tap] = []
        cells: dict[str, RecurrentFeeds] = {}
        made_at: dict[int, dict[int, Any]] = {}  # site index -> {algorithm index: collector}
        for k in stage:
            asked = {i: run.algorithms[i].collector(refs[k].site) for i in wants[k]}
            made_at[k] = {i: c for i, c in asked.items() if c is not None}
        share_hessians(  # the stage's collectors of the same rows: one set of sums
            [
                (_rows_key(c.site, nodes, c), c)
                for made in made_at.values()
                for c in made.values()
                if isinstance(c, LayerHessian)
            ]
        )
        for k, made in made_at.items():
            if made:
                owners = [algorithm_name(run.algorithms[i]) for i in made]
                moe = refs[k].experts
                if moe is not None:
                    site = refs[k].site
                    routed = ExpertsTap(site.label, list(made.values()), owners, moe, run.nonfinite)
                    sequential_taps.append(routed)
                    for node_name, feed in zip((moe.gather, moe.product), _routed(routed, moe), strict=True):
                        feeds.setdefault(node_name, []).append(feed)
                    continue
                tap = Tap(refs[k].site.label, list(made.values()), owners, run.nonfinite)
                sequential_taps.append(tap)
                cell = refs[k].recurrent
                if cell is not None:
                    cells.setdefault(refs[k].site.node, (cell.layout, []))[1].append((cell.role, tap))
                else:
                    for layer in refs[k].site.layer_nodes:
                        feeds.setdefault(layer, []).append(_first_argument(tap))
        for node_name, (layout, fed_taps) in cells.items():
            feeds.setdefault(node_name, []).append(_all_arguments(RecurrentTap(layout, fed_taps)))
        if feeds:
            from _quantplug.meta import OBSERVERS

            simulation = QuantizedSimulation(prepared, OBSERVERS, activation, current, feeds, is_tap)
            for batch in batches:
                simulation.run_batch(batch)
        for tap in sequential_taps:  # the same samples as the float taps': counted once
            if tap.ignored:
                ignored[tap.site] = max(ignored.get(tap.site, 0), tap.ignored)
        for k in stage:
            ref = refs[k]
            site = ref.site
            # each site's results made as it is chosen, not all first: a Hessian's result is a
            # copy as large as its sums, and the largest layers' copies would otherwise coexist
            collected = {
                i: c.result()
                for i, c in run.collectors.get((site.name, site.group), {}).items()
                if i not in sequential or i in both
            }
            quantized = {i: c.result() for i, c in made_at[k].items()}
            for i in sequential:
                if i in both:  # no sequential result (no stored batches, no layer): quantized None
                    collected[i] = LayerInputs(collected.get(i), quantized.get(i))
                elif i in quantized:
                    collected[i] = quantized[i]
            found = _choose_site(run.algorithms, site, grids[k], collected)
            if found is None:
                continue
            grid, codes, bias_delta = found
            corrected: torch.Tensor | None = None
            if bias_delta is not None:
                if ref.bias_target is None or site.bias is None:
                    raise AlgorithmError(
                        f"a bias correction for {site.name} needs a constant bias on {site.node} "
                        f"({site.op}); export the model with bias=True or leave out the correcting algorithm"
                    )
                corrected = site.bias + bias_delta.reshape(site.bias.shape).to(site.bias.dtype)
            chosen.append((k, grid, codes, corrected))
            if simulate:  # what the next stages' sequential inputs see
                current[site.name] = grid.dequantize(codes).to(site.weight.dtype)
                if corrected is not None and ref.bias_target is not None:
                    current[ref.bias_target] = corrected
    warn_ignored(ignored)
    keep = [True] * len(chosen)
    if guard is not None:
        keep = _guarded(guard, refs, chosen, base, current)
    for (k, grid, codes, corrected), kept in zip(chosen, keep):
        if not kept:
            continue  # the default (round-to-nearest) does better in this model
        site, bias_target = refs[k].site, refs[k].bias_target
        if grid is not grids[k]:
            set_qparams(site.group, (grid.scale, grid.zero_point))
        overrides.codes[(site.name, site.group)] = codes
        if corrected is not None and bias_target is not None:
            overrides.biases[bias_target] = corrected
    run.guarded = guard
    return overrides


def _first_argument(tap: Tap) -> Callable[[Sequence[Any]], None]:
    """A sequential feed of ``tap`` with a layer's input (its node's first argument)."""

    def feed(args: Sequence[Any]) -> None:
        if isinstance(args[0], torch.Tensor):
            tap(args[0].detach())

    return feed


def _routed(
    tap: ExpertsTap, layer: ExpertsLayer
) -> tuple[Callable[[Sequence[Any]], None], Callable[[Sequence[Any]], None]]:
    """The sequential feeds of a mixture-of-experts tap: the gather's (which keeps its expert ids)
    and the product's (which feeds its rows with them)."""
    routed: list[torch.Tensor] = []

    def gather(args: Sequence[Any]) -> None:
        routed[:] = [args[1][0]]

    def product(args: Sequence[Any]) -> None:
        x = args[layer.input_index]
        if routed and isinstance(x, torch.Tensor):
            tap(x.detach(), routed.pop())

    return gather, product


def _all_arguments(tap: RecurrentTap) -> Callable[[Sequence[Any]], None]:
    """A sequential feed of a recurrent op's taps with the op's arguments."""

    def feed(args: Sequence[Any]) -> None:
        tap(*args)

    return feed


def _guarded(
    guard: ModelGuard,
    refs: Sequence[_SiteRef],
    chosen: Sequence[tuple[int, WeightGrid, torch.Tensor, torch.Tensor | None]],
    base: dict[str, torch.Tensor],
    current: dict[str, torch.Tensor],
) -> list[bool]:
    """The guard's selection among ``chosen`` (a choice that changes nothing is kept unjudged)."""
    candidates: list[Candidate] = []
    judged: list[int] = []
    for index, (k, _, _, corrected) in enumerate(chosen):
        ref = refs[k]
        now = {ref.site.name: current[ref.site.name]}
        before = {ref.site.name: base[ref.site.name]}
        if corrected is not None and ref.bias_target is not None and ref.site.bias is not None:
            now[ref.bias_target], before[ref.bias_target] = corrected, ref.site.bias
        if all(torch.equal(now[t], before[t]) for t in now):
            continue
        candidates.append(Candidate(ref.site.label, now, before))
        judged.append(index)
    keep = [True] * len(chosen)
    for index, kept in zip(judged, guard.select(base, candidates)):
        keep[index] = kept
    guard.report()
    return keep


def _model_guard(
    prepared: GraphModule,
    activation: dict[int, tuple[Any, tuple[Any, Any] | None]],
    batches: Sequence[tuple[Any, ...]],
    held_out: bool,
) -> ModelGuard:
    """The guard over ``batches``, the float model's outputs its reference."""
    from _quantplug.meta import OBSERVERS

    def outputs(
        encodings: dict[int, tuple[Any, tuple[Any, Any] | None]], replaced: dict[str, torch.Tensor]
    ) -> list[list[torch.Tensor]]:
        simulation = QuantizedSimulation(prepared, OBSERVERS, encodings, replaced, {}, is_tap)
        return [output_tensors(simulation.outputs(batch)) for batch in batches]

    return ModelGuard(
        lambda replaced: outputs(activation, dict(replaced)),
        outputs({}, {}),
        judged_on="held-out" if held_out else "calibration",
    )


def warn_ignored(ignored: dict[str, int]) -> None:
    """One warning naming the layers whose collectors were fed fewer samples than calibration ran
    (``nonfinite="ignore"`` left out those holding NaN or inf): the user learns the algorithms
    saw less data than given."""
    if not ignored:
        return
    shown = ", ".join(f"{site} ({n})" for site, n in list(ignored.items())[:5])
    more = f" and {len(ignored) - 5} more" if len(ignored) > 5 else ""
    logger.warning(
        "algorithms: samples holding NaN or inf were left out of the statistics of %d layer(s) "
        "(nonfinite='ignore'), samples left out per weight: %s%s",
        len(ignored),
        shown,
        more,
    )


def _observer(observers: dict[int, nn.Module], ref: _SiteRef) -> Callable[[torch.Tensor], Any]:
    """:meth:`WeightGrid.observe` for a site: a fresh copy of its group's weight observer."""
    from _quantplug.observers.copies import fresh_copy

    prototype = observers[ref.site.group]

    def observe(tensor: torch.Tensor) -> tuple[Any, Any]:
        obs: Any = fresh_copy(prototype)
        with torch.no_grad():
            obs(tensor.detach())
        scale, zp = obs.calculate_qparams()
        return torch.as_tensor(scale).detach().to(torch.float32), torch.as_tensor(zp).detach()

    return observe


def _activation_encodings(
    state: Any, qparams_of: Callable[[int], tuple[Any, Any]]
) -> dict[int, tuple[Any, tuple[Any, Any] | None]]:
    """Every observed (non-constant) group's spec and calibrated encoding (None: not simulated)."""
    found: dict[int, tuple[Any, tuple[Any, Any] | None]] = {}
    for group in state.groups:
        if group.constant:
            continue
        qparams = None
        if not group.dynamic:
            try:
                qparams = qparams_of(group.gid)
            except KeyError:  # a derived encoding, computed after the weights: left unsimulated
                qparams = None
        found[group.gid] = (group.spec, qparams)
    return found


def _choose_site(
    algorithms: Sequence[Any], site: WeightSite, default: WeightGrid, collected: dict[int, Any]
) -> tuple[WeightGrid, torch.Tensor, torch.Tensor | None] | None:
    """Every algorithm's choice for one site, in order (None: none chose anything)."""
    grid = default
    codes = grid.quantize(site.weight)
    chose = False
    bias_delta: torch.Tensor | None = None
    for index, algorithm in enumerate(algorithms):
        hook = getattr(algorithm, "choose_weight", None)
        if not callable(hook):
            continue
        choice = hook(site, grid, codes, collected.get(index))
        if choice is None:
            continue
        if not isinstance(choice, WeightChoice):
            raise AlgorithmError(
                f"algorithm {algorithm_name(algorithm)!r} returned {type(choice).__name__} for weight "
                f"{site.name}; choose_weight returns a WeightChoice or None"
            )
        grid, codes, delta = _apply(algorithm_name(algorithm), site, grid, codes, choice)
        chose = True
        if delta is not None:
            bias_delta = delta if bias_delta is None else bias_delta + delta
    return (grid, codes, bias_delta) if chose else None


def _apply(
    name: str, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, choice: WeightChoice
) -> tuple[WeightGrid, torch.Tensor, torch.Tensor | None]:
    """``choice`` checked against the backend's grid and applied (new grid, codes, bias delta)."""

    def refuse(rule: str) -> AlgorithmError:
        return AlgorithmError(f"algorithm {name!r} chose for weight {site.name} ({site.node}) {rule}")

    if choice.scale is not None or choice.zero_point is not None:
        if site.shared_with:
            raise refuse(
                f"a new encoding, but it shares one with {', '.join(site.shared_with)}: a shared encoding "
                "stays shared; choose codes only"
            )
        scale = (
            grid.scale if choice.scale is None else torch.as_tensor(choice.scale).detach().to(torch.float32)
        )
        zp = grid.zero_point if choice.zero_point is None else torch.as_tensor(choice.zero_point).detach()
        if scale.shape != grid.scale.shape:
            raise refuse(
                f"scales of shape {tuple(scale.shape)} on a {grid.granularity} grid of shape "
                f"{tuple(grid.scale.shape)}: keep the backend's granularity"
            )
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            raise refuse("scales that are not positive and finite")
        if zp.shape != grid.zero_point.shape:
            raise refuse(
                f"zero points of shape {tuple(zp.shape)}; the grid has {tuple(grid.zero_point.shape)}"
            )
        if grid.symmetric and not torch.equal(zp.to(grid.zero_point.dtype), grid.zero_point):
            raise refuse("other zero points on a symmetric grid: a symmetric weight stays symmetric")
        if not _representable(grid, site.weight.shape, scale):
            raise refuse(
                "scales the backend's observer cannot produce (e.g. off LPBQ's scale lattice); derive "
                "them with grid.observe(clipped_weight)"
            )
        grid = grid.with_encoding(scale, zp.to(grid.zero_point.dtype))
        if choice.codes is None:
            codes = grid.quantize(site.weight)
    if choice.codes is not None:
        new = torch.as_tensor(choice.codes).detach()
        if tuple(new.shape) != tuple(site.weight.shape):
            raise refuse(
                f"codes of shape {tuple(new.shape)} for a weight of shape {tuple(site.weight.shape)}"
            )
        if new.is_floating_point() and not bool((new == new.round()).all()):
            raise refuse("codes that are not integers")
        if bool((new < grid.quant_min).any()) or bool((new > grid.quant_max).any()):
            raise refuse(f"codes outside the grid's range [{grid.quant_min}, {grid.quant_max}]")
        codes = new.to(torch.int64)
    delta = None
    if choice.bias_delta is not None:
        delta = torch.as_tensor(choice.bias_delta).detach().to(torch.float32)
        if not bool(torch.isfinite(delta).all()):
            raise refuse("a bias correction that is not finite")
    return grid, codes, delta


def _representable(grid: WeightGrid, shape: Sequence[int], scale: torch.Tensor) -> bool:
    """Whether the backend's observer yields ``scale`` for a weight that spans exactly that grid.

    A symmetric weight whose every channel/block reaches ``s * (qmax - qmin) / 2`` gives back
    ``s`` from a min/max observer; a backend whose observer adds rules (LPBQ's 4-bit scale steps,
    an eps floor) moves scales that break them. Observers for which even the default encoding is
    not such a fixed point (histogram, MSE search) are not judged, nor are asymmetric grids.
    """
    if grid._observe is None or not grid.symmetric:
        return True
    half = (grid.quant_max - grid.quant_min) / 2.0

    def fixed_point(s: torch.Tensor) -> bool:
        got, _ = grid.observe(grid.expand(s, shape).to(torch.float32) * half)
        return bool(torch.allclose(got.reshape(s.shape).to(torch.float32), s, rtol=1e-4, atol=0.0))

    return not fixed_point(grid.scale) or fixed_point(scale)


def underdetermined_layers(run: AlgorithmRun) -> dict[str, list[tuple[str, int, int, bool]]]:
    """Per algorithm, the layers whose ``H`` summed fewer input rows than the layer has inputs:
    ``(weight label, rows, inputs, whether the algorithm's H is shrunk there)``, in site order."""
    found: dict[str, list[tuple[str, int, int, bool]]] = {}
    for by_algorithm in run.collectors.values():
        for i, collector in by_algorithm.items():
            if isinstance(collector, LayerHessian) and 0 < collector.rows < collector.columns:
                found.setdefault(algorithm_name(run.algorithms[i]), []).append(
                    (collector.site.label, collector.rows, collector.columns, collector.shrinks)
                )
    return found


def warn_underdetermined(run: AlgorithmRun) -> None:
    """One warning per Hessian-based algorithm with layers calibrated on fewer rows than inputs.

    Their ``H`` is singular: a choice fits the calibration rows in the directions they span and
    knows nothing of the others, so it can win on the calibration data and lose on new data
    (ConvNeXt's classifier calibrated on 16 images, 64 inputs: GPTQ -4.4 dB held out without its
    shrinkage, -0.2 with it). The user learns it at convert, not from the deployed model.
    """
    advice = (
        ""
        if run.held_out is not None or not run.guard
        else ", or give the algorithm guard batches not calibrated on (prepare(..., held_out=...), "
        "quantize --held-out PATH) to judge the choices on"
    )
    for name, layers in underdetermined_layers(run).items():
        shown = ", ".join(f"{w} ({rows} rows, {inputs} inputs)" for w, rows, inputs, _ in layers[:5])
        more = f" and {len(layers) - 5} more" if len(layers) > 5 else ""
        shrunk = (
            " (their H is shrunk toward its diagonal, which limits this without removing it)"
            if all(shrinks for *_, shrinks in layers)
            else ""
        )
        logger.warning(
            "%s: %d layer(s) saw fewer calibration rows than they have inputs: %s%s. Its choices "
            "there fit the calibration data and may lose accuracy on other data%s; calibrate on "
            "more batches (a linear's rows are its input's samples or tokens, a convolution's its "
            "output positions)%s.",
            name,
            len(layers),
            shown,
            more,
            shrunk,
            advice,
        )
