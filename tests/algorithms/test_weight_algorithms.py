"""AdaRound, SeqMSE and GPTQ through the algorithm protocol, on real exported models and backends.

Each must improve what it claims (the model's SQNR against float, at 4-bit weights) and never
leave the backend's grid: LPBQ weights stay per-block on LPBQ's scale lattice, codes stay in
range, a shared encoding stays shared, weights they cannot handle keep the default.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import quantplug
from _quantplug.algorithms import weight_layers
from _quantplug.algorithms.adaround import AdaRound
from _quantplug.algorithms.gptq import GPTQ
from _quantplug.algorithms.seq_mse import SeqMSE
from _quantplug.algorithms.spec import WeightGrid, WeightSite
from _quantplug.algorithms.weight_layers import (
    CONVERT_COPIES,
    HESSIAN_MEMORY_SHARE,
    MAX_HESSIAN_INPUTS,
    LayerHessian,
    conv_patches,
    hessian_memory_problem,
    share_hessians,
)
from _quantplug.errors import AlgorithmError, OptionError
from _quantplug.meta import ALGORITHMS_KEY as RUN_KEY

BATCH = 16


def heavy_tailed(shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    """Student-t(3) weights: like trained weights, a few large ones set min-max's range."""
    chi2 = (torch.randn((3, *shape), generator=g) ** 2).mean(0)
    return 0.1 * torch.randn(shape, generator=g) / chi2.sqrt()


