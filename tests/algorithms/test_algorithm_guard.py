"""The algorithm guard (``_quantplug.algorithms.guard``): at convert it selects which layers keep the
algorithms' weight choice by the quantized model's output on the first calibration batches, so the
model is never worse than the default on those batches, whatever the algorithms choose; at prepare
it undoes a transform whose quantized program does worse."""

from __future__ import annotations

import logging
import math
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.fx import Interpreter, Node

import quantplug
from _quantplug.algorithms.cle import find_pairs
from _quantplug.algorithms.guard import TIE, Candidate, ModelGuard, relative_error
from _quantplug.algorithms.spec import TransformContext, WeightChoice, WeightGrid, WeightSite
from _quantplug.graph.attrs import fetch_attr
from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY
from tests.algorithms.test_transforms import ConvNet, unbalanced_convnet

BATCH = 8


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        with torch.no_grad():
            for layer in (self.fc1, self.fc2, self.fc3):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.3)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Shift(quantplug.Algorithm):
    """Moves the codes of the named layers' weights ``step`` grid points (clipped) and adds
    ``bias`` to their biases: a choice no model wants."""

    name = "shift"

    def __init__(self, layers: set[str], step: int = 1, bias: float = 0.0, scale: float = 1.0) -> None:
        self.layers = layers
        self.step = step
        self.bias = bias
        self.scale = scale

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        if site.name not in self.layers:
            return None
        delta = torch.full((site.weight.shape[0],), self.bias) if self.bias else None
        if self.scale != 1.0:  # a coarser encoding (its codes: the weight rounded on it)
            return WeightChoice(scale=grid.scale * self.scale, bias_delta=delta)
        moved = torch.clamp(codes + self.step, grid.quant_min, grid.quant_max)
        return WeightChoice(codes=moved, bias_delta=delta)


class Perturb(quantplug.Algorithm):
    """Moves a random tenth of every weight's codes one step either way and may add a random bias
    offset (seeded): some choices help the model by chance, most hurt it."""

    name = "perturb"

    def __init__(self, seed: int, bias: float) -> None:
        self.seed = seed
        self.bias = bias

    def choose_weight(
        self, site: WeightSite, grid: WeightGrid, codes: torch.Tensor, collected: Any
    ) -> WeightChoice | None:
        g = torch.Generator().manual_seed(self.seed + len(site.name))
        where = torch.rand(codes.shape, generator=g) < 0.1
        step = torch.randint(0, 2, codes.shape, generator=g) * 2 - 1
        moved = torch.clamp(codes + where * step, grid.quant_min, grid.quant_max)
        delta = torch.randn(site.weight.shape[0], generator=g) * self.bias if self.bias else None
        return WeightChoice(codes=moved, bias_delta=delta)


def data() -> torch.Tensor:
    return torch.randn(8 * BATCH, 16, generator=torch.Generator().manual_seed(1))


def convert(
    algorithms: list[Any],
    guard: bool = True,
    preset: str = "int8",
    x: torch.Tensor | None = None,
    held_out: Any = "calibration",
) -> tuple[Any, Any]:
    """The converted MLP (reference backend, calibrated on ``x`` in batches of 8) and its prepared
    module. The guard judges on the calibration batches (``held_out="calibration"``) unless told:
    these tests check what it guarantees on the batches it judges on."""
    x = data() if x is None else x
    ep = torch.export.export(Mlp().eval(), (x[:BATCH],))
    quantizer = quantplug.get_quantizer("reference", preset=preset)
    config = quantplug.Algorithms(algorithms, guard=guard, held_out=held_out if guard else None)
    prepared = quantplug.prepare(ep, quantizer, algorithms=config)
    for i in range(0, len(x), BATCH):
        prepared(x[i : i + BATCH])
    return quantplug.convert(prepared), prepared


def outputs(converted: Any, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([converted(x[i : i + BATCH]) for i in range(0, len(x), BATCH)])


def calibration_error(converted: Any, x: torch.Tensor) -> float:
    """The guard's measure (sum of relative squared errors) of ``converted`` on all of ``x``."""
    with torch.no_grad():
        ref = Mlp().eval()(x).to(torch.float64)
    return relative_error([[ref]], [[outputs(converted, x).to(torch.float64)]])


def test_a_choice_that_worsens_the_model_is_not_kept(caplog: pytest.LogCaptureFixture) -> None:
    x = data()
    default, _ = convert([])
    with caplog.at_level(logging.INFO, logger="quantplug.algorithms"):
        guarded, prepared = convert([Shift({"fc2.weight"})])
    assert torch.equal(outputs(guarded, x), outputs(default, x))  # the default, bit for bit
    verdicts = prepared.meta[RUN_KEY].guarded
    assert [label for label, _, _ in verdicts.kept_out] == ["fc2.weight"] and verdicts.tried == 1
    assert "round-to-nearest kept at 1 of 1 weight(s)" in caplog.text and "fc2.weight (-" in caplog.text
    unguarded, _ = convert([Shift({"fc2.weight"})], guard=False)
    assert calibration_error(unguarded, x) > 2 * calibration_error(default, x)  # what the guard prevents


@pytest.mark.parametrize(
    "choice",
    [Shift({"fc1.weight"}, step=0, bias=0.5), Shift({"fc1.weight"}, scale=4.0)],
    ids=["bias correction", "encoding"],
)
def test_a_harmful_bias_correction_or_encoding_is_not_kept(choice: Shift) -> None:
    x = data()
    default, _ = convert([])
    guarded, prepared = convert([choice])
    assert torch.equal(outputs(guarded, x), outputs(default, x))
    assert guarded.meta["quantplug_qparams"].keys() == default.meta["quantplug_qparams"].keys()
    for key, qp in default.meta["quantplug_qparams"].items():  # the default's encodings, bias's too
        got = guarded.meta["quantplug_qparams"][key].scale
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(qp.scale))
    assert [label for label, _, _ in prepared.meta[RUN_KEY].guarded.kept_out] == ["fc1.weight"]


