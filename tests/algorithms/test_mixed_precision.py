"""Mixed precision: sensitivity from the numeric debugger, a greedy measured curve, editable overrides."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.errors import NonFiniteError, OptionError
from _quantplug.mixed_precision import MixedPrecision, search_mixed_precision

OPTIONS = {"soc_model": "SM8650"}


def _model() -> tuple[nn.Module, torch.Tensor, torch.export.ExportedProgram]:
    """Three linear layers; the middle one has an outlier input column that 4-bit weights cannot hold."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    with torch.no_grad():
        model[2].weight[:, 0] *= 10
    x = torch.randn(64, 32)
    return model, x, torch.export.export(model, (x[:16],))


def _batches(x: torch.Tensor) -> list[torch.Tensor]:
    return [x[i : i + 16] for i in range(0, len(x), 16)]


def test_floor_raises_the_sensitive_layer_first_and_meets_the_target_cheaper(tmp_path: Path) -> None:
    _, x, ep = _model()
    found = search_mixed_precision(
        ep, "qnn_htp", ["16a8w", "16a4w"], _batches(x), target_sqnr_db=15.0, options=OPTIONS
    )
    assert found.default == "16a4w"  # the cheaper preset is the base, whatever the order given
    sens = found.sensitivity
    assert max(sens, key=lambda m: sens[m]["16a8w"]) == "2"
    assert found.curve[1].choice["2"] == "16a8w"
    chosen = next(p for p in found.curve if dict(p.choice) == found.choice)
    assert chosen.sqnr_db >= 15.0
    assert chosen.weight_bytes < found.curve[0].weight_bytes * 2  # not everything at 8 bits
    assert found.overrides == {"2": "16a8w"}

    path = found.save(tmp_path)
    assert (tmp_path / "tradeoff.png").read_bytes()[:4] == b"\x89PNG"
    edited = MixedPrecision.load(path)
    assert edited.overrides == found.overrides
    # the file is what the user ships: applying it gives the measured point again
    prepared = quantplug.prepare(ep, edited.quantizer())
    for batch in _batches(x):
        prepared(batch)
    report = quantplug.debug.compare(ep, quantplug.convert(prepared), [(b,) for b in _batches(x)])
    assert report.output_sqnr_db == pytest.approx(chosen.sqnr_db, abs=1e-6)


def test_budget_picks_the_most_accurate_point_within_it() -> None:
    _, x, ep = _model()
    all_low = search_mixed_precision(
        ep, "qnn_htp", ["16a4w", "16a8w"], _batches(x), max_weight_bytes=1e9, options=OPTIONS
    )
    budget = all_low.curve[0].weight_bytes + 64 * 64 / 2  # room for one 64x64 layer going 4 -> 8 bits
    found = search_mixed_precision(
        ep, "qnn_htp", ["16a4w", "16a8w"], _batches(x), max_weight_bytes=budget, options=OPTIONS
    )
    assert all(p.weight_bytes <= budget for p in found.curve)
    assert found.overrides == {"2": "16a8w"}


def test_bad_requests_are_typed_errors() -> None:
    _, x, ep = _model()
    with pytest.raises(OptionError, match="exactly one target"):
        search_mixed_precision(ep, "qnn_htp", ["16a4w", "16a8w"], _batches(x), options=OPTIONS)
    with pytest.raises(OptionError, match="did you mean '16a8w'"):
        search_mixed_precision(
            ep, "qnn_htp", ["16a4w", "16a8x"], _batches(x), target_sqnr_db=20, options=OPTIONS
        )
    for target, message in [
        ({"target_sqnr_db": math.nan}, "target_sqnr_db must be a finite number of decibels, got nan"),
        ({"max_weight_bytes": math.nan}, "max_weight_bytes must be a number of bytes >= 0, got nan"),
        ({"max_weight_bytes": -1.0}, "max_weight_bytes must be a number of bytes >= 0, got -1.0"),
        ({"max_weight_growth": math.inf}, "max_weight_growth must be a fraction >= 0"),
    ]:
        with pytest.raises(OptionError, match=re.escape(message)):
            search_mixed_precision(ep, "qnn_htp", ["16a4w", "16a8w"], _batches(x), options=OPTIONS, **target)
    with pytest.raises(OptionError, match=r"options set precision='8a8w', which mixed precision chooses"):
        presets = ["16a4w", "16a8w"]
        bad = {**OPTIONS, "precision": "8a8w"}
        search_mixed_precision(ep, "qnn_htp", presets, _batches(x), target_sqnr_db=20.0, options=bad)


def test_a_nan_measure_is_an_error_not_a_choice() -> None:
    """On outputs holding NaN every SQNR is NaN and every comparison false: the search would
    return the cheapest model as if it met the floor, and save NaN (not JSON) in its curve."""
    _, x, ep = _model()
    nan = [(torch.full_like(x[:16], math.nan),)]
    with pytest.raises(
        NonFiniteError, match="output SQNR as NaN: the float program's outputs on the compare_inputs"
    ):
        search_mixed_precision(
            ep,
            "qnn_htp",
            ["16a4w", "16a8w"],
            _batches(x),
            target_sqnr_db=20,
            compare_inputs=nan,
            options=OPTIONS,
        )


