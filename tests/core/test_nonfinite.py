"""NaN/inf calibration data (issue 12.1): every observer kind raises by default, naming the node,
or leaves the values out and counts them with ``nonfinite="ignore"``; infinities the model
computes itself (attention masks) are masks, not bad data; no NaN/inf scale ever reaches a
converted program or a written file; finite batches pay nothing for the check."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import quantplug
from _quantplug.errors import NonFiniteError
from _quantplug.observers import kernels
from _quantplug.observers.fake_quantize import FakeQuantize
from _quantplug.observers.histogram import HistogramObserver
from _quantplug.observers.minmax import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)
from _quantplug.observers.per_block import PerBlockMinMaxObserver

NAN, INF = float("nan"), float("inf")


def _batch(bad: float, shape: tuple[int, ...] = (4, 8), where: int = 5) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x.view(-1)[where] = bad
    return x


def _qnn_observers() -> dict[str, Callable[[], nn.Module]]:
    from quantplug_qnn_htp import observers as qnn

    return {
        "qnn_concat": qnn.ConcatMinMaxObserver,
        "qnn_latest": qnn.LatestMinMaxObserver,
        "qnn_latest_per_channel": lambda: qnn.LatestPerChannelMinMaxObserver(ch_axis=0),
        "qnn_lpbq": lambda: qnn.LpbqObserver(block_size=(1, 4), dtype=torch.int8, quant_min=-7, quant_max=7),
        "qnn_mask_aware": lambda: qnn.MaskAwareObserver(MinMaxObserver.with_args()),
    }


OBSERVERS: dict[str, Callable[[], nn.Module]] = {
    "minmax": MinMaxObserver,
    "moving_average": MovingAverageMinMaxObserver,
    "per_channel": lambda: PerChannelMinMaxObserver(ch_axis=0, dtype=torch.int8),
    "moving_average_per_channel": lambda: MovingAveragePerChannelMinMaxObserver(ch_axis=0, dtype=torch.int8),
    "per_block": lambda: PerBlockMinMaxObserver(block_size=(1, 4), dtype=torch.int8),
    "histogram": HistogramObserver,
    "fake_quantize": lambda: FakeQuantize(MinMaxObserver()),
    **_qnn_observers(),
}


def _torchao_observers() -> dict[str, Callable[[], nn.Module]]:
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    from _quantplug.peers.torchao_observers import accelerate

    return {
        "torchao_histogram": lambda: accelerate(ao.HistogramObserver()),
        "torchao_per_channel": lambda: accelerate(ao.PerChannelMinMaxObserver(ch_axis=0)),
    }


def _all_observers() -> dict[str, Callable[[], nn.Module]]:
    return {**OBSERVERS, **_torchao_observers()}


def _policy(obs: nn.Module, policy: str, where: str = "conv2d") -> nn.Module:
    from _quantplug.observers.nonfinite import configure

    configure(obs, policy, where)
    return obs


def _ignored(obs: nn.Module) -> int:
    return sum(int(vars(m).get("nonfinite_ignored", 0)) for m in obs.modules())


def _qparams_finite(obs: Any) -> bool:
    scale, zero_point = obs.calculate_qparams()
    return bool(torch.isfinite(torch.as_tensor(scale)).all()) and bool(
        torch.isfinite(torch.as_tensor(zero_point).float()).all()
    )


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", [*OBSERVERS, "torchao_histogram", "torchao_per_channel"])
def test_every_observer_raises_naming_the_node(kind: str, bad: float) -> None:
    if kind == "qnn_mask_aware" and math.isinf(bad):
        pytest.skip("the mask-aware observer is built for -inf/+inf masks (tested below)")
    obs = _policy(_all_observers()[kind](), "error", where="output of node 'conv2d'")
    obs(torch.randn(4, 8))
    with pytest.raises(NonFiniteError, match="reached the observer of output of node 'conv2d'") as info:
        obs(_batch(bad))
    assert info.value.where == "output of node 'conv2d'"
    assert (info.value.nan, info.value.inf) == ((1, 0) if math.isnan(bad) else (0, 1))


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", [*OBSERVERS, "torchao_histogram", "torchao_per_channel"])
def test_every_observer_can_ignore_and_count(kind: str, bad: float) -> None:
    factory = _all_observers()[kind]
    reference, obs = factory(), _policy(factory(), "ignore")
    clean = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    dirty = _batch(bad)
    for o in (reference, obs):
        o(clean)
    obs(dirty)
    if kind not in ("qnn_mask_aware",) or math.isnan(bad):
        assert _ignored(obs) == 1
    assert _qparams_finite(obs)
    # the finite part of the batch is recorded as if the bad element were absent
    finite_only = dirty.clone()
    finite_only.view(-1)[5] = dirty.view(-1)[4]
    reference(finite_only)
    if kind in ("minmax", "per_channel", "per_block", "qnn_concat", "qnn_lpbq", "torchao_per_channel"):
        for a, b in zip(obs.calculate_qparams(), reference.calculate_qparams()):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), kind


def test_mask_aware_observer_keeps_treating_infinities_as_masks() -> None:
    obs = _policy(_qnn_observers()["qnn_mask_aware"](), "error")
    obs(_batch(-INF))  # an attention mask: no error, a grid extended below the data
    assert bool(obs.saw_negative_mask)
    assert _qparams_finite(obs)


def test_a_batch_of_only_nan_leaves_the_observer_unseen_when_ignored() -> None:
    obs = _policy(MinMaxObserver(), "ignore")
    obs(torch.full((3,), NAN))
    assert not obs.observed and _ignored(obs) == 3


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["minmax", "moving_average", "histogram"])
def test_a_finite_batch_costs_no_finiteness_pass(kind: str) -> None:
    """The check is folded into the min/max the observer computes anyway: a finite batch runs no
    isfinite/isnan/where operation (with the native kernels, no pass over the data at all)."""
    obs = OBSERVERS[kind]()
    obs(torch.randn(64, 256))
    with _OpLog() as log:
        obs(torch.randn(64, 256) * 2)
    assert not {"isfinite", "isnan", "isinf", "where", "abs"} & set(log.ops), log.ops
    if kernels.enabled() and kind != "histogram":
        assert not {"aminmax", "amin", "amax", "min", "max"} & set(log.ops), log.ops


# ------------------------------------------------------------------------------------------------
# end to end: prepare, calibrate, convert, lower
# ------------------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


@pytest.fixture(scope="module")
def program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(Net().eval(), (torch.randn(1, 3, 8, 8),))


BACKENDS = [
    ("reference", {}),
    ("reference", {"activation_observer": "minmax"}),
    ("reference", {"activation_observer": "moving_average"}),
    ("qnn_htp", {}),
    ("qnn_htp", {"act_observer": "histogram"}),
]


@pytest.mark.parametrize(("backend", "options"), BACKENDS, ids=lambda v: str(v) if v else "default")
@pytest.mark.parametrize("bad", [NAN, INF], ids=["nan", "inf"])
def test_calibration_batch_with_nonfinite_values_is_rejected(
    program: torch.export.ExportedProgram, backend: str, options: dict[str, Any], bad: float
) -> None:
    prepared = quantplug.prepare(program, quantplug.get_quantizer(backend, **options))
    prepared(torch.randn(1, 3, 8, 8))
    with pytest.raises(NonFiniteError, match=r"input 'x' of node 'conv2d'|output of node 'x'"):
        prepared(_batch(bad, (1, 3, 8, 8)))


@pytest.mark.parametrize(("backend", "options"), BACKENDS, ids=lambda v: str(v) if v else "default")
def test_ignored_nonfinite_values_give_finite_encodings_and_strict_json(
    program: torch.export.ExportedProgram, backend: str, options: dict[str, Any], tmp_path: Any
) -> None:
    from _quantplug.observers.nonfinite import ignored_counts

    quantizer = quantplug.get_quantizer(backend, **options)
    prepared = quantplug.prepare(program, quantizer, nonfinite="ignore")
    for bad in (NAN, INF, -INF):
        prepared(_batch(bad, (1, 3, 8, 8)))
    prepared(torch.randn(1, 3, 8, 8))
    counts = ignored_counts(prepared)
    assert counts["input 'x' of node 'conv2d'"] == 3  # where they first appear
    assert len(counts) > 1  # and what they turned into further on
    quantized = quantplug.convert(prepared)
    for qp in quantized.meta["quantplug_qparams"].values():
        assert bool(torch.isfinite(qp.scale).all())
    written = quantplug.lower(quantized, quantizer).save(tmp_path)
    for path in written:
        if path.suffix in (".json", ".encodings"):
            json.loads(path.read_text(), parse_constant=_no_constant)  # no NaN/Infinity token


def _no_constant(token: str) -> Any:
    raise AssertionError(f"non-finite JSON token {token}")


@pytest.mark.parametrize("bad", [NAN, math.inf], ids=["nan", "inf"])
def test_nonfinite_weights_are_named_at_convert_whatever_the_policy(bad: float) -> None:
    """A NaN/inf weight is a broken model, not calibration data: ignoring it would store garbage.
    Convert names the parameter; it read as an observer input ("infinities in the model's inputs
    are bad calibration data"). Under the default policy a NaN shows first at the next
    activation's observer, during calibration."""
    model = Net().eval()
    with torch.no_grad():
        model.fc.weight[1, 2] = bad
    x = torch.randn(1, 3, 8, 8)
    ep = torch.export.export(model, (x,))
    if math.isnan(bad):
        with pytest.raises(NonFiniteError, match="output of node 'linear'"):
            quantplug.prepare(ep, quantplug.get_quantizer("reference"))(x)
    prepared = quantplug.prepare(ep, quantplug.get_quantizer("reference"), nonfinite="ignore")
    prepared(x)
    kind = "NaN" if math.isnan(bad) else "inf"
    named = rf"constant 'fc.weight' \(node 'fc_weight', .*\) holds 1 {kind} value\(s\).*fix the model"
    with pytest.raises(NonFiniteError, match=named) as raised:
        quantplug.convert(prepared)
    assert raised.value.where == "fc_weight" and raised.value.nan + raised.value.inf == 1


def test_a_weight_made_nan_after_prepare_is_named_at_convert() -> None:
    ep = torch.export.export(Net().eval(), (torch.randn(1, 3, 8, 8),))
    prepared = quantplug.prepare(ep, quantplug.get_quantizer("reference"), nonfinite="ignore")
    prepared(torch.randn(1, 3, 8, 8))
    with torch.no_grad():
        prepared.get_parameter("fc.weight")[0, 0] = NAN
    with pytest.raises(NonFiniteError, match=r"the model's constant 'fc.weight' .* holds 1 NaN"):
        quantplug.convert(prepared)


def test_convert_refuses_a_foreign_observer_that_records_nan(program: torch.export.ExportedProgram) -> None:
    """torchao's plain MinMaxObserver is not ours and not accelerated: its NaN range is caught at
    convert, before any file could hold it."""
    ao = pytest.importorskip("torchao.quantization.pt2e.observer")
    spec = quantplug.QuantizationSpec(
        dtype=torch.uint8, qscheme=torch.per_tensor_affine, observer_or_fake_quant_ctr=ao.MinMaxObserver
    )

    class OutputsOfConv:
        def annotate(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
            for node in gm.graph.nodes:
                if node.target == torch.ops.aten.conv2d.default:
                    quantplug.annotate_node(node, output_qspec=spec)
            return gm

        def validate(self, gm: torch.fx.GraphModule) -> None:
            return None

    prepared = quantplug.prepare(program, OutputsOfConv())
    prepared(_batch(NAN, (1, 3, 8, 8)))
    with pytest.raises(NonFiniteError, match="output of node 'conv2d' recorded a non-finite range"):
        quantplug.convert(prepared)


def test_artifact_save_refuses_non_finite_json(tmp_path: Any) -> None:
    from _quantplug.errors import LoweringError

    artifact = quantplug.Artifact("x", files={"model.encodings": '{"scale": NaN}'}, metadata={})
    with pytest.raises(LoweringError, match=r"model\.encodings.*NaN"):
        artifact.save(tmp_path)
    with pytest.raises(LoweringError, match=r"artifact\.json"):
        quantplug.Artifact("x", metadata={"scale": math.inf}).save(tmp_path / "b")
    assert not any(tmp_path.rglob("*.encodings"))


def test_unknown_policy_is_rejected(program: torch.export.ExportedProgram) -> None:
    with pytest.raises(quantplug.OptionError, match="nonfinite must be one of error, strict, ignore"):
        quantplug.prepare(program, quantplug.get_quantizer("reference"), nonfinite="skip")


class MaskedScores(nn.Module):
    """Causal attention probabilities, the scores masked with ``-inf`` (``masked_fill``): the
    model itself computes the infinities, from finite inputs. ``fill``: what the mask holds
    instead (transformers fills with ``torch.finfo(dtype).min``)."""

    def __init__(self, fill: float = float("-inf")) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.register_buffer("causal", torch.ones(6, 6).triu(1).bool())
        self.fill = fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(-1, -2)
        return torch.softmax(scores.masked_fill(self.causal, self.fill), dim=-1)


@pytest.fixture(scope="module")
def masked_program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(MaskedScores().eval(), (torch.randn(2, 6, 8),))


MASK_FILLS = {
    "-inf": float("-inf"),
    "finfo.min": float(torch.finfo(torch.float32).min),
    "-1e9": -1e9,
    "-1e4": -1e4,  # OpenAI GPT, BigBird, MarkupLM, TAPAS: a mask only on the way into a softmax
}


@pytest.mark.parametrize("fill", list(MASK_FILLS))
@pytest.mark.parametrize("observer", ["histogram", "minmax", "moving_average"])
def test_infinities_the_model_computes_are_masks_left_out_and_counted(observer: str, fill: str) -> None:
    from _quantplug.observers.nonfinite import ignored_counts, masked_counts

    torch.manual_seed(0)
    model = MaskedScores(MASK_FILLS[fill]).eval()
    masked_program = torch.export.export(model, (torch.randn(2, 6, 8),))
    quantizer = quantplug.get_quantizer("reference", activation_observer=observer)
    prepared = quantplug.prepare(masked_program, quantizer)
    for seed in range(3):
        prepared(torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(seed)))
    masked = masked_counts(prepared)
    assert masked == {"input 'masked_fill' of node 'softmax'": 3 * 2 * 15}  # 15 masked entries of 6x6
    assert ignored_counts(prepared) == {}
    quantized = quantplug.convert(prepared)
    for qp in quantized.meta["quantplug_qparams"].values():
        assert bool(torch.isfinite(qp.scale).all())
    with torch.no_grad():
        probs = quantized(torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1)))
    # a masked entry keeps (almost) no weight: the grid reaches 16 below the smallest real score,
    # where a grid ending at the real scores would give it the weight of the smallest one
    causal = torch.ones(6, 6).triu(1).bool().expand(2, 6, 6)
    assert float(probs[causal].max()) == 0.0
    assert torch.allclose(probs.sum(-1), torch.ones(2, 6), atol=0.05)
    # and the real scores keep their grid: a range reaching finfo.min rounded every one of them to
    # the same code, and each row became a plain average of the visible positions (error 0.5)
    with torch.no_grad():
        expected = model(torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1)))
    assert float((probs - expected).abs().max()) < 0.2


