"""The algorithm guard: an algorithm's weight choice is kept only where the model does no worse.

Every weight algorithm optimises a proxy: one layer's output error on the inputs it collected. A
proxy can disagree with the model: AdaRound's choice for the random CNN's classifier lowers that
layer's error and costs the model 1.4 dB, because the quantized model feeds the classifier inputs
carrying the upstream layers' error; SeqMSE on the same CNN at 8-bit per-tensor weights lowers a
conv's error and loses 1.2 dB at the output, because the global average pool weighs an error's mean
far more than its noise (``docs/weight-algorithms.md``). No per-layer objective sees either.

So at convert, with the guard on (the default; ``Algorithms([...], guard=False)`` turns it
off), the algorithms first choose every site as they would unguarded (sequential inputs see the
choices upstream), then the guard selects which choices to keep (:meth:`ModelGuard.select`; a
site's choice is its codes, encoding and bias correction together, a site not kept is rounded to
nearest), judging by the output error against float (:func:`relative_error`) of the quantized
model's simulation (:class:`~_quantplug.algorithms.sequential.QuantizedSimulation`: activations
fake-quantized with their calibrated encodings) on the first stored calibration batches. **On
those batches the converted model is never worse than every choice kept, nor than the default
beyond a tie margin of 0.004 dB** (:data:`TIE`: differences that small are float noise, which
must not decide what the converted program holds on a given machine), by construction, whatever
the algorithms do.

Cost: one simulated forward pass over at most :data:`GUARD_BATCHES` batches (:data:`GUARD_BYTES`
bytes) per weight site an algorithm changed, plus three (float, default, every choice); twice
that where the pruned selection does worse than the default; a selection judged before is not
simulated again. Each trial after the first resumes
from the live values before the first node its changed weight reaches
(:class:`~_quantplug.algorithms.sequential.IncrementalOutputs`), so a trial on a late layer costs
the program from that layer on, not a whole pass.

``Algorithms([...], guard_loss=fn)`` replaces the output error by the task's own loss
(:func:`task_loss`): closer to float is not always better for the task (SeqMSE on the trained
byte-level LSTM brings its logits closer to float and raises its next-byte cross-entropy on
held-out and test text alike), and where the user can say what the model is for, the guard
selects by that.

Transforms of the float program (CLE, SmoothQuant) are judged the same way at prepare
(:func:`quantized_error`): the program is quantized with the user's quantizer and no algorithm,
before and after the transform, each calibrated and measured on the first batches given to
``Algorithms([...], calibration=...)``, and the transform is undone where its quantized model does
worse. CLE targets per-tensor weight grids; on per-channel 4-bit grids it can lose (the digits CNN
at ``qnn_htp``: -1.5 dB), which no statistic of the pair foretells as well as the quantizer does.
A transform that rewrites the graph (rather than replacing constants) is kept as it is.

Judged on the calibration batches, a choice that fits them and nothing else passes: GPTQ on a
layer that saw fewer rows than it has inputs (ConvNeXt's classifier on 16 images) gains there and
loses 2-4 dB held out. ``Algorithms([...], held_out=batches)`` gives the guard data the algorithms never
saw: both the choices and the transforms are then judged on it (transforms still calibrated on the
calibration batches), and the guarantee holds there instead.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch.fx import GraphModule, Interpreter
from torch.utils import _pytree as pytree

from _quantplug.algorithms.sequential import batch_bytes, fits
from _quantplug.errors import AlgorithmError, NonFiniteError
from _quantplug.graph.calls import Call, check_flat_inputs
from _quantplug.graph.mutation import private_inputs, writes_an_input
from _quantplug.observers.nonfinite import nonfinite_counts

logger = logging.getLogger("quantplug.algorithms")

#: at most this many of the stored calibration batches judge the choices ...
GUARD_BATCHES = 8
#: ... and at most this many bytes of them (the first batch always)
GUARD_BYTES = 32 * 2**20
#: errors within this relative margin of each other are a tie (about 0.004 dB). A choice that
#: changes the model's error by less is not an accuracy change but float noise, which differs with
#: the thread count and the CPU (reduction order, an activation rounded the other way at a .5);
#: deciding such a choice by the sign of that noise would make the converted program depend on the
#: machine, a whole layer's codes at a time. With the margin a tie is decided by rule (the choice
#: kept, no fallback), and noise changes a verdict only where the true difference sits on the
#: margin itself. Measured: calibration inputs perturbed by 1e-7 (relative) moved the guard's
#: errors by 1e-7 to 2.3e-4 (relative) on the bench's CNN and encoder, 4.4e-4 at 1e-6.
TIE = 1e-3


def lower(error: float, than: float) -> bool:
    """Whether ``error`` is lower than ``than`` by more than the tie margin (:data:`TIE`)."""
    return error < than * (1 - TIE)


#: the outputs of one batch: every floating-point tensor of the model's output, in pytree order
Outputs = list[torch.Tensor]


def output_tensors(value: Any, widen: bool = True) -> Outputs:
    """The floating-point tensors of a model output (any nesting of tuples, lists, dicts), in
    float64; ``widen=False``: in their own dtype (:func:`relative_error` widens them itself, into
    buffers it reuses: a new float64 copy of an LLM's logits per trial cost page faults)."""
    return [
        t.detach().to(torch.float64) if widen else t.detach()
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


@dataclass(frozen=True)
class ReferenceTerm:
    """What :func:`relative_error` needs of one float output, whatever it is compared with: where
    it is finite (None: everywhere, the usual case) and its energy there."""

    finite: torch.Tensor | None
    energy: float


def reference_terms(reference: Sequence[Outputs]) -> list[list[ReferenceTerm]]:
    """Each reference output's :class:`ReferenceTerm`, per batch: made once for a guard that
    compares many runs with one reference (an LLM's logits cost a pass each for the mask and the
    energy, per trial)."""
    terms: list[list[ReferenceTerm]] = []
    for batch in reference:
        row: list[ReferenceTerm] = []
        for ref in batch:
            finite = torch.isfinite(ref)
            kept = ref if bool(finite.all()) else ref[finite]
            row.append(ReferenceTerm(None if kept is ref else finite, float((kept * kept).sum())))
        terms.append(row)
    return terms


def relative_error(
    reference: Sequence[Outputs],
    outputs: Sequence[Outputs],
    terms: Sequence[Sequence[ReferenceTerm]] | None = None,
    scratch: dict[Any, torch.Tensor] | None = None,
) -> float:
    """``sum over outputs of |q - f|^2 / |f|^2``, each sum over every batch.

    Each output counts relative to its own energy, so a small output (an LSTM's cell state beside
    its sequence) is not drowned by a large one. Positions where the float output is not finite
    (masked logits) are left out; a finite float value the quantized model turns into NaN or inf
    makes the error infinite. An all-zero float output counts its absolute error. ``terms``:
    :func:`reference_terms` of ``reference``, if made already (the same result). ``outputs`` may
    be in another floating-point dtype than float64 (:func:`output_tensors` with ``widen=False``):
    the same result, each widened exactly before it is compared. ``scratch``: where the
    differences are made, kept by a caller that compares many runs (the guard: its trials then
    allocate none; each difference in the layout its first one took, so summed in the same order).
    """
    if len(reference) != len(outputs):
        raise ValueError(f"{len(outputs)} batches of outputs for {len(reference)} reference batches")
    if terms is None:
        terms = reference_terms(reference)
    errors: list[float] = []
    energies: list[float] = []
    for ref_batch, out_batch, term_batch in zip(reference, outputs, terms):
        if len(ref_batch) != len(out_batch):
            raise ValueError(f"{len(out_batch)} outputs for {len(ref_batch)} reference outputs")
        for index, (ref, out, term) in enumerate(zip(ref_batch, out_batch, term_batch)):
            if index == len(errors):
                errors.append(0.0)
                energies.append(0.0)
            if term.finite is None:  # the usual case: no mask (masked copies of an LLM's logits
                kept_ref, kept_out = ref, out  # cost more than the guard's simulation of them)
            else:
                kept_ref, kept_out = ref[term.finite], out[term.finite]
            diff = _difference(kept_out, kept_ref, scratch)
            error = float(diff.mul_(diff).sum())
            if not math.isfinite(error):  # a NaN or inf in the output (the reference is finite
                return float("inf")  # here): one pass over an LLM's logits, not three
            errors[index] += error
            energies[index] += term.energy
    return sum(e / n if n > 0 else e for e, n in zip(errors, energies))


def _difference(
    out: torch.Tensor, ref: torch.Tensor, scratch: dict[Any, torch.Tensor] | None
) -> torch.Tensor:
    """``out - ref`` in float64 (``out`` widened first). With ``scratch``, written into the buffer
    an earlier difference of the same operands' dtype, shapes and strides left there (made by the
    same expression, so of the layout it gives: the sum over it adds in the same order): the cast
    and the subtraction the same IEEE operations, element by element, without a new allocation."""
    if scratch is None:
        return out.to(torch.float64) - ref
    key = (out.dtype, ref.dtype, tuple(out.shape), out.stride(), tuple(ref.shape), ref.stride())
    buffer = scratch.get(key)
    if buffer is None:
        buffer = scratch[key] = out.to(torch.float64) - ref
        return buffer
    return buffer.copy_(out).sub_(ref)


#: ``Algorithms([...], guard_loss=...)``: one batch's quantized outputs (:func:`output_tensors`)
#: and flat inputs -> the task's loss on it (lower is better, never negative)
GuardLoss = Callable[[Outputs, tuple[Any, ...]], float]


def task_loss(loss: GuardLoss, outputs: Sequence[Outputs], batches: Sequence[tuple[Any, ...]]) -> float:
    """The mean of the user's ``loss`` over the batches; a NaN or inf loss (a quantized model
    that overflows) is the worst there is, as :func:`relative_error` counts a non-finite output."""
    if len(outputs) != len(batches):
        raise ValueError(f"{len(outputs)} batches of outputs for {len(batches)} batches of inputs")
    total = 0.0
    for index, (out, batch) in enumerate(zip(outputs, batches)):
        value = loss(out, batch)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise AlgorithmError(
                f"Algorithms(guard_loss=...) returned {type(value).__name__} for batch {index}: it "
                "must return one number, the batch's loss (lower is better); call .item() on a tensor"
            )
        if math.isnan(value) or math.isinf(value):
            return float("inf")
        if value < 0:
            raise AlgorithmError(
                f"Algorithms(guard_loss=...) returned {value} for batch {index}: the guard compares "
                "losses by their ratio (a tie margin of 0.1 %), so a loss must not be negative; "
                "add a constant that keeps it above 0"
            )
        total += float(value)
    return total / len(batches) if batches else 0.0


def measure(
    reference: Sequence[Outputs],
    outputs: Sequence[Outputs],
    loss: GuardLoss | None,
    batches: Sequence[tuple[Any, ...]],
    terms: Sequence[Sequence[ReferenceTerm]] | None = None,
    scratch: dict[Any, torch.Tensor] | None = None,
) -> float:
    """What the guard minimises: the user's task loss where given, else the output error
    (``terms``: :func:`reference_terms` of ``reference``, if made already; ``scratch``: buffers
    for :func:`relative_error`)."""
    if loss is None:
        return relative_error(reference, outputs, terms, scratch)
    return task_loss(loss, outputs, batches)


def change(worse: float, better: float, loss: bool) -> str:
    """What a choice cost, for messages: the output SQNR change, or the task loss's."""
    if not loss:
        return f"{decibels(worse, better):+.2f} dB"
    if math.isinf(worse) or better <= 0:
        return "loss +inf %" if worse > better else "loss +0.00 %"
    return f"loss {100 * (worse / better - 1):+.2f} %"


class Prepare(Protocol):
    """``prepare(program, quantizer, nonfinite=...)``: a float program prepared, no algorithm."""

    def __call__(self, program: GraphModule, quantizer: Any, *, nonfinite: str) -> GraphModule: ...


@dataclass(frozen=True)
class FlowSteps:
    """prepare and convert, as flow hands them to the algorithms.

    The algorithms sit a layer below ``flow`` (``_quantplug.LAYERS``), whose prepare and convert
    call them; the guard still quantizes candidate programs (:func:`quantized_error`), with the
    steps flow passes down, never by importing flow.
    """

    prepare: Prepare
    convert: Callable[[GraphModule], GraphModule]


def quantized_error(
    steps: FlowSteps,
    gm: GraphModule,
    quantizer: Any,
    batches: Sequence[tuple[Any, ...]],
    reference: Sequence[Outputs],
    nonfinite: str,
    measured: Sequence[tuple[Any, ...]] | None = None,
    loss: GuardLoss | None = None,
) -> float:
    """:func:`relative_error` of ``gm`` (a float program) quantized by ``quantizer`` without
    algorithms (with ``steps``), calibrated on ``batches`` (flat inputs) and run on ``measured``
    (default: the same batches), against ``reference`` (the float program's outputs on those);
    with ``loss``, the task loss there instead (:func:`measure`)."""
    prepared = steps.prepare(gm, quantizer, nonfinite=nonfinite)
    own = private_inputs if writes_an_input(gm.graph) else (lambda batch: batch)  # runs repeat
    with torch.no_grad():
        for batch in batches:
            Interpreter(prepared).run(*own(batch))
        converted = steps.convert(prepared)
        runs = batches if measured is None else measured
        outputs = [output_tensors(Interpreter(converted).run(*own(batch))) for batch in runs]
    return measure(reference, outputs, loss, runs)


def guard_batches(
    batches: Sequence[tuple[Any, ...]], max_batches: int = GUARD_BATCHES, max_bytes: int = GUARD_BYTES
) -> list[tuple[Any, ...]]:
    """The first stored batches within the caps (the first one always, however large): the
    store's own rule (:func:`~_quantplug.algorithms.sequential.fits`)."""
    chosen: list[tuple[Any, ...]] = []
    total = 0
    for batch in batches:
        size = batch_bytes(batch)
        if not fits(len(chosen), total, size, max_batches, max_bytes):
            break
        chosen.append(batch)
        total += size
    return chosen


def flat_batches(
    gm: GraphModule, batches: Sequence[Any], in_spec: Any, what: str, nonfinite: str = "error"
) -> list[tuple[Any, ...]]:
    """The guard's held-out batches as the program's flat inputs (copies, so the caller may reuse
    its tensors), each checked against the program, and capped as the guard caps calibration
    batches (:func:`~_quantplug.algorithms.guard.guard_batches`). NaN/inf in them raise as they
    would in calibration data, unless ``nonfinite="ignore"`` (the guard then leaves the outputs
    they reach out of its measure)."""
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


@dataclass(frozen=True)
class Candidate:
    """One weight site's choice: what the simulation reads with it and without it (the default)."""

    label: str
    chosen: Mapping[str, torch.Tensor]
    default: Mapping[str, torch.Tensor]


@dataclass
class ModelGuard:
    """Selects the weight choices to keep by the model's output error on a few calibration batches.

    ``evaluate(weights)`` runs the quantized simulation with ``weights`` (get_attr target ->
    tensor, what the simulation reads instead of each float weight and bias) and returns each
    batch's :func:`output_tensors`; ``reference`` is the float model's.
    """

    evaluate: Callable[[Mapping[str, torch.Tensor]], list[Outputs]]
    reference: list[Outputs]
    #: the error of the selection (set by :meth:`select`)
    error: float = float("inf")
    #: the error with every weight at its default
    default_error: float = float("inf")
    #: choices left out: ``(weight label, error with it, error without it)`` when it was decided
    kept_out: list[tuple[str, float, float]] = field(default_factory=list)
    #: choices judged
    tried: int = 0
    #: which batches the error is measured on, for messages (``Algorithms([...], held_out=...)``)
    judged_on: str = "calibration"
    #: the user's task loss (``Algorithms([...], guard_loss=...)``), measured on ``inputs`` (the
    #: judged batches, flat) instead of the output error; None: the output error
    loss: GuardLoss | None = None
    inputs: Sequence[tuple[Any, ...]] = ()
    #: :func:`reference_terms` of ``reference``, made at the first trial
    _terms: list[list[ReferenceTerm]] | None = field(default=None, init=False, repr=False)
    #: :func:`relative_error`'s buffers, reused by every trial of a selection
    _scratch: dict[Any, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    #: trials run, the count the selection runs at most so far, and when it started (progress)
    _trials: int = field(default=0, init=False, repr=False)
    _bound: int = field(default=0, init=False, repr=False)
    _start: float = field(default=0.0, init=False, repr=False)

    def _error(self, weights: Mapping[str, torch.Tensor]) -> float:
        if self._terms is None and self.loss is None:
            self._terms = reference_terms(self.reference)
        found = measure(
            self.reference, self.evaluate(weights), self.loss, self.inputs, self._terms, self._scratch
        )
        self._trials += 1
        self._progress()
        return found

    def _progress(self) -> None:
        """A log line per trial: on an LLM the selection runs a simulated pass (most of one) per
        weight site, minutes in all, after the algorithms' own per-layer lines."""
        elapsed = time.perf_counter() - self._start
        logger.info(
            "algorithm guard: trial %d of at most %d (%.1f s so far)", self._trials, self._bound, elapsed
        )

    def select(self, base: Mapping[str, torch.Tensor], candidates: Sequence[Candidate]) -> list[bool]:
        """Which candidates to keep, in their order (upstream first).

        Pruning: from every choice kept, each one in turn, downstream first, is dropped (its site
        back to the default) where that lowers the error; then each dropped one is taken back
        where that lowers it (it may have lost only beside a worse choice since dropped).
        Choices that pay only together survive it: GPTQ on the digits MLP's first layer loses
        0.1 dB beside round-to-nearest downstream and is worth 6 dB beside GPTQ's downstream
        choices, which a decision upstream first, against the default, would miss. Should the
        default still do better than the pruned selection, forward selection decides instead: from
        the default, upstream first, each choice is kept where it lowers the error. "Lowers" and
        "better" mean by more than the tie margin (:data:`TIE`), so float noise decides nothing.
        The error is at most that of every choice kept, and at most the default's within the
        margin (``default / (1 - TIE)``; exactly, when forward selection decided).
        """
        self.tried = len(candidates)
        self._trials, self._bound, self._start = 0, 2 + 2 * len(candidates), time.perf_counter()
        verdicts: dict[int, tuple[float, float]] = {}  # last judgment: (error with, error without)
        # the error of each selection judged (by the choices it keeps): a selection judged again
        # reads the same weights, so it has the same error. The first choice taken back (the most
        # upstream one dropped) is the selection its drop was judged against: on an LLM that
        # trial is a whole simulated pass
        known: dict[frozenset[int], float] = {}

        def error_of(kept: frozenset[int], weights: Mapping[str, torch.Tensor]) -> float:
            found = known.get(kept)
            if found is None:
                found = known[kept] = self._error(weights)
            return found

        self.default_error = error_of(frozenset(), base)
        current = {**base}
        for candidate in candidates:
            current.update(candidate.chosen)
        state = frozenset(range(len(candidates)))
        error = error_of(state, current)
        keep = [True] * len(candidates)
        for i in reversed(range(len(candidates))):
            trial = {**current, **candidates[i].default}
            found = error_of(state - {i}, trial)
            verdicts[i] = (error, found)
            if lower(found, error):
                keep[i] = False
                current, error, state = trial, found, state - {i}
        for i in [i for i, k in enumerate(keep) if not k]:
            trial = {**current, **candidates[i].chosen}
            found = error_of(state | {i}, trial)
            verdicts[i] = (found, error)
            if lower(found, error):
                keep[i] = True
                current, error, state = trial, found, state | {i}
        if lower(self.default_error, error):
            self._bound = self._trials + len(candidates)  # forward selection: one more sweep
            current, error, state = {**base}, self.default_error, frozenset()
            for i, candidate in enumerate(candidates):
                trial = {**current, **candidate.chosen}
                found = error_of(state | {i}, trial)
                verdicts[i] = (found, error)
                keep[i] = lower(found, error)
                if keep[i]:
                    current, error, state = trial, found, state | {i}
        self.error = error
        self.kept_out = [(c.label, *verdicts[i]) for i, c in enumerate(candidates) if not keep[i]]
        self._scratch.clear()  # the guard stays in the program's metadata; its buffers need not
        return keep

    def settled(self) -> ModelGuard:
        """The verdicts alone, for the prepared program's metadata after convert: ``evaluate``
        holds the quantized simulation (the prepared program, the choices' weights, every judged
        batch's values at each checkpoint) and ``reference`` the float outputs, which kept past
        convert held several times an LLM's weights for a one-line report."""
        return replace(self, evaluate=_judged, reference=[], inputs=())

    def summary(self) -> str:
        """The verdicts in one line (the CLI's report shows it beside the algorithms)."""
        if not self.kept_out:
            return f"every choice kept ({self.tried} weight(s) changed by the algorithms)"
        loss = self.loss is not None
        shown = ", ".join(
            f"{label} ({change(worse, better, loss)})" for label, worse, better in self.kept_out[:5]
        )
        more = f" and {len(self.kept_out) - 5} more" if len(self.kept_out) > 5 else ""
        return (
            f"round-to-nearest kept at {len(self.kept_out)} of {self.tried} weight(s), where the "
            f"algorithms' choice {'raised the task loss' if loss else 'lowered the output SQNR'} on the "
            f"{self.judged_on} batches: "
            f"{shown}{more}"
        )

    def report(self) -> None:
        """One log line naming the weights where the default was kept (with what their choice cost)."""
        if self.kept_out:
            logger.info("algorithm guard: %s", self.summary())


def _judged(weights: Mapping[str, torch.Tensor]) -> list[Outputs]:
    """The ``evaluate`` of a :meth:`ModelGuard.settled` guard: it judged already."""
    raise AlgorithmError(
        "this algorithm guard has judged its program's weights at convert and kept only its "
        "verdicts (kept_out, error, summary()); convert the prepared program again to judge anew"
    )


def decibels(worse: float, better: float) -> float:
    """The SQNR change (dB) from error ``better`` to error ``worse`` (negative: a loss)."""
    if worse == float("inf"):
        return float("-inf")
    if better <= 0 or worse <= 0:
        return 0.0
    return 10 * math.log10(better / worse)
