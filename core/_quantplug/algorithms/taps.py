"""prepare, after the observers: taps feeding the algorithms' collectors, and the run convert reads.

:func:`install_collectors` asks each algorithm for a collector per weight site
(:mod:`_quantplug.algorithms.sites`) and inserts one tap node per site whose layer input some
algorithm collects during calibration; the tap feeds the collectors and returns nothing (convert
drops it). The program's inputs are kept too (an :class:`InputStore`) when convert will re-run
them. The state between prepare and convert (algorithms, collectors, stored batches, the guard's
settings) is an :class:`AlgorithmRun` in ``prepared.meta[ALGORITHMS_KEY]``.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from _quantplug.algorithms import weight_layers
from _quantplug.algorithms.experts import ExpertsLayer, packed_rows, routed_rows
from _quantplug.algorithms.finite_inputs import finite_samples
from _quantplug.algorithms.guard import GUARD_BATCHES, GUARD_BYTES, GuardLoss, ModelGuard
from _quantplug.algorithms.sequential import HELD_OUT_EVERY, HeldOutSplit, InputStore
from _quantplug.algorithms.sites import RecurrentWeight, weight_sites
from _quantplug.algorithms.spec import WeightSite, algorithm_name, is_sequential
from _quantplug.algorithms.weight_layers import (
    HeldHessian,
    LayerHessian,
    hessian_memory_problem,
    share_hessians,
)
from _quantplug.graph.recurrent import RecurrentLayout, RecurrentRole
from _quantplug.meta import ALGORITHM_TAP_KEY, TAPS

logger = logging.getLogger("quantplug.algorithms")


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
        #: the calibration split (:class:`HeldOutSplit`): batches held out feed no collector
        self.split: HeldOutSplit | None = None

    def held(self) -> bool:
        return self.split is not None and self.split.holding

    def forward(self, x: torch.Tensor) -> None:
        if self.held():
            return
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
        if self.held():
            return
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
    #: (``Algorithms([...], guard=...)``, :mod:`_quantplug.algorithms.guard`)
    guard: bool = True
    #: the guard's verdicts at the last convert (None: no guard ran)
    guarded: ModelGuard | None = None
    #: transforms the guard undid at prepare: ``(algorithm, error with it, error without it)``
    undone: list[tuple[str, float, float]] = field(default_factory=list)
    #: the held-out batches (flat) the guard judges on instead of the stored calibration batches:
    #: ``Algorithms([...], held_out=...)``'s, or by default those split off the calibration
    #: (:class:`HeldOutSplit`); None or empty: the calibration batches
    held_out: list[tuple[Any, ...]] | None = None
    #: the default split of the calibration (None: none); its ``batches`` are ``held_out``
    split: HeldOutSplit | None = None
    #: the task loss the guard minimises (``Algorithms([...], guard_loss=...)``; None: the output
    #: error against float)
    guard_loss: GuardLoss | None = None

    def release_statistics(self, prepared: nn.Module) -> None:
        """Give up what calibration gathered for convert, once a ``release_float_weights`` convert
        consumed ``prepared`` (nothing reads it again): the taps and their collectors, every
        Hessian's sums (an algorithm may hold its collectors too: GPTQ does), the stored batches
        and the held-out split. At 110M parameters the sums alone outweigh the float weights.
        The guard's verdicts and the transforms undone stay, for the report."""
        for by_algorithm in self.collectors.values():
            for collector in by_algorithm.values():
                if isinstance(collector, weight_layers.LayerHessian):
                    collector.discard()
        self.collectors, self.inputs, self.held_out, self.split = {}, None, None, None
        if isinstance(getattr(prepared, TAPS, None), nn.Module):
            delattr(prepared, TAPS)


def install_collectors(
    gm: GraphModule,
    state: Any,
    algorithms: Sequence[Any],
    nonfinite: str = "error",
    guard: bool = True,
    held_out: Sequence[tuple[Any, ...]] | None = None,
    split: bool = True,
    guard_loss: GuardLoss | None = None,
) -> AlgorithmRun:
    """Ask each algorithm for a collector per weight site and tap the layers' inputs for them.

    The program's inputs are tapped too (an :class:`InputStore`) when convert will re-run stored
    batches: for sequential layer inputs, or for the guard (:mod:`_quantplug.algorithms.guard`)
    when some algorithm chooses weights and no ``held_out`` batches (flat) were given to judge on.
    Then, with ``split``, every :data:`HELD_OUT_EVERY`-th calibration batch is held out from the
    algorithms (:class:`HeldOutSplit`) for the guard to judge on.
    """
    run = AlgorithmRun(
        list(algorithms),
        nonfinite=nonfinite,
        guard=guard,
        held_out=list(held_out) if guard and held_out is not None else None,
        guard_loss=guard_loss if guard else None,
    )
    container = nn.Module()
    gm.add_module(TAPS, container)
    nodes = {n.name: n for n in gm.graph.nodes}
    planned: list[tuple[WeightSite, dict[int, Any]]] = []
    recurrent: dict[str, RecurrentWeight] = {}  # weight target -> its role in a recurrent op
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
    held = HeldOutSplit(HELD_OUT_EVERY, GUARD_BATCHES, GUARD_BYTES) if judged_on_store and split else None
    if held is not None:
        run.split = held
        run.held_out = held.batches  # filled during calibration; the same list
    if sequential_layers or judged_on_store:  # batches kept for convert to re-run
        run.inputs = (
            InputStore(split=held)
            if sequential_layers
            else InputStore(GUARD_BATCHES, GUARD_BYTES, split=held)
        )
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
            getattr(container, name).split = held
            product = nodes[moe.product]
            with gm.graph.inserting_before(product):
                tap = gm.graph.call_module(f"{TAPS}.{name}", (product.args[moe.input_index], nodes[moe.ids]))
            tap.meta[ALGORITHM_TAP_KEY] = site.name
            continue
        container.add_module(name, Tap(site.label, [wanted[i] for i in fed], owners, nonfinite))
        getattr(container, name).split = held
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
    share_hessians([(rows_key(c.site, nodes, c), c) for _, c in fed])
    held = [HeldHessian(name, c.site.label, c.columns, c.stack) for name, c in fed if c.leads]
    problem = hessian_memory_problem(held, weight_layers.physical_memory())
    if problem is not None:
        logger.warning("%s", problem)


def rows_key(site: WeightSite, nodes: dict[str, Node], collector: LayerHessian) -> Hashable:
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
