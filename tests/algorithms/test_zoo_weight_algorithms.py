"""The weight algorithms on a zoo architecture whose layer Hessians are what real nets give:
SqueezeNet's fire modules leave most of a conv's inputs dead on random weights (576 inputs, 38
ever non-zero), the matrix on which LAPACK's eigensolver failed to converge and AdaRound raised
``LinAlgError``."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import quantplug
from tests.zoo.harness import float_case, quantizer, quiet, run, sqnr


def held_out_sqnr(
    algorithms: list[Any], name: str = "squeezenet", backend: str = "qnn_htp", preset: str = "16a4w"
) -> float:
    case = float_case(name)
    with quiet():
        q = quantizer(backend, preset)
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


def test_gptq_does_not_fit_a_classifier_calibrated_on_fewer_images_than_its_inputs() -> None:
    """The zoo's ConvNeXt calibrated on 16 images: its classifier has 64 inputs, so its ``H`` is
    singular and GPTQ's updates could move error where no calibration image looks. The guard,
    judging on those same images, lets that through; shrinking ``H`` toward its diagonal there
    (GPTQ's default) keeps the held-out SQNR near the default's. Without it, GPTQ loses 4 dB."""
    default = held_out_sqnr([], "convnext", "reference", "weight_only_int4")
    assert held_out_sqnr([("gptq", {})], "convnext", "reference", "weight_only_int4") > default - 1.0
    unshrunk = [("gptq", {"shrinkage": "off"})]
    assert held_out_sqnr(unshrunk, "convnext", "reference", "weight_only_int4") < default - 2.0


def test_the_guard_keeps_a_transformers_decoder_no_worse_than_the_default() -> None:
    """The zoo's Llama (transformers, random weights, causal mask) with every layer's codes
    perturbed (``Perturb``: most choices hurt): guarded, the converted program's SQNR on its
    calibration batches (all the guard saw) is at least the default's; unguarded, it falls."""
    from tests.algorithms.test_algorithm_guard import Perturb

    case = float_case("llama")
    with torch.no_grad():
        reference = [case.model(*batch) for batch in case.calibration]

    def calibration_sqnr(algorithms: list[Any], guard: bool = True) -> float:
        with quiet():
            q = quantizer("reference", "weight_only_int8")
            prepared = quantplug.prepare(
                case.program, q, algorithms=quantplug.Algorithms(algorithms, guard=guard)
            )
            run(prepared, case.calibration)
            converted = quantplug.convert(prepared)
        return sqnr(reference, run(converted, case.calibration))

    default = calibration_sqnr([])
    assert calibration_sqnr([Perturb(7, 0.0)]) >= default - 1e-3
    assert calibration_sqnr([Perturb(7, 0.0)], guard=False) < default - 1.0


def test_held_out_batches_judge_a_transformers_decoder() -> None:
    """The zoo's Llama with every layer's codes perturbed, judged on a held-out batch: on that
    batch the converted program is at least as good as the default (within the tie margin)."""
    from _quantplug.algorithms.guard import TIE
    from tests.algorithms.test_algorithm_guard import Perturb

    case = float_case("llama")
    judged, reference = case.held_out[:1], case.reference[:1]

    def judged_sqnr(algorithms: list[Any]) -> float:
        with quiet():
            q = quantizer("reference", "weight_only_int8")
            prepared = quantplug.prepare(
                case.program,
                q,
                algorithms=quantplug.Algorithms(algorithms, held_out=judged if algorithms else None),
            )
            run(prepared, case.calibration)
            converted = quantplug.convert(prepared)
        return sqnr(reference, run(converted, judged))

    default = judged_sqnr([])
    assert judged_sqnr([Perturb(7, 0.0)]) >= default + 10 * math.log10(1 - TIE) - 1e-3