class Block(nn.Module):
    """linear -> gelu -> linear -> conv1d: the layer kinds the algorithms handle."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        with torch.no_grad():
            for layer in (self.fc1, self.fc2, self.conv):
                layer.weight.copy_(heavy_tailed(layer.weight.shape, g))
                layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(F.gelu(self.fc1(x)))
        return self.conv(y.reshape(y.shape[0], 4, 8))


def block_model() -> tuple[nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    model = Block(g).eval()
    mix = torch.randn(32, 32, generator=g) * 0.5 + torch.eye(32)  # correlated inputs
    return model, torch.randn(8 * BATCH, 32, generator=g) @ mix


def quantize(
    model: nn.Module,
    x: torch.Tensor,
    algorithms: list[Any],
    backend: str,
    guard: bool = True,
    held_out: str | None = None,
    **options: Any,
) -> Any:
    ep = torch.export.export(model, (x[:BATCH],))
    quantizer = quantplug.get_quantizer(backend, **options)
    config = quantplug.Algorithms(algorithms, guard=guard, held_out=held_out)
    prepared = quantplug.prepare(ep, quantizer, algorithms=config)
    for i in range(0, len(x), BATCH):
        prepared(x[i : i + BATCH])
    return quantplug.convert(prepared)


def sqnr(model: nn.Module, quantized: Any, x: torch.Tensor) -> float:
    with torch.no_grad():
        ref = torch.cat([model(x[i : i + BATCH]) for i in range(0, len(x), BATCH)])
        out = torch.cat([quantized(x[i : i + BATCH]) for i in range(0, len(x), BATCH)])
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


FOUR_BIT = [
    pytest.param("reference", {"preset": "weight_only_int4", "group_size": 16}, id="reference-int4-group16"),
    pytest.param("qnn_htp", {"precision": "16a4w"}, id="qnn-16a4w"),
    pytest.param("qnn_htp", {"precision": "16a4w_block", "block_size": 16}, id="qnn-16a4w-lpbq"),
]
ALGORITHMS = [
    pytest.param("seq_mse", id="seq_mse"),
    pytest.param(("adaround", {"iterations": 100}), id="adaround"),
    pytest.param("gptq", id="gptq"),
]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(("backend", "options"), FOUR_BIT)
def test_each_improves_the_model_at_4_bit_weights(
    algorithm: Any, backend: str, options: dict[str, Any]
) -> None:
    model, x = block_model()
    default = sqnr(model, quantize(model, x, [], backend, **options), x)
    improved = sqnr(model, quantize(model, x, [algorithm], backend, **options), x)
    assert improved > default + 0.1, (default, improved)


def test_seq_mse_then_gptq_keeps_up_with_each_alone() -> None:
    model, x = block_model()
    # every batch for the algorithms, the figure measured on them too (the held-out split's own
    # tests are in test_held_out_split)
    options = {"preset": "weight_only_int4", "group_size": 16, "held_out": "calibration"}
    alone = {a: sqnr(model, quantize(model, x, [a], "reference", **options), x) for a in ("seq_mse", "gptq")}
    both = sqnr(model, quantize(model, x, ["seq_mse", "gptq"], "reference", **options), x)
    # since the preset's own observer searches each group's clipping (0.2.0), SeqMSE's clipping,
    # chosen for rounding to nearest, no longer adds to GPTQ here: measured 21.67 dB for both
    # against 21.78 for GPTQ alone (it was ahead before); the combination must stay level with it
    assert both > alone["seq_mse"] and both >= max(alone.values()) - 0.25, (alone, both)


def _weight_qparams(quantized: Any) -> list[Any]:
    return [
        qp for qp in quantized.meta["quantplug_qparams"].values() if qp.granularity in ("block", "channel")
    ]


@pytest.mark.parametrize(
    "algorithm", ["seq_mse", "gptq", ("gptq", {"scale_search": 10}), ("adaround", {"iterations": 20})]
)
def test_lpbq_weights_stay_per_block_on_the_lpbq_scale_lattice(algorithm: Any) -> None:
    from quantplug_qnn_htp.observers import LPBQ_SCALE_STEPS

    model, x = block_model()
    options = {"precision": "16a4w_block", "block_size": 16}
    default = _weight_qparams(quantize(model, x, [], "qnn_htp", **options))
    chosen_program = quantize(model, x, [algorithm], "qnn_htp", **options)
    chosen = _weight_qparams(chosen_program)
    assert [(q.granularity, q.block_size, q.quant_min, q.quant_max) for q in chosen] == [
        (q.granularity, q.block_size, q.quant_min, q.quant_max) for q in default
    ]
    blocks = [q for q in chosen if q.granularity == "block"]
    assert blocks, "the model has LPBQ weights"
    for qp in blocks:
        flat = qp.scale.reshape(qp.scale.shape[0], -1).double()
        per_channel = flat.amax(dim=1, keepdim=True) / LPBQ_SCALE_STEPS
        steps = flat / per_channel
        torch.testing.assert_close(steps, steps.round(), atol=1e-4, rtol=0)  # integer multiples
        assert steps.round().min() >= 1 and steps.round().max() <= LPBQ_SCALE_STEPS
        assert bool((qp.zero_point == 0).all())  # symmetric stays symmetric
    for name, tensor in chosen_program.named_buffers():
        if name.endswith("weight_q"):
            assert tensor.dtype == torch.int8 and tensor.min() >= -7 and tensor.max() <= 7, name


def test_seq_mse_changes_scales_and_gptq_adaround_only_codes() -> None:
    """What each algorithm may change (without the guard, which may keep a layer's default)."""
    model, x = block_model()
    scales = {}
    for algorithm in ([], ["seq_mse"], ["gptq"], [("adaround", {"iterations": 20})]):
        qps = _weight_qparams(quantize(model, x, algorithm, "qnn_htp", guard=False, precision="16a4w"))
        scales[str(algorithm)] = [qp.scale for qp in qps]
    base = scales["[]"]
    assert any(not torch.equal(a, b) for a, b in zip(scales["['seq_mse']"], base))
    for key in ("['gptq']", "[('adaround', {'iterations': 20})]"):
        assert all(torch.equal(a, b) for a, b in zip(scales[key], base)), key


@pytest.mark.parametrize(("backend", "options"), FOUR_BIT)
def test_gptq_scale_search_beats_gptq_on_the_backends_encoding(backend: str, options: dict[str, Any]) -> None:
    """Each channel's range chosen by the error GPTQ leaves, on the backend's own grid: the
    calibration data's output error falls below plain GPTQ's, with other scales."""
    model, x = block_model()
    plain = quantize(model, x, ["gptq"], backend, guard=False, **options)
    searched = quantize(model, x, [("gptq", {"scale_search": 20})], backend, guard=False, **options)
    assert sqnr(model, searched, x) > sqnr(model, plain, x) + 0.1
    assert any(
        not torch.equal(a.scale, b.scale) for a, b in zip(_weight_qparams(searched), _weight_qparams(plain))
    )


def test_gptq_scale_search_leaves_layers_with_fewer_rows_than_inputs_alone() -> None:
    """A singular H knows nothing of the directions its rows leave out: no scale is chosen on it
    (the linears see 24 rows for 32 and 64 inputs), while the conv (12 inputs, 192 rows) is searched."""
    model, x = block_model()
    few = x[:24]
    options = {"precision": "16a4w", "per_channel_linear": True}

    def scales(algorithm: Any) -> list[torch.Tensor]:
        ep = torch.export.export(model, (few,))
        prepared = quantplug.prepare(
            ep,
            quantplug.get_quantizer("qnn_htp", **options),
            algorithms=quantplug.Algorithms([algorithm], guard=False),
        )
        prepared(few)
        return [qp.scale for qp in _weight_qparams(quantplug.convert(prepared))]

    plain, searched = scales("gptq"), scales(("gptq", {"scale_search": 20}))
    changed = [not torch.equal(a, b) for a, b in zip(searched, plain)]
    # per-channel weights and their derived bias encodings: fc1's, fc2's, the conv's
    assert changed == [False, False, False, False, True, True], changed


def test_gptq_scale_search_reads_the_row_counts_of_the_program_it_converts() -> None:
    """One GPTQ instance preparing two programs: converting the first (too few rows to search its
    linears) does not take the second's row counts (enough rows) for its own."""
    model, x = block_model()
    few, many = x[:24], x
    options = {"precision": "16a4w", "per_channel_linear": True}
    algorithm = GPTQ(scale_search=20)
    ep = torch.export.export(model, (x[:BATCH],), dynamic_shapes=({0: torch.export.Dim.AUTO},))

    def prepared() -> Any:
        quantizer = quantplug.get_quantizer("qnn_htp", **options)
        return quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms([algorithm], guard=False))

    first, second = prepared(), prepared()
    first(few)
    second(many)
    plain = quantplug.prepare(
        ep,
        quantplug.get_quantizer("qnn_htp", **options),
        algorithms=quantplug.Algorithms(["gptq"], guard=False),
    )
    plain(few)
    searched = [qp.scale for qp in _weight_qparams(quantplug.convert(first))]
    expected = [qp.scale for qp in _weight_qparams(quantplug.convert(plain))]
    assert [torch.equal(a, b) for a, b in zip(searched, expected)][:4] == [True] * 4  # fc1, fc2 kept


