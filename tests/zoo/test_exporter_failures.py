"""Architectures whose lowering hit a failure of torch's ONNX exporter or of ONNX Runtime's
fusions, each at the preset where it did (every other preset of theirs lowered), run through the
sweep's own case (``tests/zoo/sweep.py``: dynamic batch, calibrate, convert, lower, save, run the
ONNX Runtime artifact on held-out batches):

* HF BEiT at ``weight_only_int4``: with no quantize/dequantize pair between them, the attention
  output's ``contiguous()`` and the ``view`` after it failed inside the exporter
  (``quantplug/lowering/contiguous.py``);
* HF Swin V2 at ``int8``: its position-bias MLP multiplies a constant coordinate table; ORT fused
  that product into a ``MatMulNBits`` that quantizes the table to int8 on the fly, which the
  exactness check refused (``quantplug_reference.ort_passes``: such weights are spelled as
  arithmetic);
* a projected LSTM at ``int8`` (``quantplug/lowering/projected_lstm.py``).
"""

from __future__ import annotations

import re

import pytest

from tests.zoo.sweep import sweep

pytest.importorskip("onnxruntime")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

CASES = [
    ("beit", "weight_only_int4"),
    ("swinv2", "int8"),
    ("projected_lstm", "int8"),
]


@pytest.mark.parametrize(("name", "preset"), CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_lowers_and_the_artifact_computes_the_program(name: str, preset: str) -> None:
    if name in ("beit", "swinv2"):
        pytest.importorskip("transformers")
    rows = sweep(name, presets=(("reference", preset),))
    assert rows["export"] == "dyn", rows
    row = rows[f"reference:{preset}"]
    found = re.match(r"ok (\S+) art (\S+) d", row)
    assert found, row
    program, artifact = float(found[1]), float(found[2])
    assert abs(program - artifact) < 0.5, row