def test_choices_that_help_are_kept_layer_by_layer() -> None:
    """GPTQ helps every layer of the MLP at 4-bit weights; shifting fc3's codes after it does not:
    fc1 and fc2 keep GPTQ's codes, fc3 its default (not GPTQ's: the combination is judged)."""
    x = data()
    preset = "weight_only_int4"
    alone, alone_prepared = convert(["gptq"], preset=preset)
    assert alone_prepared.meta[RUN_KEY].guarded.kept_out == []
    unguarded, _ = convert(["gptq"], guard=False, preset=preset)
    assert torch.equal(outputs(alone, x), outputs(unguarded, x))  # nothing to refuse: the same program
    default, _ = convert([], preset=preset)
    assert calibration_error(alone, x) < calibration_error(default, x)

    mixed, prepared = convert(["gptq", Shift({"fc3.weight"}, step=3)], preset=preset)
    assert [label for label, _, _ in prepared.meta[RUN_KEY].guarded.kept_out] == ["fc3.weight"]
    got = dict(mixed.named_buffers()) | dict(mixed.named_parameters())
    from_gptq = dict(alone.named_buffers()) | dict(alone.named_parameters())
    from_default = dict(default.named_buffers()) | dict(default.named_parameters())
    fc3 = [name for name in got if got[name].dim() == 2 and got[name].shape == (8, 32)]
    assert fc3 and all(torch.equal(got[n], from_default[n]) for n in fc3)
    others = [n for n in got if got[n].dim() == 2 and n not in fc3]
    assert others and all(torch.equal(got[n], from_gptq[n]) for n in others)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.05]))
def test_the_guarded_model_is_never_worse_than_the_default_on_its_batches(seed: int, bias: float) -> None:
    """Whatever the algorithm chooses: the error of the converted program on the calibration
    batches (all of which the guard saw here) is at most the default's (within the tie margin);
    unguarded, it is not."""
    x = data()
    default, _ = convert([])
    guarded, prepared = convert([Perturb(seed, bias)])
    verdicts = prepared.meta[RUN_KEY].guarded
    assert verdicts.tried == 3
    # the simulation leaves out the biases' int32 rounding, which the converted program has
    assert calibration_error(guarded, x) <= calibration_error(default, x) / (1 - TIE) * (1 + 1e-4)
    unguarded, _ = convert([Perturb(seed, bias)], guard=False)
    if verdicts.kept_out:  # the guard refused something: what it refused made the model worse
        assert calibration_error(unguarded, x) > calibration_error(guarded, x)


def test_without_stored_batches_nothing_is_judged() -> None:
    """A prepared module never calibrated has no batches to judge on: choices are kept as made."""
    x = data()
    ep = torch.export.export(Mlp().eval(), (x[:BATCH],))
    quantizer = quantplug.get_quantizer("reference", preset="int8")
    algorithms = quantplug.Algorithms([Shift({"fc2.weight"})], held_out="calibration")
    prepared = quantplug.prepare(ep, quantizer, algorithms=algorithms)
    prepared.meta[RUN_KEY].inputs.batches.clear()
    for i in range(0, len(x), BATCH):  # observers calibrated, the store emptied afterwards
        prepared(x[i : i + BATCH])
    prepared.meta[RUN_KEY].inputs.batches.clear()
    quantplug.convert(prepared)
    assert prepared.meta[RUN_KEY].guarded is None


# -- the measure --------------------------------------------------------------------------------


def test_relative_error_weighs_each_output_by_its_own_energy() -> None:
    big, small = torch.full((4,), 100.0, dtype=torch.float64), torch.full((4,), 0.01, dtype=torch.float64)
    ref = [[big, small]]
    assert relative_error(ref, [[big * 1.1, small]]) == pytest.approx(0.01)
    assert relative_error(ref, [[big, small * 1.1]]) == pytest.approx(0.01)  # not drowned by `big`


def test_relative_error_leaves_out_what_float_does_not_compute_and_refuses_what_quantized_breaks() -> None:
    ref = torch.tensor([1.0, -math.inf, 2.0, math.nan], dtype=torch.float64)
    same_where_finite = torch.tensor([1.0, 0.0, 2.0, 5.0], dtype=torch.float64)
    assert relative_error([[ref]], [[same_where_finite]]) == 0.0
    broken = torch.tensor([1.0, 0.0, math.nan, 0.0], dtype=torch.float64)
    assert relative_error([[ref]], [[broken]]) == math.inf


finite_vectors = st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=16)


@given(finite_vectors, st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))
def test_relative_error_is_zero_only_for_the_reference_and_scale_free(
    values: list[float], scale: float, seed: int
) -> None:
    ref = torch.tensor(values, dtype=torch.float64)
    assume(bool(ref.abs().max() > 1e-3))  # an all-zero output counts its absolute error
    noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    assert relative_error([[ref]], [[ref.clone()]]) == 0.0
    error = relative_error([[ref]], [[ref + noise]])
    assert error > 0
    assert relative_error([[ref * scale]], [[(ref + noise) * scale]]) == pytest.approx(error, rel=1e-9)


def select(errors: list[float], noise: list[float] | None = None) -> tuple[ModelGuard, list[bool]]:
    """The guard's selection over ``len(errors).bit_length() - 1`` choices whose model error with
    the choices in ``mask`` kept is ``errors[mask]`` (times ``1 + noise[k]`` at the k-th measure)."""
    n = len(errors).bit_length() - 1
    candidates = [Candidate(f"w{i}", {f"w{i}": torch.ones(1)}, {f"w{i}": torch.zeros(1)}) for i in range(n)]
    measured = iter(noise or [])

    def evaluate(weights: Any) -> list[list[torch.Tensor]]:
        mask = sum(1 << i for i in range(n) if bool(weights[f"w{i}"] == 1))
        error = errors[mask] * (1 + next(measured, 0.0))
        return [[torch.ones(1, dtype=torch.float64) + math.sqrt(error)]]

    guard = ModelGuard(evaluate, [[torch.ones(1, dtype=torch.float64)]])
    return guard, guard.select({f"w{i}": torch.zeros(1) for i in range(n)}, candidates)


