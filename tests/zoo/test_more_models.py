"""The sweep's extra architectures (``tests/zoo/more_models.py``) quantize to about what their
float numerics allow with the default flow. Their sweep found OPT's float position ids, which
quantizing truncated to the position before (5 dB at 16a16w); this keeps every one of them in
the suite at two presets, as a floor under the SQNR of the Q/DQ program on held-out batches.

Floors: measured with these models, data and seeds minus 3 dB, rounded down to 0.5 dB. The
random MobileNetV3's squeeze-excitation gates are clipped by qnn_htp's first-batch activation
ranges (see ``test_zoo.py``), and reference int8 clips them as well, hence its low floors.
"""

from __future__ import annotations

import pytest

import quantplug
from tests.zoo.harness import float_case, quantizer, quiet, run, sqnr
from tests.zoo.more_models import MORE_MODELS

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

#: model -> (qnn_htp 16a16w, reference int8) floors in dB
FLOORS: dict[str, tuple[float, float]] = {
    "mistral": (32.5, 17.0),
    "qwen2": (29.0, 16.0),
    "phi3": (26.5, 15.5),
    "opt": (33.5, 27.0),
    "distilbert": (36.0, 31.0),
    "roberta": (39.0, 30.0),
    "t5_encoder": (28.0, 26.5),
    "falcon": (31.5, 27.0),
    "bloom": (41.5, 30.0),
    "gpt_neox": (33.5, 27.0),
    "googlenet": (41.5, 27.0),
    "densenet_small": (34.0, 27.0),
    "mnasnet0_5": (23.0, 18.0),
    "regnet_y_400mf": (31.5, 27.0),
    "resnext_small": (29.0, 23.0),
    "mobilenet_v3_large": (4.0, 4.0),
    "swin_small": (31.5, 24.5),
    "temporal_conv": (36.5, 35.0),
    "decoder_self_memory": (31.0, 27.5),
    "mha": (33.0, 29.5),
    "glu_mlp": (32.0, 29.0),
}


def test_every_more_model_has_a_floor() -> None:
    assert set(FLOORS) == set(MORE_MODELS)


@pytest.mark.parametrize("name", list(MORE_MODELS))
def test_more_models_quantize_to_their_floor(name: str) -> None:
    if not MORE_MODELS[name].available():
        pytest.skip(f"{MORE_MODELS[name].needs} is not installed")
    case = float_case(name)
    for (backend, preset), floor in zip((("qnn_htp", "16a16w"), ("reference", "int8")), FLOORS[name]):
        with quiet():
            prepared = quantplug.prepare(case.program, quantizer(backend, preset))
            run(prepared, case.calibration)
            converted = quantplug.convert(prepared)
        measured = sqnr(case.reference, run(converted, case.held_out))
        assert measured > floor, f"{name} at {backend} {preset}: {measured:.2f} dB, floor {floor}"
