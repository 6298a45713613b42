"""The weight algorithms on a zoo architecture whose layer Hessians are what real nets give:
SqueezeNet's fire modules leave most of a conv's inputs dead on random weights (576 inputs, 38
ever non-zero), the matrix on which LAPACK's eigensolver failed to converge and AdaRound raised
``LinAlgError``."""

from __future__ import annotations

from typing import Any

import pytest

import quantplug
from tests.zoo.harness import float_case, quantizer, quiet, run, sqnr


def held_out_sqnr(algorithms: list[Any]) -> float:
    case = float_case("squeezenet")
    with quiet():
        q = quantizer("qnn_htp", "16a4w")
        prepared = quantplug.prepare(case.program, q, algorithms=algorithms or None)
        run(prepared, case.calibration)
        converted = quantplug.convert(prepared)
    return sqnr(case.reference, run(converted, case.held_out))


@pytest.mark.parametrize(
    "algorithm",
    [("adaround", {"iterations": 100}), ("seq_mse", {}), ("gptq", {})],
    ids=["adaround", "seq_mse", "gptq"],
)
def test_weight_algorithms_run_and_gain_on_squeezenet(algorithm: tuple[str, dict[str, Any]]) -> None:
    assert held_out_sqnr([algorithm]) > held_out_sqnr([]) + 1.0
