"""The algorithms are one argument: ``prepare(..., algorithms=quantplug.Algorithms(...))``.

A plain list is ``Algorithms(list)``; the keywords ``Algorithms`` replaced (``calibration=``,
``algorithm_guard=``, ``held_out=`` of ``prepare``; ``algorithm_guard=``, ``held_out=`` of
``quantize``) keep working until 0.4.0, each with a ``DeprecationWarning`` naming the new spelling,
and give the very same program.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantplug

BATCH = 8


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def _data(seed: int, batches: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 16, generator=g),) for _ in range(batches)]


CALIBRATION = _data(1, 4)
HELD_OUT = _data(2, 2)
PROBE = _data(3, 1)[0]


def _output(algorithms: Any = None, **keywords: Any) -> torch.Tensor:
    """The converted MLP's output on a probe batch (reference weight-only int4)."""
    ep = torch.export.export(Mlp().eval(), CALIBRATION[0])
    quantizer = quantplug.get_quantizer("reference", preset="weight_only_int4")
    prepared = quantplug.prepare(ep, quantizer, algorithms=algorithms, **keywords)
    with torch.no_grad():
        for batch in CALIBRATION:
            prepared(*batch)
        return quantplug.convert(prepared)(*PROBE)  # type: ignore[no-any-return]


def _warns(function: str, keyword: str) -> Any:
    return pytest.warns(
        DeprecationWarning,
        match=rf"{function}\(\.\.\., {keyword}=\.\.\.\) is deprecated .* until quantplug 0\.4\.0; write "
        + re.escape(f"{function}(..., algorithms=quantplug.Algorithms([...], "),
    )


def test_a_list_is_the_algorithms_of_that_list() -> None:
    assert torch.equal(_output(["gptq"]), _output(quantplug.Algorithms(["gptq"])))
    assert quantplug.Algorithms("gptq").algorithms == ("gptq",)  # one name alone is a list of one


@pytest.mark.parametrize(
    ("keyword", "value", "field"),
    [
        ("calibration", CALIBRATION[:2], "calibration"),
        ("algorithm_guard", False, "guard"),
        ("held_out", HELD_OUT, "held_out"),
    ],
)
def test_prepares_old_keywords_warn_and_give_the_same_program(keyword: str, value: Any, field: str) -> None:
    algorithms = ["cle", "gptq"]  # CLE reads calibration batches; GPTQ's choices meet the guard
    with _warns("prepare", keyword):
        old = _output(algorithms, **{keyword: value})
    assert torch.equal(old, _output(quantplug.Algorithms(algorithms, **{field: value})))


@pytest.mark.parametrize(
    ("keyword", "value", "field"), [("algorithm_guard", False, "guard"), ("held_out", HELD_OUT, "held_out")]
)
def test_quantizes_old_keywords_warn_and_give_the_same_program(keyword: str, value: Any, field: str) -> None:
    def quantized(algorithms: Any, **keywords: Any) -> torch.Tensor:
        converted = quantplug.quantize(
            Mlp().eval(),
            CALIBRATION[0],
            backend="reference",
            preset="weight_only_int4",
            calibration=CALIBRATION,
            algorithms=algorithms,
            **keywords,
        )
        with torch.no_grad():
            return converted(*PROBE)  # type: ignore[no-any-return]

    with _warns("quantize", keyword):
        old = quantized(["gptq"], **{keyword: value})
    assert torch.equal(old, quantized(quantplug.Algorithms(["gptq"], **{field: value})))


def test_the_old_keywords_beside_algorithms_or_an_unknown_keyword_are_refused() -> None:
    with pytest.raises(
        quantplug.OptionError, match=r"algorithms=Algorithms\(\.\.\.\) and held_out=: configure"
    ):
        _output(quantplug.Algorithms(["gptq"]), held_out=HELD_OUT)
    with pytest.raises(TypeError, match=r"prepare\(\) got an unexpected keyword argument .calibrate."):
        _output(["gptq"], calibrate=CALIBRATION)


def test_algorithms_is_checked_when_built_and_cannot_change() -> None:
    with pytest.raises(quantplug.OptionError, match="guard must be True or False, got 'no'"):
        quantplug.Algorithms(["gptq"], guard="no")  # type: ignore[arg-type]
    with pytest.raises(quantplug.OptionError, match="guard=False turns the guard off"):
        quantplug.Algorithms(["gptq"], held_out=HELD_OUT, guard=False)
    configured = quantplug.Algorithms(["gptq"], calibration=CALIBRATION, guard=False)
    with pytest.raises(AttributeError):
        configured.guard = True  # type: ignore[misc]
    assert repr(configured) == "Algorithms(['gptq'], calibration=<4 batches>, guard=False)"
