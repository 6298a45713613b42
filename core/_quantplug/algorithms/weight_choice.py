"""convert: each weight site's grid, the algorithms' ``choose_weight`` in order, checked, guarded.

:func:`choose_weights` builds each site's :class:`WeightGrid` from its spec and calibrated
observer, asks every algorithm in order for a :class:`WeightChoice` (sequential algorithms stage
by stage, their layer inputs taken from the model quantized so far:
:mod:`_quantplug.algorithms.sequential`), refuses a choice that leaves the backend's grid, and
lets the guard (:mod:`_quantplug.algorithms.guard`) keep only the choices under which the model
does no worse. Convert stores what comes back (:class:`WeightOverrides`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from _quantplug.algorithms.experts import ExpertsLayer
from _quantplug.algorithms.guard import Candidate, GuardLoss, ModelGuard, guard_batches, output_tensors
from _quantplug.algorithms.progress import LayerProgress
from _quantplug.algorithms.sequential import IncrementalOutputs, QuantizedSimulation, stages
from _quantplug.algorithms.sites import SiteRef, weight_sites
from _quantplug.algorithms.spec import (
    LayerInputs,
    WeightChoice,
    WeightGrid,
    WeightSite,
    algorithm_name,
    is_sequential,
)
from _quantplug.algorithms.taps import (
    AlgorithmRun,
    ExpertsTap,
    RecurrentFeeds,
    RecurrentTap,
    Tap,
    is_tap,
    rows_key,
    taps,
)
from _quantplug.algorithms.weight_layers import LayerHessian, share_hessians
from _quantplug.annotation.spec_view import is_per_channel, spec_range
from _quantplug.errors import AlgorithmError
from _quantplug.meta import ALGORITHMS_KEY
from _quantplug.observers.copies import fresh_copy
from _quantplug.observers.minmax import PerChannelMinMaxObserver
from _quantplug.observers.nonfinite import all_ordinary

logger = logging.getLogger("quantplug.algorithms")


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
    run: AlgorithmRun | None = prepared.meta.get(ALGORITHMS_KEY)
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
    if run.held_out:  # Algorithms(..., held_out=...) or split off the calibration: never fitted on
        judged = run.held_out
    else:  # too few calibration batches to hold any out: the guard judges on those the algorithms saw
        judged = guard_batches(batches) if run.guard else []
    simulate = (bool(batches) and any(wants)) or bool(judged)
    order = (
        stages(list(prepared.graph.nodes), [ref.site.layer_nodes for ref in refs])
        if simulate
        else [list(range(len(refs)))]
    )
    # what the simulation reads for each weight (and bias) an algorithm changed; every other
    # weight site is read rounded to nearest, from the program's tensor, at each read
    current: dict[str, torch.Tensor] = {}
    rounded = _rounded_to_nearest(refs, grids)
    activation = _activation_encodings(state, qparams_of) if simulate else {}
    guard = (
        _model_guard(prepared, activation, judged, bool(run.held_out), rounded, run.guard_loss)
        if judged
        else None
    )
    chosen: list[tuple[int, WeightGrid, torch.Tensor, torch.Tensor | None]] = []  # (site index, ...)
    ignored = {tap.site: tap.ignored for tap in taps(prepared)[0] if tap.ignored}
    nodes = {n.name: n for n in prepared.graph.nodes}
    progress = LayerProgress([ref.site.weight.numel() for ref in refs])
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
                (rows_key(c.site, nodes, c), c)
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
            simulation = QuantizedSimulation(prepared, activation, current, feeds, is_tap, rounded)
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
            del collected, quantized  # a Hessian's result must not outlive its site's choice
            progress.advance(site.label, site.weight.numel())
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
        keep = _guarded(guard, refs, chosen, rounded, current)
    for (k, grid, codes, corrected), kept in zip(chosen, keep):
        if not kept:
            continue  # the default (round-to-nearest) does better in this model
        site, bias_target = refs[k].site, refs[k].bias_target
        if grid is not grids[k]:
            set_qparams(site.group, (grid.scale, grid.zero_point))
        overrides.codes[(site.name, site.group)] = codes
        if corrected is not None and bias_target is not None:
            overrides.biases[bias_target] = corrected
    run.guarded = None if guard is None else guard.settled()
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


def _rounded_to_nearest(
    refs: Sequence[SiteRef], grids: Sequence[WeightGrid]
) -> Callable[[str], torch.Tensor | None]:
    """``get_attr target -> its weight rounded to nearest`` (None: no weight site), made from the
    program's own tensor at each call (:meth:`WeightGrid.rounded`)."""
    sites = {ref.site.name: (ref.site.weight, grid) for ref, grid in zip(refs, grids)}

    def read(target: str) -> torch.Tensor | None:
        found = sites.get(target)
        return None if found is None else found[1].rounded(found[0])

    return read


