"""RWKV-4 (transformers' PyTorch path, small config, random weights, 6 tokens): what a recurrent
model written for eager mode brings, each found by the sweep and fixed at its root.

* Each step's output is written in place into ``out = zeros_like(key)``, which the attention's
  product then reads. Its input edge was observed (and quantized) where ``zeros_like`` was made,
  before the writes: the product read zeros (-2.2 dB at ``reference`` int8).
  ``quantplug.flow.prepare`` now observes such an edge just before its reader.
* The running maximum starts at ``zeros - 1e38``. ``qnn_htp``'s mask-aware observers saw
  nothing but that sentinel and calibration ended in a CalibrationError;
  ``quantplug_qnn_htp.observers.MaskAwareObserver`` now puts it ``mask_margin`` below 0.
* Its embeddings are about +-1e-4 (before a layer norm): ``reference``'s weight scale floor of
  ``2**-12`` left them one or two steps (3 dB at the embedding); tables that are only looked up
  now floor at float32's eps.

Not covered: weight-only presets. Exported before its first call, the model divides its weights
in place inside the program (transformers rescales them once, on the first forward), so they are
computed, not stored, and ONNX Runtime fuses their quantization into a ``MatMulNBits`` that the
exactness check refuses (a typed LoweringError). Called once before export, RWKV lowers at both
(weight_only_int8 37.1 dB, int4 12.3, artifact equal).

Floors: measured with these models, data and seeds minus 3 dB, rounded down to 0.5 dB.
"""

from __future__ import annotations

import re

import pytest

from tests.zoo.sweep import sweep

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
pytest.importorskip("quantplug_qnn_htp")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

FLOORS = {("reference", "int8"): 15.5, ("qnn_htp", "8a8w"): 15.5}  # 18.9 and 18.8 measured


def test_rwkv_quantizes_and_lowers() -> None:
    rows = sweep("rwkv", presets=tuple(FLOORS))
    assert rows["export"] == "dyn", rows
    for (backend, preset), floor in FLOORS.items():
        row = rows[f"{backend}:{preset}"]
        found = re.match(r"ok (\S+)(?: art (\S+))?", row)
        assert found, row
        assert float(found[1]) > floor, row
        if found[2] is not None:  # ONNX Runtime computes what the program does
            assert abs(float(found[1]) - float(found[2])) < 0.5, row