def test_gptq_options_are_checked() -> None:
    with pytest.raises(OptionError, match="scale_search"):
        GPTQ(scale_search=-1)
    with pytest.raises(OptionError, match="max_fraction"):
        GPTQ(max_fraction=0.5)
    with pytest.raises(OptionError, match=r"shrinkage.*'singular'"):
        GPTQ(shrinkage="ledoit")


class OutlierHead(nn.Module):
    """A residual MLP and a head on inputs with outlier channels (LLM activations' pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64, bias=False)
        self.down = nn.Linear(64, 32, bias=False)
        self.head = nn.Linear(32, 48, bias=False)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in (self.up, self.down, self.head):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.down(F.relu(self.up(x))))


def test_seq_mse_wider_ranges_beat_aimets_candidates_on_outlier_inputs() -> None:
    """Where a few input channels carry the output, the default search (steps of 0.01 up to 1.5x
    the range) beats AIMET's 20 clipping fractions, with scales wider than min-max's that the
    backend accepts (per-channel 4-bit, AIMET's grid options)."""
    g = torch.Generator().manual_seed(1)
    spread = torch.ones(32)
    spread[[3, 17]] = 20.0
    model, x = OutlierHead().eval(), torch.randn(8 * BATCH, 32, generator=g) * spread
    options = {"precision": "16a4w", "per_channel_linear": True, "act_observer": "minmax"}
    default = quantize(model, x, [], "qnn_htp", **options)
    aimet = quantize(model, x, [("seq_mse", {"candidates": 20, "max_fraction": 1})], "qnn_htp", **options)
    ours = quantize(model, x, ["seq_mse"], "qnn_htp", **options)
    held_out = torch.randn(4 * BATCH, 32, generator=g) * spread
    assert sqnr(model, ours, held_out) > sqnr(model, aimet, held_out) + 0.3
    wider = [
        bool((a.scale > b.scale * 1.001).any())
        for a, b in zip(_weight_qparams(ours), _weight_qparams(default))
    ]
    assert any(wider)


def test_adaround_out_of_time_rounds_to_nearest() -> None:
    model, x = block_model()
    options = {"precision": "16a4w"}
    default = quantize(model, x, [], "qnn_htp", **options)
    hurried = quantize(model, x, [AdaRound(time_budget=1e-9)], "qnn_htp", **options)
    with torch.no_grad():
        torch.testing.assert_close(hurried(x[:BATCH]), default(x[:BATCH]), rtol=0, atol=0)


def test_adaround_budget_is_shared_by_the_layers_of_each_convert() -> None:
    algorithm = AdaRound(time_budget=30.0)
    sites = [
        WeightSite(f"w{i}", "linear", "aten.linear.default", torch.ones(2, 2), None, i) for i in range(3)
    ]
    for site in sites:  # layer_kind needs a layer: give each one
        object.__setattr__(site, "_call", lambda x, w: F.linear(x, w))
        assert algorithm.collector(site) is not None
    for _ in range(2):  # a second convert starts a fresh budget
        shares = [algorithm._layer_budget(site) for site in sites]
        assert shares[0] is not None and 9.0 < shares[0] <= 10.0  # 30 s over 3 layers
        assert shares[2] is not None and shares[2] > 25.0  # the last layer gets what is left


def test_convert_twice_gives_the_same_program() -> None:
    model, x = block_model()
    ep = torch.export.export(model, (x[:BATCH],))
    prepared = quantplug.prepare(
        ep, quantplug.get_quantizer("qnn_htp", precision="16a4w"), algorithms=["gptq"]
    )
    for i in range(0, len(x), BATCH):
        prepared(x[i : i + BATCH])
    first, second = quantplug.convert(prepared), quantplug.convert(prepared)
    with torch.no_grad():
        assert torch.equal(first(x[:BATCH]), second(x[:BATCH]))


def test_seq_mse_without_layer_inputs_minimises_the_weights_own_error() -> None:
    g = torch.Generator().manual_seed(0)
    model = nn.Embedding(50, 32).eval()  # an embedding's weight feeds no layer quantplug can re-run
    with torch.no_grad():
        model.weight.copy_(heavy_tailed(model.weight.shape, g))
    x = torch.randint(0, 50, (4 * BATCH, 7), generator=g)
    options = {"preset": "weight_only_int4"}
    default = sqnr(model, quantize(model, x, [], "reference", **options), x)
    improved = sqnr(model, quantize(model, x, ["seq_mse"], "reference", **options), x)
    assert improved > default + 0.3, (default, improved)
    for kept in (("seq_mse", {"data_free": False}), "gptq", "adaround"):  # no data: the default
        assert sqnr(model, quantize(model, x, [kept], "reference", **options), x) == default


class GroupedConvs(nn.Module):
    """depthwise -> relu -> grouped (2 outputs per group): MobileNet's and RegNet's convolutions,
    heavy-tailed weights; nothing else for an algorithm to choose."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.grouped = nn.Conv2d(8, 16, 3, padding=1, groups=4)
        with torch.no_grad():
            for layer in (self.depthwise, self.grouped):  # biases too: from g, not the global RNG,
                layer.weight.copy_(heavy_tailed(layer.weight.shape, g) * 4)  # whose state depends
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=g) * 0.1)  # on what ran before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.grouped(torch.relu(self.depthwise(x)))  # type: ignore[no-any-return]


def test_grouped_convolutions_are_chosen_group_by_group() -> None:
    """Each group of a grouped convolution has its own ``H`` (once: none, and they kept the
    default): SeqMSE gives them new scales, GPTQ new codes, and the model gains."""
    g = torch.Generator().manual_seed(0)
    model = GroupedConvs(g).eval()
    x = torch.randn(4 * BATCH, 8, 6, 6, generator=g)
    options = {"precision": "16a4w"}
    default_model = quantize(model, x, [], "qnn_htp", **options)
    default = _weight_qparams(default_model)
    unguarded = quantize(model, x, [("seq_mse", {"data_free": False})], "qnn_htp", guard=False, **options)
    seq_mse = _weight_qparams(unguarded)  # both weights' scales, and their biases' derived from them
    assert len(seq_mse) == len(default) == 4
    for chosen, rounded in zip(seq_mse, default):
        assert not torch.equal(chosen.scale, rounded.scale)
    base = sqnr(model, default_model, x)
    for algorithm in ("gptq", ("seq_mse", {"data_free": False}), ("adaround", {"iterations": 200})):
        gained = sqnr(model, quantize(model, x, [algorithm], "qnn_htp", **options), x)
        assert gained > base + 0.1, (algorithm, base, gained)


def test_a_layer_too_wide_for_its_hessian_keeps_its_codes_and_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A layer over MAX_HESSIAN_INPUTS inputs would need an [I, I] float64 H for every batch (VGG's
    25088-input classifier: 5 GiB a copy, a 24 GB machine out of memory): no Hessian algorithm
    collects it, each says so naming it, and the narrow layer beside it is still chosen."""
    wide = MAX_HESSIAN_INPUTS + 1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(wide, 2), nn.Linear(2, 8)).eval()
    x = torch.randn(2 * BATCH, wide)
    options = {"preset": "weight_only_int4", "group_size": 0}
    default = quantize(model, x, [], "reference", **options).state_dict()
    algorithms = [("seq_mse", {"data_free": False}), ("adaround", {"iterations": 20}), "gptq"]
    with caplog.at_level(logging.WARNING, logger="quantplug.algorithms"):
        chosen = quantize(model, x, algorithms, "reference", guard=False, **options).state_dict()
    named = [r.getMessage() for r in caplog.records if "beyond the 16384-input limit" in r.getMessage()]
    assert [m.split(":")[0] for m in named] == ["seq_mse", "adaround", "gptq"]
    assert all(f"0.weight has {wide} inputs per output" in m for m in named)
    for wide_layer in ("0_weight_q0", "g0_scale0"):  # the wide layer: nearest codes on its encoding
        assert torch.equal(chosen[wide_layer], default[wide_layer])
    assert not torch.equal(chosen["1_weight_q0"], default["1_weight_q0"])  # the narrow one: chosen