@given(st.integers(1, 5).flatmap(lambda n: st.lists(st.floats(0, 10), min_size=2**n, max_size=2**n)))
def test_the_selection_is_never_worse_than_the_default_nor_than_every_choice(errors: list[float]) -> None:
    """Any interplay of the choices (``errors[mask]``: the model's error with the choices in
    ``mask`` kept): the selection's error is at most that of every choice kept and at most the
    default's (nothing kept) within the tie margin; it is the error of what it keeps."""
    guard, keep = select(errors)
    kept = sum(1 << i for i, k in enumerate(keep) if k)
    assert guard.error == pytest.approx(errors[kept], rel=1e-9, abs=1e-12)
    assert guard.error <= errors[0] / (1 - TIE) * (1 + 1e-9) + 1e-12
    assert guard.error <= errors[-1] * (1 + 1e-9) + 1e-12
    assert len(guard.kept_out) == keep.count(False) and guard.tried == len(keep)


def reference_selection(errors: list[float]) -> tuple[list[bool], float, list[int]]:
    """:meth:`ModelGuard.select`'s rule written out on ``errors[mask]`` (the model's error with the
    choices in ``mask`` kept), every step measured: the choices kept, the error, the masks run."""
    n = len(errors).bit_length() - 1
    runs: list[int] = []

    def measure(mask: int) -> float:
        runs.append(mask)
        return errors[mask]

    def lower(a: float, b: float) -> bool:
        return a < b * (1 - TIE)

    default = measure(0)
    mask = (1 << n) - 1
    error = measure(mask)
    for i in reversed(range(n)):
        found = measure(mask & ~(1 << i))
        if lower(found, error):
            mask, error = mask & ~(1 << i), found
    for i in [i for i in range(n) if not mask >> i & 1]:
        found = measure(mask | 1 << i)
        if lower(found, error):
            mask, error = mask | 1 << i, found
    if lower(default, error):
        mask, error = 0, default
        for i in range(n):
            found = measure(mask | 1 << i)
            if lower(found, error):
                mask, error = mask | 1 << i, found
    return [bool(mask >> i & 1) for i in range(n)], error, runs


@given(
    st.integers(1, 5).flatmap(
        lambda n: st.lists(st.sampled_from([1.0, 1.5, 2.0, 3.0, 5.0]), min_size=2**n, max_size=2**n)
    )
)
def test_the_selection_runs_each_selection_once_and_decides_as_if_it_ran_every_step(
    errors: list[float],
) -> None:
    """A selection judged before is not simulated again (its weights are the same, so is its
    error: the first choice taken back is the selection its drop was judged against, a whole
    pass on an LLM): the guard keeps what the rule measuring every step keeps, with the same
    error, and runs each selection the rule runs, each once."""
    n = len(errors).bit_length() - 1
    run: list[int] = []
    candidates = [Candidate(f"w{i}", {f"w{i}": torch.ones(1)}, {f"w{i}": torch.zeros(1)}) for i in range(n)]

    def evaluate(weights: Any) -> list[list[torch.Tensor]]:
        mask = sum(1 << i for i in range(n) if bool(weights[f"w{i}"] == 1))
        run.append(mask)
        return [[torch.ones(1, dtype=torch.float64) + math.sqrt(errors[mask])]]

    guard = ModelGuard(evaluate, [[torch.ones(1, dtype=torch.float64)]])
    keep = guard.select({f"w{i}": torch.zeros(1) for i in range(n)}, candidates)
    expected, error, runs = reference_selection(errors)
    assert keep == expected
    assert guard.error == pytest.approx(error, rel=1e-12)
    assert len(run) == len(set(run)) and set(run) == set(runs)


def test_each_trial_is_reported_within_the_count_announced(caplog: pytest.LogCaptureFixture) -> None:
    """On an LLM the guard's trials run for minutes after the algorithms' per-layer lines: each
    says how many the selection runs at most, and none goes past it (pruning alone; pruning that
    the default beats, then forward selection). A selection judged before is not run again: the
    first sweeps 3 trials of the rule's 5 (its last two steps were judged), the second 4 of 6."""
    for errors, total in (([4.0, 1.0, 2.0, 3.0], 3), ([1.0, 5.0, 5.0, 3.0], 4)):
        caplog.clear()
        with caplog.at_level("INFO", logger="quantplug.algorithms"):
            select(errors)
        found = [re.match(r"algorithm guard: trial (\d+) of at most (\d+)", m) for m in caplog.messages]
        trials = [(int(m.group(1)), int(m.group(2))) for m in found if m]
        assert [t for t, _ in trials] == list(range(1, total + 1))
        assert all(t <= bound for t, bound in trials)


# errors of 1, 2 or 3 choices on a coarse grid: every two of them equal, or 8 % apart or more
coarse_errors = st.integers(1, 3).flatmap(
    lambda n: st.lists(st.integers(0, 12).map(lambda k: 1.08**k), min_size=2**n, max_size=2**n)
)


#: relative noise on every measure: above what 1e-7 input noise did to the guard's errors on the
#: bench's models (up to 2.3e-4), a quarter of the margin
NOISE = 2.5e-4


@given(coarse_errors, st.lists(st.floats(-NOISE, NOISE), min_size=64, max_size=64))
def test_float_noise_below_the_tie_margin_changes_no_verdict(errors: list[float], noise: list[float]) -> None:
    """What the guard measures carries float noise that differs between machines (thread count,
    CPU). Choices whose true errors are equal (a choice that does nothing measurable, common) or
    clearly apart get the same verdicts whatever that noise: the converted program does not depend
    on the machine's rounding. Without the margin a tie would go by the noise's sign (this fails
    with ``TIE = 0``)."""
    assert NOISE <= TIE / 4
    _, clean = select(errors)
    _, noisy = select(errors, noise)
    assert noisy == clean


# -- transforms of the float program ----------------------------------------------------------------


