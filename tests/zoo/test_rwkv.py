"""RWKV-4 (transformers' PyTorch path, small config, random weights, 6 tokens): what a recurrent
model written for eager mode brings, each found by the sweep and fixed at its root.

* Each step's output is written in place into ``out = zeros_like(key)``, which the attention's
  product then reads. Its input edge was observed (and quantized) where ``zeros_like`` was made,
  before the writes: the product read zeros (-2.2 dB at ``reference`` int8).
  ``_quantplug.flow.prepare`` now observes such an edge just before its reader.
* The running maximum starts at ``zeros - 1e38``. ``qnn_htp``'s mask-aware observers saw
  nothing but that sentinel and calibration ended in a CalibrationError;
  ``quantplug_qnn_htp.observers.MaskAwareObserver`` now puts it ``mask_margin`` below 0.
* Its embeddings are about +-1e-4 (before a layer norm): ``reference``'s weight scale floor of
  ``2**-12`` left them one or two steps (3 dB at the embedding); tables that are only looked up
  now floor at float32's eps.
* Its first forward divides its output weights in place (``weight.div_(2 ** layer)`` under
  ``torch.no_grad()``, once: a Python flag). Exported before that call, every run of the
  program divides them again: calibration drifted (3.6 dB at ``reference`` int8, the artifact
  49 output steps from the program) and weight-only presets did not lower (the weights were
  computed, ONNX Runtime fused them into a ``MatMulNBits`` at int8 accuracy).
  ``_quantplug.rewrites.parameter_writes`` makes the write functional: every call computes what the
  model computes after its first one. The zoo's config divides by ``2 ** layer``
  (``rescale_every=1``), so that a drift shows.

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

#: 18.9, 12.3 and 18.8 measured
FLOORS = {("reference", "int8"): 15.5, ("reference", "weight_only_int4"): 9.0, ("qnn_htp", "8a8w"): 15.5}


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