def _guarded(
    guard: ModelGuard,
    refs: Sequence[SiteRef],
    chosen: Sequence[tuple[int, WeightGrid, torch.Tensor, torch.Tensor | None]],
    rounded: Callable[[str], torch.Tensor | None],
    current: dict[str, torch.Tensor],
) -> list[bool]:
    """The guard's selection among ``chosen`` (a choice that changes nothing is kept unjudged).

    The default every choice is judged against holds the changed sites rounded to nearest, made
    once here; the weights no algorithm changed are the simulation's own rounding at each read."""
    candidates: list[Candidate] = []
    judged: list[int] = []
    base: dict[str, torch.Tensor] = {}
    for index, (k, _, _, corrected) in enumerate(chosen):
        ref = refs[k]
        default = rounded(ref.site.name)
        assert default is not None  # a chosen site is a weight site
        base[ref.site.name] = default
        now = {ref.site.name: current[ref.site.name]}
        before = {ref.site.name: default}
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
    rounded: Callable[[str], torch.Tensor | None],
    loss: GuardLoss | None = None,
) -> ModelGuard:
    """The guard over ``batches``, the float model's outputs its reference (or the task ``loss``).
    Its quantized runs read the weights a selection changes from the selection and every other
    weight site rounded to nearest (``rounded``), every other tensor from the program: no copy of
    its parameters."""

    def outputs(
        encodings: dict[int, tuple[Any, tuple[Any, Any] | None]], replaced: dict[str, torch.Tensor]
    ) -> list[list[torch.Tensor]]:
        simulation = QuantizedSimulation(prepared, encodings, replaced, {}, is_tap)
        return [output_tensors(simulation.outputs(batch)) for batch in batches]

    quantized = IncrementalOutputs(
        QuantizedSimulation(prepared, activation, {}, {}, is_tap, rounded), batches
    )
    return ModelGuard(
        # the output error widens the outputs itself (into buffers it reuses); a task loss gets float64
        lambda replaced: [output_tensors(out, widen=loss is not None) for out in quantized(replaced)],
        outputs({}, {}),
        judged_on="held-out" if held_out else "calibration",
        loss=loss,
        inputs=list(batches),
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


class SiteObserver:
    """:meth:`WeightGrid.observe` for a site: a fresh copy of its group's weight observer fed the
    tensor; and :meth:`extremes`, the same from a weight's channel extremes alone, where that is
    all the observer reads."""

    def __init__(self, prototype: nn.Module) -> None:
        self.prototype = prototype

    def __call__(self, tensor: torch.Tensor) -> tuple[Any, Any]:
        return _encoding(self.prototype, tensor.detach())

    def extremes(self, low: torch.Tensor, high: torch.Tensor) -> tuple[Any, Any] | None:
        """What calling this gives any weight whose channels (axis 0) have float32 minima ``low``
        and maxima ``high``, without the weight; None where that is not known from them.

        Known for quantplug's :class:`~_quantplug.observers.minmax.PerChannelMinMaxObserver` on
        axis 0 (the exact class: a subclass or another observer may read more): it reads of a
        weight only each channel's min and max (``amin``/``amax``) and computes the encoding
        from them, unless they are not ordinary (NaN, inf, a mask sentinel: then it scans the
        weight again, and this answers None). So a fresh copy fed ``[channels, 2]`` holding just
        those extremes gives, bit for bit, the encoding it gives the weight. A scale search asks
        this of each candidate range (:meth:`~.weight_layers.SiteEncoder.of_extremes`), where
        observing the clipped weight is a pass over it to make it and two to read it."""
        prototype = self.prototype
        if type(prototype) is not PerChannelMinMaxObserver or prototype.ch_axis != 0:
            return None
        low, high = low.detach().to(torch.float32), high.detach().to(torch.float32)
        if not all_ordinary(prototype, low, high):
            return None
        pair = torch.stack([low, high], dim=1)
        if prototype.min_val.numel():  # it has seen a tensor: a copy would merge with that
            return _encoding(prototype, pair)
        # what a fresh copy of an unfed observer fed ``pair`` computes (its forward: the rows'
        # amin and amax, ordinary as the values they pick; its calculate_qparams: ``_qparams`` of
        # them), without copying it and calling it: those were 3/4 of this, a screened SeqMSE
        # asking it ~40 times per layer (a 110M Llama: 0.6 s of its search)
        scale, zero_point = prototype._qparams(torch.amin(pair, dim=1), torch.amax(pair, dim=1))
        return torch.as_tensor(scale).detach().to(torch.float32), torch.as_tensor(zero_point).detach()


def _encoding(prototype: nn.Module, tensor: torch.Tensor) -> tuple[Any, Any]:
    """The (float32 scale, zero point) a fresh copy of ``prototype`` gives after observing ``tensor``."""
    obs: Any = fresh_copy(prototype)
    with torch.no_grad():
        obs(tensor)
    scale, zp = obs.calculate_qparams()
    return torch.as_tensor(scale).detach().to(torch.float32), torch.as_tensor(zp).detach()


def _observer(observers: dict[int, nn.Module], ref: SiteRef) -> SiteObserver:
    """:meth:`WeightGrid.observe` for a site (:class:`SiteObserver`)."""
    return SiteObserver(observers[ref.site.group])


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
    codes = grid.quantize(site.weight, dtype=grid.code_dtype)  # int64 would be 2x a float32 weight
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
            codes = grid.quantize(site.weight, dtype=grid.code_dtype)
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
        codes = new.to(grid.code_dtype)
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
        if run.held_out or not run.guard
        else ", or give the algorithm guard batches not calibrated on (Algorithms([...], held_out=...), "
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