class Unbalance(quantplug.Algorithm):
    """Divides output channel 0 of the first equalizable layer by 1000 and multiplies the next
    layer's channel 0 by it: the same float function (through the ReLU), a per-tensor grid of the
    second layer spent on one channel."""

    name = "unbalance"

    def transform_program(self, gm: torch.fx.GraphModule, context: TransformContext) -> None:
        pair = find_pairs(gm)[0]  # c1 -> relu -> c2 (depthwise: its channels along dim 0 too)
        first_w, first_b = (str(a.target) for a in pair.first.args[1:3])
        second_w = str(pair.second.args[1].target)
        s = torch.ones(fetch_attr(gm, first_w).shape[0])
        s[0] = 1000.0
        context.set_constant(gm, first_w, fetch_attr(gm, first_w) / s.reshape(-1, 1, 1, 1))
        context.set_constant(gm, first_b, fetch_attr(gm, first_b) / s)
        context.set_constant(gm, second_w, fetch_attr(gm, second_w) * s.reshape(-1, 1, 1, 1))


def convnet_outputs(
    algorithms: list[Any], guard: bool = True, model: nn.Module | None = None
) -> tuple[torch.Tensor, Any]:
    """The converted ConvNet's output on its calibration data (int8 per-tensor weights) and the
    prepared module."""
    model = ConvNet().eval() if model is None else model
    x = torch.randn(32, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    batches = [(x[i : i + 8],) for i in range(0, 32, 8)]
    ep = torch.export.export(model, batches[0])
    quantizer = quantplug.get_quantizer("reference", preset="int8_per_tensor")
    prepared = quantplug.prepare(
        ep,
        quantizer,
        algorithms=quantplug.Algorithms(
            algorithms, calibration=batches, guard=guard, held_out="calibration" if guard else None
        ),
    )
    with torch.no_grad():
        for b in batches:
            prepared(*b)
        return quantplug.convert(prepared)(x), prepared


def test_a_transform_that_worsens_the_quantized_model_is_undone(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = ConvNet().eval()
    with torch.no_grad():
        x = torch.randn(32, 3, 8, 8, generator=torch.Generator().manual_seed(2))
        ref = model(x)
    default, _ = convnet_outputs([], model=model)
    with caplog.at_level(logging.INFO, logger="quantplug.algorithms"):
        guarded, prepared = convnet_outputs([Unbalance()], model=model)
    assert torch.equal(guarded, default)  # the program as it was: the default, bit for bit
    assert [name for name, _, _ in prepared.meta[RUN_KEY].undone] == ["unbalance"]
    assert "algorithm guard: unbalance undone" in caplog.text
    unguarded, _ = convnet_outputs([Unbalance()], guard=False, model=model)
    assert (unguarded - ref).pow(2).sum() > 2 * (default - ref).pow(2).sum()  # what the guard prevents


def test_a_transform_that_helps_is_kept() -> None:
    """CLE on channels spread over three decades, at per-tensor weights (+10 dB: test_transforms)."""
    model = unbalanced_convnet()
    guarded, prepared = convnet_outputs(["cle"], model=model)
    assert prepared.meta[RUN_KEY].undone == []
    unguarded, _ = convnet_outputs(["cle"], guard=False, model=model)
    assert torch.equal(guarded, unguarded)


# -- what users bring ----------------------------------------------------------------------------


def test_a_guard_that_is_not_a_bool_is_a_typed_error() -> None:
    x = data()
    ep = torch.export.export(Mlp().eval(), (x[:BATCH],))
    quantizer = quantplug.get_quantizer("reference", preset="int8")
    with pytest.raises(quantplug.OptionError, match="guard must be True or False, got 'no'"):
        quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms(["gptq"], guard="no"))  # type: ignore[arg-type]


def test_the_callers_program_is_untouched_by_a_guarded_transform() -> None:
    """The trial quantizations and the undo work on quantplug's copy: the program's tensors keep
    their values (an undone and a kept transform both)."""
    torch.manual_seed(0)
    x = torch.randn(32, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    ep = torch.export.export(ConvNet().eval(), (x[:8],))
    before = {k: v.clone() for k, v in ep.state_dict.items()}
    quantizer = quantplug.get_quantizer("reference", preset="int8_per_tensor")
    batches = [(x[i : i + 8],) for i in range(0, 32, 8)]
    prepared = quantplug.prepare(
        ep, quantizer, algorithms=quantplug.Algorithms([Unbalance(), "cle"], calibration=batches)
    )
    assert "unbalance" in [name for name, _, _ in prepared.meta[RUN_KEY].undone]
    assert all(torch.equal(ep.state_dict[k], v) for k, v in before.items())


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


def test_the_guard_on_an_lstm_with_a_dynamic_batch_and_nan_samples_left_out() -> None:
    """Batches of 3, 5 and 7 sequences through a program exported with a free batch dimension,
    one sample holding a NaN under ``nonfinite="ignore"``: the guard judges on finite positions
    only, refuses a harmful choice (the head's codes shifted) and the result runs any batch."""
    torch.manual_seed(0)
    model = Recurrent().eval()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(n, 6, 8, generator=g) for n in (3, 5, 7, 3, 5, 7)]
    batches[1][2, 4, 0] = math.nan
    ep = torch.export.export(model, (batches[0],), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    algorithms = ["gptq", Shift({"head.weight"}, step=3)]
    prepared = quantplug.prepare(ep, quantizer, algorithms=algorithms, nonfinite="ignore")
    with torch.no_grad():
        for b in batches:
            prepared(b)
    converted = quantplug.convert(prepared)
    # the LSTM's weights are judged too (GPTQ gains little on its independent inputs); the head's
    # harmful codes must be refused whatever they decide
    assert "head.weight" in [label for label, _, _ in prepared.meta[RUN_KEY].guarded.kept_out]
    out = converted(torch.randn(11, 6, 8))
    assert out.shape == (11, 6, 4) and bool(torch.isfinite(out).all())


# -- held-out batches (Algorithms(..., held_out=...)) --------------------------------------------


class Wide(nn.Module):
    """64 inputs, 64 hidden: one calibration batch of 8 gives each layer 8 rows for 64 inputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def correlated(count: int, g: torch.Generator) -> list[torch.Tensor]:
    mix = torch.randn(64, 64, generator=torch.Generator().manual_seed(5)) * 0.2
    return [torch.randn(BATCH, 64, generator=g) @ mix for _ in range(count)]


def wide_converted(held_out: list[torch.Tensor] | None, algorithms: list[Any]) -> tuple[Any, Any]:
    """``Wide`` at weight-only int4, calibrated on one batch of 8 (its converted module and prepared)."""
    calibration = correlated(1, torch.Generator().manual_seed(1))
    ep = torch.export.export(Wide().eval(), (calibration[0],))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    prepared = quantplug.prepare(
        ep,
        quantizer,
        algorithms=quantplug.Algorithms(
            algorithms, held_out=[(b,) for b in held_out] if held_out is not None else None
        ),
    )
    with torch.no_grad():
        prepared(calibration[0])
    return quantplug.convert(prepared), prepared


def wide_error(converted: Any, batches: list[torch.Tensor]) -> float:
    with torch.no_grad():
        model = Wide().eval()
        return relative_error(
            [[model(b).double()] for b in batches], [[converted(b).double()] for b in batches]
        )


def test_held_out_batches_refuse_a_choice_that_only_fits_the_calibration_data(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """GPTQ on layers that saw 8 rows for 64 inputs fits its one calibration batch: judged there the
    guard keeps it, and it loses on new data; judged on held-out batches (``held_out=``) it is
    refused, and on those batches the model is no worse than the default (the guarantee)."""
    held_out = correlated(2, torch.Generator().manual_seed(7))
    unseen = correlated(8, torch.Generator().manual_seed(9))  # neither calibrated nor judged on
    default, _ = wide_converted(None, [])
    with caplog.at_level(logging.INFO, logger="quantplug.algorithms"):
        on_calibration, prepared = wide_converted(None, ["gptq"])
    assert prepared.meta[RUN_KEY].guarded.kept_out == []  # it fits the batch the guard judges on
    assert wide_error(on_calibration, unseen) > 1.2 * wide_error(default, unseen)
    assert "8 rows, 64 inputs" in caplog.text and "Algorithms([...], held_out=...)" in caplog.text  # advised
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="quantplug.algorithms"):
        judged, prepared = wide_converted(held_out, ["gptq"])
    verdicts = prepared.meta[RUN_KEY].guarded
    assert verdicts.kept_out and verdicts.judged_on == "held-out"
    assert "SQNR on the held-out batches" in caplog.text
    assert "8 rows, 64 inputs" in caplog.text and "held_out=" not in caplog.text  # already given
    assert wide_error(judged, held_out) <= wide_error(default, held_out) * (1 + 1e-4)
    assert wide_error(judged, unseen) < wide_error(on_calibration, unseen)
    assert prepared.meta[RUN_KEY].inputs is None  # nothing of the calibration data is stored for it


class ZeroUnseenInputs(quantplug.Algorithm):
    """Zeroes fc1's weight columns for the inputs the calibration batches leave at zero: the same
    float function on those batches and a finer per-channel grid, another model everywhere else."""

    name = "zero_unseen"

    def transform_program(self, gm: torch.fx.GraphModule, context: TransformContext) -> None:
        seen = torch.stack([b[0].abs().amax(0) for b in context.calibration]).amax(0) > 0
        weight = fetch_attr(gm, "fc1.weight")
        context.set_constant(gm, "fc1.weight", weight * seen.to(weight.dtype))


def test_held_out_batches_undo_a_transform_that_only_holds_on_the_calibration_data() -> None:
    g = torch.Generator().manual_seed(4)
    calibration = [torch.randn(BATCH, 16, generator=g) for _ in range(4)]
    for b in calibration:
        b[:, 8:] = 0  # half the inputs never vary in calibration
    held_out = [(torch.randn(BATCH, 16, generator=g),) for _ in range(2)]
    ep = torch.export.export(Mlp().eval(), (calibration[0],))

    def undone(**kw: Any) -> list[str]:
        quantizer = quantplug.get_quantizer("reference", preset="int8")
        batches = [(b,) for b in calibration]
        algorithms = [ZeroUnseenInputs()]
        prepared = quantplug.prepare(
            ep, quantizer, algorithms=quantplug.Algorithms(algorithms, calibration=batches, **kw)
        )
        return [name for name, _, _ in prepared.meta[RUN_KEY].undone]

    assert undone() == []  # on the calibration batches it changes nothing of the float model
    assert undone(held_out=held_out) == ["zero_unseen"]


@pytest.mark.parametrize(
    ("bad", "got"),
    [
        (
            lambda x: (x[:, :15],),
            r"input .x. has shape \(8, 15\) and dtype float32; the program expects \(8, 16\)",
        ),
        (
            lambda x: (x.double(),),
            r"input .x. has shape \(8, 16\) and dtype float64; the program expects \(8, 16\)",
        ),
        (lambda x: (x, x), r"which takes 1 positional: 1 positional input\(s\) too many"),
    ],
    ids=["shape", "dtype", "arity"],
)
def test_a_calibration_batch_that_does_not_fit_is_named(bad: Any, got: str) -> None:
    """Transforms run the float program on ``calibration``: where a batch does not fit and the run
    fails, the error names the batch, as a held-out one is named, rather than being a torch
    RuntimeError from inside the transform. Another batch size is not refused: it runs."""
    x = data()[:BATCH]
    ep = torch.export.export(Mlp().eval(), (x,))
    quantizer = quantplug.get_quantizer("qnn_htp", precision="16a4w")
    with pytest.raises(quantplug.QuantplugError, match=f"calibration batch 1(: |, ){got}"):
        quantplug.prepare(
            ep, quantizer, algorithms=quantplug.Algorithms(["smoothquant"], calibration=[(x,), bad(x)])
        )
    fits = quantplug.Algorithms(["smoothquant"], calibration=[(x,), (data()[: BATCH - 1],)])
    quantplug.prepare(ep, quantizer, algorithms=fits)


def test_held_out_batches_are_copied_and_checked() -> None:
    """The caller's tensors may change after prepare; a batch that does not fit the program, no
    batch at all, NaN (unless ignored, as in calibration data) or held-out batches with the guard
    off are typed errors naming the argument."""
    x = data()
    ep = torch.export.export(Mlp().eval(), (x[:BATCH],))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    held_out = [(x[:BATCH].clone(),)]
    prepared = quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms(["gptq"], held_out=held_out))
    kept = prepared.meta[RUN_KEY].held_out[0][0].clone()
    held_out[0][0].fill_(math.nan)
    assert torch.equal(prepared.meta[RUN_KEY].held_out[0][0], kept)
    with pytest.raises(quantplug.QuantplugError, match=r"held_out batch 1: input 'x' has shape \(8, 15\)"):
        quantplug.prepare(
            ep,
            quantizer,
            algorithms=quantplug.Algorithms(["gptq"], held_out=[(x[:BATCH],), (x[:BATCH, :15],)]),
        )
    with pytest.raises(quantplug.AlgorithmError, match="held_out holds no batch"):
        quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms(["gptq"], held_out=[]))
    with pytest.raises(quantplug.OptionError, match="guard=False turns the guard off"):
        quantplug.Algorithms(["gptq"], held_out=held_out, guard=False)
    with pytest.raises(quantplug.NonFiniteError, match="held_out batch 0: input 'x' holds 128 NaN and 0 inf"):
        quantplug.prepare(
            ep, quantizer, algorithms=quantplug.Algorithms(["gptq"], held_out=held_out)
        )  # all NaN now
    mixed = x[:BATCH].clone()
    mixed[0, 0] = math.nan
    prepared = quantplug.prepare(
        ep, quantizer, algorithms=quantplug.Algorithms(["gptq"], held_out=[(mixed,)]), nonfinite="ignore"
    )
    with torch.no_grad():
        prepared(x[BATCH:])
        assert bool(torch.isfinite(quantplug.convert(prepared)(x[:BATCH])).all())


def test_quantize_passes_held_out_batches_to_the_guard() -> None:
    held_out = correlated(2, torch.Generator().manual_seed(7))
    calibration = correlated(1, torch.Generator().manual_seed(1))
    converted = quantplug.quantize(
        Wide().eval(),
        (calibration[0],),
        backend="reference",
        preset="weight_only_int4",
        calibration=calibration,
        algorithms=quantplug.Algorithms(["gptq"], held_out=held_out),
    )
    judged, _ = wide_converted(held_out, ["gptq"])
    with torch.no_grad():
        assert torch.equal(converted(held_out[0]), judged(held_out[0]))
        assert not torch.equal(converted(held_out[0]), wide_converted(None, ["gptq"])[0](held_out[0]))


def test_held_out_batches_of_other_sizes_on_an_lstm_with_a_dynamic_batch() -> None:
    """Held-out batches of 2 and 9 sequences for a program calibrated on 3, 5 and 7 (a free batch
    dimension): the guard judges on them and refuses the harmful head choice."""
    torch.manual_seed(0)
    model = Recurrent().eval()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(n, 6, 8, generator=g) for n in (3, 5, 7)]
    held_out = [(torch.randn(n, 6, 8, generator=g),) for n in (2, 9)]
    ep = torch.export.export(model, (batches[0],), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    algorithms = ["gptq", Shift({"head.weight"}, step=3)]
    prepared = quantplug.prepare(
        ep, quantizer, algorithms=quantplug.Algorithms(algorithms, held_out=held_out)
    )
    with torch.no_grad():
        for b in batches:
            prepared(b)
    converted = quantplug.convert(prepared)
    verdicts = prepared.meta[RUN_KEY].guarded
    assert verdicts.judged_on == "held-out"
    assert "head.weight" in [label for label, _, _ in verdicts.kept_out]
    out = converted(torch.randn(11, 6, 8))
    assert out.shape == (11, 6, 4) and bool(torch.isfinite(out).all())


class Residual(nn.Module):
    """Linears on a residual stream (values live across the layers, as in a transformer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b, self.out = (
            nn.Linear(8, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + F.relu(self.a(h))
        h = h + torch.tanh(self.b(h))
        return self.out(h)


def _simulation_setup() -> tuple[Any, list[tuple[torch.Tensor]], list[str]]:
    from _quantplug.algorithms.sequential import QuantizedSimulation
    from _quantplug.algorithms.taps import is_tap

    batches = [(torch.randn(3, 8, generator=torch.Generator().manual_seed(i)),) for i in range(2)]
    ep = torch.export.export(Residual().eval(), batches[0])
    prepared = quantplug.prepare(ep, quantplug.get_quantizer("reference"), algorithms=[Shift({"a"})])
    for batch in batches:
        prepared(*batch)
    targets = [
        str(n.target) for n in prepared.graph.nodes if n.op == "get_attr" and "weight" in str(n.target)
    ]
    assert len(targets) == 4

    def simulation(weights: dict[str, torch.Tensor]) -> Any:
        return QuantizedSimulation(prepared, {}, weights, {}, is_tap)

    return simulation, batches, targets


@settings(max_examples=15, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=4, max_size=4), min_size=1, max_size=8))
def test_the_guard_resumes_trials_with_the_outputs_of_full_runs(selections: list[list[int]]) -> None:
    """Each selection (per weight: float, or one of two perturbed copies) run through the
    incremental simulation, resumed from the checkpoints of earlier runs, gives exactly the
    outputs of a full run of a fresh simulation."""
    from _quantplug.algorithms.sequential import IncrementalOutputs

    simulation, batches, targets = _simulation_setup()
    g = torch.Generator().manual_seed(5)
    params = dict(simulation({}).module.named_parameters())
    variants = {
        t: [params[t] + 0.1 * torch.randn(params[t].shape, generator=g) for _ in range(2)] for t in targets
    }
    incremental = IncrementalOutputs(simulation({}), batches)
    for selection in selections:
        weights = {t: variants[t][v - 1] for t, v in zip(targets, selection) if v}
        got = incremental(weights)
        full = [simulation(weights).outputs(batch) for batch in batches]
        assert all(torch.equal(a, b) for a, b in zip(got, full))


def test_the_guard_reruns_only_the_nodes_after_a_changed_weight() -> None:
    """A trial that changes the last layer's weight runs the nodes from that layer on, not the
    whole program (the guard's cost on an LLM: one site's share of a forward, not a forward)."""
    from _quantplug.algorithms.sequential import IncrementalOutputs

    simulation, batches, targets = _simulation_setup()
    sim = simulation({})
    ran: list[str] = []
    incremental = IncrementalOutputs(sim, batches)

    def counted(node: Node, step: Any) -> Any:
        return lambda env: ran.append(node.name) or (sim.run_node(node) if step is None else step(env))

    incremental.steps = [counted(n, step) for n, step in zip(incremental.nodes, incremental.steps)]
    incremental({})
    full = len(ran) // len(batches)
    ran.clear()
    last = targets[-1]
    incremental({last: dict(sim.module.named_parameters())[last] * 1.5})
    assert 0 < len(ran) // len(batches) < full / 2


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from(["contiguous", "transposed", "sliced"]),
    st.booleans(),
    st.integers(1, 4),
)
def test_the_guards_errors_in_reused_buffers_are_the_float64_errors(
    seed: int, layout: str, masked: bool, trials: int
) -> None:
    """The guard's output error with float32 outputs widened into buffers it reuses, trial after
    trial, is bit for bit the error of the outputs copied to float64 (what :func:`relative_error`
    computes without buffers), for any layout of the outputs and with a reference that holds
    non-finite values (left out of the measure)."""
    from _quantplug.algorithms.guard import output_tensors, reference_terms, relative_error

    g = torch.Generator().manual_seed(seed)

    def output(scale: float) -> list[torch.Tensor]:
        x = torch.randn(6, 37, generator=g) * scale
        y = torch.randn(3, 5, 9, generator=g)
        if layout == "transposed":
            x, y = x.t(), y.permute(2, 0, 1)
        elif layout == "sliced":
            x, y = x[:, 3:29], y[..., ::2]
        return [x, y]

    reference = [output_tensors(output(1.0)) for _ in range(2)]
    if masked:
        reference[0][0][..., ::7] = float("-inf")
        reference[1][1][0] = float("nan")
    terms = reference_terms(reference)
    scratch: dict[Any, torch.Tensor] = {}
    for _ in range(trials):
        outs = [[r.float() + 0.1 * o for r, o in zip(ref, output(1.0))] for ref in reference]
        if layout != "contiguous":
            outs = [[o.transpose(0, -1).contiguous().transpose(0, -1) for o in batch] for batch in outs]
        expected = relative_error(reference, [output_tensors(batch) for batch in outs])
        got = relative_error(
            reference, [output_tensors(batch, widen=False) for batch in outs], terms, scratch
        )
        assert got == expected or (math.isnan(got) and math.isnan(expected))
        assert math.isfinite(got)
    assert scratch


class AtenFakeQuantize(nn.Module):
    """An observer as the quantized program computes it: ATen's own fake quantize."""

    def __init__(self, scale: float, zero_point: int, qmin: int, qmax: int) -> None:
        super().__init__()
        self.args = (scale, zero_point, qmin, qmax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fake_quantize_per_tensor_affine(x, *self.args)


class Nothing(nn.Module):
    def forward(self, *args: Any) -> None:
        return None


#: (quant_min, quant_max) of the activation grids the trials are checked on
GRIDS = [(0, 255), (-128, 127), (0, 65535), (-32768, 32767)]


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.lists(st.lists(st.integers(0, 2), min_size=4, max_size=4), min_size=1, max_size=6),
)
def test_the_guards_trials_are_a_plain_interpreters_runs_of_the_quantized_program(
    seed: int, selections: list[list[int]]
) -> None:
    """Every trial of the guard's simulation (activations fake-quantized with random encodings,
    resumed from earlier runs' checkpoints, each node run by its compiled step, the native fake
    quantize where it applies) gives bit for bit what ``torch.fx.Interpreter`` computes on the
    program with the selection's weights set and each observer replaced by ATen's fake quantize."""
    import copy

    from _quantplug.algorithms.sequential import IncrementalOutputs, QuantizedSimulation
    from _quantplug.algorithms.taps import is_tap
    from _quantplug.meta import observer_gid

    simulation, batches, targets = _simulation_setup()
    prepared = simulation({}).module
    g = torch.Generator().manual_seed(seed)
    activation: dict[int, Any] = {}
    quantizers: dict[str, nn.Module] = {}
    for n in prepared.graph.nodes:
        gid = observer_gid(n.target) if n.op == "call_module" else None
        if gid is None or (isinstance(n.args[0], Node) and n.args[0].op == "get_attr"):
            continue  # a constant's parked observer: the simulation reads the weight as it is
        qmin, qmax = GRIDS[int(torch.randint(len(GRIDS), (1,), generator=g))]
        scale = float(torch.rand(1, generator=g) * 0.05 + 1e-3)
        zero_point = int(torch.randint(qmin, qmax + 1, (1,), generator=g)) if qmin == 0 else 0
        spec = SimpleNamespace(
            dtype=torch.int32, quant_min=qmin, quant_max=qmax, qscheme=torch.per_tensor_affine
        )
        activation[gid] = (spec, (torch.tensor([scale]), torch.tensor([zero_point])))
        quantizers[str(n.target)] = AtenFakeQuantize(scale, zero_point, qmin, qmax)
    params = dict(prepared.named_parameters())
    variants = {
        t: [params[t] + 0.1 * torch.randn(params[t].shape, generator=g) for _ in range(2)] for t in targets
    }
    incremental = IncrementalOutputs(QuantizedSimulation(prepared, activation, {}, {}, is_tap), batches)
    for selection in selections:
        weights = {t: variants[t][v - 1] for t, v in zip(targets, selection) if v}
        plain = copy.deepcopy(prepared)
        for n in plain.graph.nodes:
            if n.op == "call_module" and is_tap(n):
                plain.add_submodule(str(n.target), Nothing())
        for target, module in quantizers.items():
            plain.add_submodule(target, module)
        for target, value in weights.items():
            owner, _, name = target.rpartition(".")
            setattr(plain.get_submodule(owner), name, nn.Parameter(value, requires_grad=False))
        with torch.no_grad():
            expected = [Interpreter(plain).run(*batch) for batch in batches]
        got = incremental(weights)
        assert all(torch.equal(a, b) and torch.equal(a.signbit(), b.signbit()) for a, b in zip(got, expected))


class WritesInPlace(nn.Module):
    """A tensor the program makes, written in place after a weight is read (Swin's masks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffer = torch.zeros(x.shape[0], 8)
        h = self.a(x)
        buffer[:, :4] = 1.0
        return self.b(h + buffer)


def test_the_guard_runs_programs_that_write_in_place_whole() -> None:
    """A value written in place after a checkpoint would reach the trials resumed from it: such a
    program is run whole for every selection, with the outputs of a fresh run."""
    from _quantplug.algorithms.sequential import IncrementalOutputs, QuantizedSimulation
    from _quantplug.algorithms.taps import is_tap

    batches = [(torch.randn(3, 8, generator=torch.Generator().manual_seed(i)),) for i in range(2)]
    prepared = quantplug.prepare(
        torch.export.export(WritesInPlace().eval(), batches[0]), quantplug.get_quantizer("reference")
    )
    sim = QuantizedSimulation(prepared, {}, {}, {}, is_tap)
    incremental = IncrementalOutputs(sim, batches)
    assert not incremental.points
    params = dict(prepared.named_parameters())
    for weights in ({}, {"b.weight": params["b.weight"] * 2}, {"a.weight": params["a.weight"] * 3}):
        fresh = QuantizedSimulation(prepared, {}, weights, {}, is_tap)
        assert all(torch.equal(a, fresh.outputs(b)) for a, b in zip(incremental(weights), batches))


def _with_loss(algorithms: list[Any], loss: Any, preset: str = "weight_only_int4") -> tuple[Any, Any]:
    """:func:`convert` with ``Algorithms(..., guard_loss=loss)``, judged on the calibration batches."""
    x = data()
    ep = torch.export.export(Mlp().eval(), (x[:BATCH],))
    quantizer = quantplug.get_quantizer("reference", preset=preset)
    config = quantplug.Algorithms(algorithms, held_out="calibration", guard_loss=loss)
    prepared = quantplug.prepare(ep, quantizer, algorithms=config)
    for i in range(0, len(x), BATCH):
        prepared(x[i : i + BATCH])
    return quantplug.convert(prepared), prepared


def test_the_guard_minimises_the_task_loss_it_is_given(caplog: pytest.LogCaptureFixture) -> None:
    """GPTQ brings every layer of the MLP closer to float, so the output-error guard keeps it all;
    a task whose loss is the distance to the round-to-nearest program (every other program loses)
    gets that program back, bit for bit, and the log names what each choice cost in loss."""
    x = data()
    default, _ = convert([], preset="weight_only_int4")
    gptq, gptq_prepared = convert(["gptq"], preset="weight_only_int4")
    assert gptq_prepared.meta[RUN_KEY].guarded.kept_out == []
    assert not torch.equal(outputs(gptq, x), outputs(default, x))
    seen: list[tuple[int, int]] = []

    def like_the_default(outs: list[torch.Tensor], inputs: tuple[Any, ...]) -> float:
        seen.append((len(outs), len(inputs)))
        with torch.no_grad():
            target = default(*inputs).to(torch.float64)
        return float((outs[0] - target).square().sum())

    with caplog.at_level(logging.INFO, logger="quantplug.algorithms"):
        guarded, prepared = _with_loss(["gptq"], like_the_default)
    assert torch.equal(outputs(guarded, x), outputs(default, x))
    verdicts = prepared.meta[RUN_KEY].guarded
    assert sorted(label for label, _, _ in verdicts.kept_out) == ["fc1.weight", "fc2.weight", "fc3.weight"]
    assert set(seen) == {(1, 1)}  # one output tensor, one flat input per batch
    assert "raised the task loss" in caplog.text and "fc2.weight (loss +" in caplog.text
    # a loss that is the squared distance to float again keeps what the output-error guard keeps
    reference = Mlp().eval()

    def like_float(outs: list[torch.Tensor], inputs: tuple[Any, ...]) -> float:
        with torch.no_grad():
            return float((outs[0] - reference(*inputs).to(torch.float64)).square().sum())

    kept, _ = _with_loss(["gptq"], like_float)
    assert torch.equal(outputs(kept, x), outputs(gptq, x))


@pytest.mark.parametrize(
    ("loss", "error"),
    [
        (lambda outs, inputs: -1.0, "must not be negative"),
        (lambda outs, inputs: outs[0], "must return one number"),
        (lambda outs, inputs: "low", "must return one number"),
    ],
    ids=["negative", "a tensor of many", "a string"],
)
def test_a_guard_loss_that_is_not_a_loss_is_named(loss: Any, error: str) -> None:
    with pytest.raises(quantplug.AlgorithmError, match=rf"guard_loss=\.\.\.\) returned .*{error}"):
        _with_loss(["gptq"], loss)


def test_a_guard_loss_is_checked_when_configured() -> None:
    with pytest.raises(quantplug.OptionError, match="guard_loss must be a function"):
        quantplug.Algorithms(["gptq"], guard_loss=3)  # type: ignore[arg-type]
    with pytest.raises(quantplug.OptionError, match="guard=False turns the guard off"):
        quantplug.Algorithms(["gptq"], guard=False, guard_loss=lambda outs, inputs: 0.0)
    assert "guard_loss=<lambda>" in repr(quantplug.Algorithms(["gptq"], guard_loss=lambda o, i: 0.0))