@given(
    st.lists(st.tuples(st.integers(1, 20000), st.integers(1, 8)), max_size=12),
    st.one_of(st.none(), st.integers(0, 2**40)),
)
def test_hessian_memory_is_a_problem_exactly_past_its_share(
    columns: list[tuple[int, int]], memory: int | None
) -> None:
    """A stack (a mixture-of-experts weight's, one ``H`` per expert) counts each of its ``H``."""
    held = [("gptq" if i % 2 else "seq_mse", f"layer{i}.weight", c, k) for i, (c, k) in enumerate(columns)]
    problem = hessian_memory_problem(held, memory)
    sizes = [k * c * c * 8 for c, k in columns]
    peak = sum(sizes) + CONVERT_COPIES * max(sizes, default=0)
    assert (problem is not None) == (memory is not None and peak > HESSIAN_MEMORY_SHARE * memory)
    if problem is not None:
        largest = held[sizes.index(max(sizes))]
        assert f"{largest[1]} ({largest[2]} inputs" in problem and "sequential=true" in problem


def test_hessians_that_may_not_fit_are_warned_of_before_calibration(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Hessian fed during calibration is allocated at its first batch and held to convert, so
    a model of many layers each under the width limit can still need more than the machine has
    (a 7B Llama: 41 GiB); the kernel would kill the process with no word. Prepare
    warns first, naming the total, the count and the widest layers; sums two algorithms share
    count once, and sequential algorithms (one stage's Hessians at a time, at convert) not at
    all. A smaller machine warns and nothing else: the quantized model is the same bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    x = torch.randn(4 * BATCH, 64)
    options = {"preset": "weight_only_int4", "group_size": 0}
    ep = torch.export.export(model, (x[:BATCH],))
    quantizer = quantplug.get_quantizer("reference", **options)
    sums = (64 * 64 + 32 * 32) * 8  # both layers' H, float64: one set for both algorithms
    peak = sums + CONVERT_COPIES * 64 * 64 * 8  # and convert's copies of the widest

    def warnings_at(memory: int, algorithms: list[Any]) -> tuple[list[str], dict[str, torch.Tensor]]:
        caplog.clear()
        monkeypatch.setattr(weight_layers, "physical_memory", lambda: memory)
        with caplog.at_level(logging.WARNING, logger="quantplug.algorithms"):
            prepared = quantplug.prepare(ep, quantizer, algorithms=algorithms)
            said = [r.getMessage() for r in caplog.records if "layer Hessians" in r.getMessage()]
        for i in range(0, len(x), BATCH):  # said before the first batch
            prepared(x[i : i + BATCH])
        return said, quantplug.convert(prepared).state_dict()

    both = ["seq_mse", "gptq"]
    (warning,), tight = warnings_at(sums, both)
    assert "(float64, inputs x inputs per layer: 2 for seq_mse)" in warning
    assert "the largest: seq_mse 0.weight (64 inputs" in warning and "sequential=true" in warning
    roomy_said, roomy = warnings_at(2 * peak, both)  # sums twice over, were each algorithm's its own
    assert roomy_said == []
    assert roomy.keys() == tight.keys() and all(torch.equal(roomy[k], tight[k]) for k in roomy)
    sequential = [(name, {"sequential": True}) for name in both]
    assert warnings_at(sums, sequential)[0] == []


class ThreeHeads(nn.Module):
    """Query, key and value reading one input (one Hessian between them), and a layer after."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.q(x) * self.k(x) + self.v(x)))


def test_collectors_of_the_same_rows_hold_one_hessian() -> None:
    """Three Hessian algorithms on q, k, v (one input) and on the layer after: two sets of sums,
    not twelve. Each collector still reads what it would have summed alone (the mean x x^T of its
    own input, bit for bit), and GPTQ keeps its own shrinkage on the shared sums."""
    torch.manual_seed(0)
    model = ThreeHeads().eval()
    x = torch.randn(4 * BATCH, 32)
    ep = torch.export.export(model, (x[:BATCH],))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4", group_size=0)
    algorithms = ["seq_mse", ("gptq", {"shrinkage": "all"}), ("adaround", {"iterations": 5})]
    prepared = quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms(algorithms, guard=False))
    for i in range(0, len(x), BATCH):
        prepared(x[i : i + BATCH])
    collectors = [c for by_alg in prepared.meta[RUN_KEY].collectors.values() for c in by_alg.values()]
    assert len(collectors) == 12
    assert len({id(c.sums) for c in collectors}) == 2 and sum(c.leads for c in collectors) == 2
    with torch.no_grad():
        hidden = torch.relu(model.q(x) * model.k(x) + model.v(x))
    for collector in collectors:
        alone = LayerHessian(collector.site, collector.shrinkage)
        for i in range(0, len(x), BATCH):
            alone.update((x if collector.columns == 32 else hidden)[i : i + BATCH])
        assert torch.equal(collector.result(), alone.result()), collector.site.label
    shrunk = [c for c in collectors if c.shrinkage == "all"]
    assert shrunk and all(not torch.equal(c.result(), c.hessian.mean()) for c in shrunk)
    quantplug.convert(prepared)  # and every algorithm chooses on them


def test_sequential_collectors_of_one_stage_hold_one_hessian() -> None:
    """With sequential inputs the Hessians are collected at convert, stage by stage: query, key
    and value (one stage, one input) read one set of sums there too, which is the model's input
    itself (weight-only: nothing quantized before them)."""
    torch.manual_seed(0)
    model = ThreeHeads().eval()
    x = torch.randn(4 * BATCH, 32)
    ep = torch.export.export(model, (x[:BATCH],))
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4", group_size=0)
    gptq = GPTQ(sequential=True)
    prepared = quantplug.prepare(ep, quantizer, algorithms=quantplug.Algorithms([gptq], guard=False))
    for i in range(0, len(x), BATCH):
        prepared(x[i : i + BATCH])
    quantplug.convert(prepared)
    q, k, v, out = (gptq._hessians[f"{name}.weight"] for name in ("q", "k", "v", "out"))
    assert q.sums is k.sums is v.sums and [q.leads, k.leads, v.leads] == [True, False, False]
    assert out.sums is not q.sums and out.leads and out.rows == q.rows == len(x)
    torch.testing.assert_close(k.result(), x.double().T @ x.double() / len(x), rtol=1e-12, atol=0)


def test_a_hessian_follows_only_a_leader_of_the_same_rows() -> None:
    linear = _linear_site(nn.Linear(5, 3))
    a, b, c = LayerHessian(linear), LayerHessian(linear, "all"), LayerHessian(linear)
    wider = LayerHessian(_linear_site(nn.Linear(6, 3)))
    assert share_hessians([("x", a), ("x", b), ("y", wider)]) == [a, wider]
    b.update(torch.ones(2, 5))  # a follower is not fed: its leader is
    assert a.result() is None and b.result() is None
    a.update(torch.randn(4, 5))
    assert b.rows == 4 and torch.equal(b.hessian.mean(), a.result())
    for leader in (wider, b, c):  # another width; a follower; itself
        with pytest.raises(AlgorithmError, match="cannot read that of"):
            c.follow(leader if leader is not c else c)


def _linear_site(linear: nn.Linear) -> WeightSite:
    return WeightSite(
        "fc.weight", "fc", "aten.linear.default", linear.weight.detach(), None, 0,
        _call=lambda x, w: F.linear(x, w),
    )  # fmt: skip


def _conv_site(conv: nn.Conv2d) -> WeightSite:
    def call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, w, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)

    return WeightSite(
        "conv.weight", "conv2d", "aten.conv2d.default", conv.weight.detach(), None, 0, _call=call
    )


@pytest.mark.parametrize(("stride", "padding", "dilation"), [(1, 0, 1), (2, 1, 1), (1, 2, 2)])
def test_conv_patches_are_unfold_read_through_the_layer(stride: int, padding: int, dilation: int) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 2, 3, stride=stride, padding=padding, dilation=dilation)  # fewer outputs than columns
    x = torch.randn(2, 3, 9, 9)
    got = conv_patches(_conv_site(conv), x)
    unfolded = F.unfold(x, 3, dilation=dilation, padding=padding, stride=stride)  # [N, C*k*k, L]
    assert got is not None
    torch.testing.assert_close(got, unfolded.transpose(1, 2).reshape(-1, 27), atol=1e-5, rtol=1e-5)
    collector = LayerHessian(_conv_site(conv))
    collector.update(x)
    expected = got.double().T @ got.double() / got.shape[0]
    torch.testing.assert_close(collector.result(), expected)


@pytest.mark.parametrize(
    ("channels", "outputs", "groups"), [(6, 4, 2), (4, 4, 4), (4, 12, 4)]
)  # grouped, depthwise, depthwise with 3 outputs per channel
def test_grouped_conv_patches_are_each_groups_unfold(channels: int, outputs: int, groups: int) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(channels, outputs, 3, stride=2, padding=1, groups=groups)
    x = torch.randn(2, channels, 7, 7)
    got = conv_patches(_conv_site(conv), x)
    width = channels // groups * 9
    assert got is not None and got.shape == (groups, 2 * 16, width)
    for g, chunk in enumerate(x.split(channels // groups, dim=1)):
        unfolded = F.unfold(chunk, 3, padding=1, stride=2).transpose(1, 2).reshape(-1, width)
        torch.testing.assert_close(got[g], unfolded, atol=1e-5, rtol=1e-5)
    collector, unasked = LayerHessian(_conv_site(conv), grouped=True), LayerHessian(_conv_site(conv))
    collector.update(x)
    unasked.update(x)  # an algorithm written for [I, I] gets nothing for a grouped layer
    assert unasked.unsupported and unasked.result() is None
    result = collector.result()
    assert result is not None and result.shape == (groups, width, width)
    torch.testing.assert_close(result, got.double().transpose(1, 2) @ got.double() / got.shape[1])


@pytest.mark.parametrize("shrinkage", ["singular", "all", "off"])
def test_layer_hessian_shrinks_where_asked(shrinkage: str) -> None:
    """``"singular"`` shrinks while the rows are fewer than twice the 27 inputs (H singular, then
    nearly so) and stops once they are not; ``"all"`` always, ``"off"`` never. The diagonal is the
    rows' own either way."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 2, 3)
    collector = LayerHessian(_conv_site(conv), shrinkage)
    collector.update(torch.randn(1, 3, 7, 7))  # 25 output positions: 25 rows for 27 inputs
    for rows, singular in ((25, True), (50, True), (50 + 49, False)):
        assert collector.rows == rows
        assert collector.hessian is not None
        raw, got = collector.hessian.mean(), collector.result()
        assert got is not None
        shrunk = shrinkage == "all" or (shrinkage == "singular" and singular)
        assert collector.shrinks == shrunk
        assert torch.equal(got, raw) != shrunk
        torch.testing.assert_close(torch.diagonal(got), torch.diagonal(raw), rtol=0, atol=0)
        collector.update(torch.randn(1, 3, 7, 7) if rows == 25 else torch.randn(1, 3, 9, 9))  # 25, 49 more


def test_a_shared_encoding_stays_shared() -> None:
    weight = torch.randn(4, 8)
    site = WeightSite(
        "a.weight",
        "linear",
        "aten.linear.default",
        weight,
        None,
        0,
        shared_with=("b.weight",),
        _call=lambda x, w: F.linear(x, w),
    )
    scale = weight.abs().amax(dim=1) / 7
    grid = WeightGrid(
        -7, 7, torch.int8, torch.per_channel_symmetric, "channel", scale, torch.zeros(4), True, ch_axis=0
    )
    hessian = torch.eye(8, dtype=torch.float64)
    assert SeqMSE().choose_weight(site, grid, grid.quantize(weight), hessian) is None
    choice = GPTQ().choose_weight(site, grid, grid.quantize(weight), hessian)
    assert choice is not None and choice.scale is None and choice.codes is not None


def test_listed_from_metadata_as_entry_points() -> None:
    listed = {e.name: e for e in quantplug.list_algorithms()}
    for cls in (AdaRound, SeqMSE, GPTQ):  # the files' agreement with the classes: test_interface
        entry = listed[cls.name]
        assert entry.source == "entry-point" and entry.paper == cls.paper


def test_bad_options_are_typed_errors() -> None:
    with pytest.raises(OptionError, match="damp"):
        GPTQ(damp=-1.0)
    with pytest.raises(OptionError, match="candidates"):
        SeqMSE(candidates=0)
    with pytest.raises(OptionError, match="max_fraction"):
        SeqMSE(max_fraction=0.5)
    model, x = block_model()
    with pytest.raises(OptionError, match="iterations"):
        quantize(model, x, [("adaround", {"iterations": "many"})], "qnn_htp", precision="16a4w")


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize("algorithm", ["gptq", "adaround", "seq_mse"])
def test_layers_calibrated_on_fewer_rows_than_inputs_are_named_in_a_warning(
    algorithm: str, caplog: pytest.LogCaptureFixture
) -> None:
    """16 rows for 64 inputs: a singular ``H`` the choice overfits (ConvNeXt's classifier on the
    zoo's 16 images lost 4.4 dB held out with GPTQ); 128 rows: no warning."""
    g = torch.Generator().manual_seed(0)
    model = Head().eval()
    for rows, warned in ((16, True), (128, False)):
        caplog.clear()
        x = torch.randn(rows, 64, generator=g)
        with caplog.at_level("WARNING", logger="quantplug.algorithms"):
            quantize(model, x, [algorithm], "qnn_htp", soc_model="SM8650", precision="16a4w")
        messages = [r.getMessage() for r in caplog.records if r.name == "quantplug.algorithms"]
        if warned:
            assert len(messages) == 1
            assert messages[0].startswith(f"{algorithm}: 1 layer(s)")
            assert "fc.weight (16 rows, 64 inputs)" in messages[0]
            assert ("H is shrunk toward its diagonal" in messages[0]) == (algorithm == "gptq")
        else:
            assert messages == []


class ConvBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


def test_the_warning_names_a_folded_weight_as_the_user_wrote_it(caplog: pytest.LogCaptureFixture) -> None:
    """A conv whose batch norm was folded into it is ``conv.weight``, not the folded attribute."""
    model = ConvBn().eval()
    x = torch.randn(2 * BATCH, 16, 3, 3, generator=torch.Generator().manual_seed(0))  # one position each
    with caplog.at_level("WARNING", logger="quantplug.algorithms"):
        quantize(model, x, ["gptq"], "qnn_htp", soc_model="SM8650", precision="16a4w")
    (message,) = [r.getMessage() for r in caplog.records if r.name == "quantplug.algorithms"]
    assert "conv.weight (with its batch norm) (32 rows, 144 inputs)" in message