def test_huge_values_in_the_inputs_are_data_not_masks() -> None:
    """Only what the model computes can be a mask; calibration data is measured as it is."""
    from _quantplug.observers.nonfinite import masked_counts

    program = torch.export.export(nn.Sequential(nn.Linear(8, 8)).eval(), (torch.randn(2, 8),))
    prepared = quantplug.prepare(program, quantplug.get_quantizer("reference"))
    prepared(_batch(-1e9, (2, 8)))
    assert not [where for where in masked_counts(prepared) if "input" in where]
    quantized = quantplug.convert(prepared)
    scales = [float(qp.scale.max()) for qp in quantized.meta["quantplug_qparams"].values()]
    assert max(scales) > 1e9 / 256  # the input's grid spans -1e9


class ShiftedFeatures(nn.Module):
    """The same features go into a softmax, and, -1e4 subtracted where a mask says so, into a
    linear layer: on that way -1e4 is data, and the grid must reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("mask", (torch.arange(8) % 3 == 0).float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return torch.softmax(h, dim=-1), self.b(h - 1e4 * self.mask)


def test_minus_1e4_off_the_way_into_a_softmax_is_data() -> None:
    from _quantplug.observers.nonfinite import masked_counts

    model = ShiftedFeatures().eval()
    program = torch.export.export(model, (torch.randn(2, 8),))
    prepared = quantplug.prepare(program, quantplug.get_quantizer("reference"))
    prepared(torch.randn(4, 8))
    assert masked_counts(prepared) == {}
    quantized = quantplug.convert(prepared)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        (probs, out), (want_probs, want) = quantized(x), model(x)
    # the linear layer weighs the -1e4 entries: a grid clamping them 16 below the features would
    # move its output by thousands; the grid's step (~40 at 8 bits) moves it by tens
    assert float((out - want).abs().max()) < 0.02 * float(want.abs().max())
    assert float((probs - want_probs).abs().max()) < 0.05


def test_strict_policy_refuses_masks_too(masked_program: torch.export.ExportedProgram) -> None:
    prepared = quantplug.prepare(masked_program, quantplug.get_quantizer("reference"), nonfinite="strict")
    with pytest.raises(NonFiniteError, match=r"input 'masked_fill' of node 'softmax'.*strict"):
        prepared(torch.randn(2, 6, 8))


def test_infinities_in_the_inputs_are_bad_data_even_where_the_model_masks(
    masked_program: torch.export.ExportedProgram,
) -> None:
    prepared = quantplug.prepare(masked_program, quantplug.get_quantizer("reference"))
    with pytest.raises(NonFiniteError, match=r"input 'x' of node .*model's inputs"):
        prepared(_batch(-INF, (2, 6, 8)))


class LogSpaceStart(nn.Module):
    """RWKV's recurrence starts from a state of -1e38 (log-space zero): its first step's tensors
    hold nothing but that value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = torch.full_like(x, -1e38) - x
        return self.fc(x) + torch.exp(start)


@pytest.mark.parametrize("observer", ["histogram", "minmax", "moving_average"])
def test_a_tensor_of_nothing_but_masks_still_gets_a_grid(observer: str) -> None:
    from _quantplug.observers.nonfinite import masked_counts

    torch.manual_seed(0)
    model = LogSpaceStart().eval()
    program = torch.export.export(model, (torch.randn(2, 8),))
    quantizer = quantplug.get_quantizer("reference", activation_observer=observer)
    prepared = quantplug.prepare(program, quantizer)
    for seed in range(2):
        prepared(torch.randn(2, 8, generator=torch.Generator().manual_seed(seed)))
    assert any("sub" in where for where in masked_counts(prepared)), masked_counts(prepared)
    quantized = quantplug.convert(prepared)  # was: CalibrationError, the observer never saw data
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))  # within the calibrated range
    with torch.no_grad():
        torch.testing.assert_close(quantized(x), model(x), atol=0.05, rtol=0.05)