def test_a_growth_budget_is_relative_to_the_cheapest_model() -> None:
    _, x, ep = _model()
    found = search_mixed_precision(
        ep, "qnn_htp", ["16a4w", "16a8w"], _batches(x), max_weight_growth=0.65, options=OPTIONS
    )
    cheapest = found.curve[0].weight_bytes  # 6656 weights at 4 bits
    assert found.target == {"weight_bytes": pytest.approx(cheapest * 1.65), "weight_growth": 0.65}
    assert all(p.weight_bytes <= cheapest * 1.65 for p in found.curve)
    assert found.overrides == {"2": "16a8w"}  # 64x64 weights at 8 bits: +62 %; nothing else fits
    with pytest.raises(OptionError, match="max_weight_growth must be a fraction >= 0"):
        search_mixed_precision(
            ep, "qnn_htp", ["16a4w", "16a8w"], _batches(x), max_weight_growth=-1, options=OPTIONS
        )


class KeywordNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8)

    def forward(self, *, features: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(features)))


def test_keyword_batches_are_calibrated_and_measured() -> None:
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    ep = torch.export.export(KeywordNet().eval(), (), {"features": x[:8]})
    found = search_mixed_precision(
        ep, "qnn_htp", ["16a4w", "16a8w"], [{"features": x[i : i + 8]} for i in range(0, 32, 8)],
        max_weight_growth=10.0, options=OPTIONS,
    )  # fmt: skip
    assert [p.sqnr_db for p in found.curve] == sorted(p.sqnr_db for p in found.curve)
    assert found.curve[-1].choice == {"a": "16a8w", "b": "16a8w"}
    assert found.curve[-1].sqnr_db > found.curve[0].sqnr_db + 1


def test_a_choice_naming_what_the_model_lacks_is_refused() -> None:
    _, _, ep = _model()
    good = MixedPrecision("qnn_htp", OPTIONS, "precision", "16a4w", {"0": "16a4w", "2": "16a8w"})
    good.check(ep)
    with pytest.raises(OptionError, match=r"'3'; its layers .*: 0, 2, 4$"):
        MixedPrecision("qnn_htp", OPTIONS, "precision", "16a4w", {"3": "16a8w"}).check(ep)
    with pytest.raises(OptionError, match=r"'16a8'.*did you mean '16a8w'"):
        MixedPrecision("qnn_htp", OPTIONS, "precision", "16a4w", {"2": "16a8"}).check(ep)


class _Tagger(nn.Module):
    """An LSTM (most of the weights) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def test_a_recurrent_module_is_one_layer_with_all_its_weight_matrices() -> None:
    """The LSTM counts with every weight_ih/weight_hh (not its biases) where the backend quantizes
    them, and raising it to 8 bits reaches its weights: 8-bit codes are in the program."""
    from _quantplug.mixed_precision import weighted_layers

    x = torch.randn(24, 10, 8, generator=torch.Generator().manual_seed(1))
    ep = torch.export.export(_Tagger().eval(), (x[:8],))
    layers = {layer.module: layer.weight_elements for layer in weighted_layers(ep)}
    assert layers == {"rnn": 4 * 16 * (8 + 16) + 4 * 16 * (16 + 16), "head": 16 * 4}
    presets = ["weight_only_int4", "weight_only_int8"]
    batches = [x[i : i + 8] for i in range(0, 24, 8)]
    found = search_mixed_precision(ep, "reference", presets, batches, max_weight_growth=1.0)
    assert found.sensitivity["rnn"]["weight_only_int8"] > found.curve[0].sqnr_db + 1  # measured raised
    assert found.choice["rnn"] == "weight_only_int8"
    converted = quantplug.convert(_calibrated(ep, found.quantizer(), batches))
    codes = {
        str(n.args[0].target): getattr(converted, str(n.args[0].target))
        for n in converted.graph.nodes
        if "dequantize_per" in str(n.target) and n.args[0].op == "get_attr"
    }
    assert int(codes["rnn_weight_hh_l1_q0"].abs().max()) > 8  # 8-bit codes, not 4-bit ones
    # qnn_htp unrolls the LSTM: its weights are the linears of every step, each counted once
    # (weight_hh is read at every step); with unroll_recurrent=False it stays float, shipped as
    # float32 weights, with nothing to choose there
    htp = search_mixed_precision(
        ep, "qnn_htp", ["16a4w", "16a8w"], batches, max_weight_growth=1.0, options=OPTIONS
    )
    assert set(htp.sensitivity) == {"head", "rnn"}
    all_weights = layers["rnn"] + layers["head"]
    assert [htp.curve[0].weight_bytes, htp.curve[-1].weight_bytes] == [all_weights / 2, all_weights]
    whole = search_mixed_precision(
        ep,
        "qnn_htp",
        ["16a4w", "16a8w"],
        batches,
        max_weight_growth=1.0,
        options={**OPTIONS, "unroll_recurrent": False},
    )
    assert set(whole.sensitivity) == {"head"}
    float_rnn = layers["rnn"] * 4
    assert [p.weight_bytes for p in whole.curve] == [float_rnn + 16 * 4 / 2, float_rnn + 16 * 4]


def _calibrated(ep: torch.export.ExportedProgram, quantizer: object, batches: list[torch.Tensor]) -> object:
    prepared = quantplug.prepare(ep, quantizer)
    for batch in batches:
        prepared(batch)
    return prepared
