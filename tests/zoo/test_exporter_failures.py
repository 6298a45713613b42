"""Architectures whose lowering hit a failure of torch's ONNX exporter or of ONNX Runtime's
fusions, each at the preset where it did (every other preset of theirs lowered), run through the
sweep's own case (``tests/zoo/sweep.py``: dynamic batch, calibrate, convert, lower, save, run the
ONNX Runtime artifact on held-out batches):

* HF BEiT at ``weight_only_int4``: with no quantize/dequantize pair between them, the attention
  output's ``contiguous()`` and the ``view`` after it failed inside the exporter
  (``quantplug/lowering/contiguous.py``);
* HF Swin V2 at ``int8``: its position-bias MLP multiplies a constant coordinate table; ORT fused
  that product into a ``MatMulNBits`` that quantizes the table to int8 on the fly, which the
  exactness check refused (``quantplug_reference.peers.ort_passes``: such weights are spelled as
  arithmetic);
* a projected LSTM at ``int8`` (``quantplug/lowering/projected_lstm.py``);
* HF ConvBERT at ``qnn_htp`` 8a8w: the exporter expanded its ``nn.Unfold`` (``im2col``) into
  Pad, Gathers and Reshapes whose tensors had no encoding, which strict lowering refused
  (``quantplug_qnn_htp.decompositions.decompose_im2col``);
* HF RecurrentGemma at ``qnn_htp`` 8a8w: torch promotes the boolean reset mask of
  ``reset + ~reset * a`` inside the op, and the exporter's Cast fed a quantized Mul and Add with
  no encoding (``quantplug_qnn_htp.passes.cast_bool_operands``);
* HF Falcon at ``qnn_htp`` 16a8w, once its ``x @ W.T`` layers were linears
  (``_quantplug.rewrites.hand_written_linear``): ``mlp_output += attention_output`` wrote into the
  view ``linear_to_2d`` puts after a linear's dequantize, which the exporter functionalized into
  reshapes between the sum and its quantize, leaving the sum unencoded
  (``quantplug/lowering/in_place_writes.py``);
* HF Falcon at ``weight_only_int4``, with no in-place op left to decompose: the exporter's
  decomposition, which had inlined the rotary embedding's autocast region, no longer ran, and
  that region's dtype assertions reached the translator (``_quantplug.peers.onnx_translate``
  looks into subgraphs now).
"""

from __future__ import annotations

import functools
import re

import pytest

from tests.zoo.sweep import sweep

pytest.importorskip("onnxruntime")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]

CASES = [
    ("beit", "reference", "weight_only_int4"),
    ("swinv2", "reference", "int8"),
    ("projected_lstm", "reference", "int8"),
    ("convbert", "qnn_htp", "8a8w"),
    ("recurrent_gemma", "qnn_htp", "8a8w"),
    ("falcon", "qnn_htp", "16a8w"),
    ("falcon", "reference", "weight_only_int4"),
]


@functools.cache
def _rows(name: str) -> dict[str, str]:
    """The sweep of one architecture over every preset of ``CASES`` it lowers at: built and
    exported once (Falcon has two cases). Rows are strings; each test reads a copy."""
    return sweep(name, presets=tuple((b, p) for n, b, p in CASES if n == name))


@pytest.mark.parametrize(("name", "backend", "preset"), CASES, ids=[f"{n}-{p}" for n, _, p in CASES])
def test_lowers_and_the_artifact_computes_the_program(name: str, backend: str, preset: str) -> None:
    if name in ("beit", "swinv2", "convbert", "recurrent_gemma", "falcon"):
        pytest.importorskip("transformers")
    if backend == "qnn_htp":
        pytest.importorskip("quantplug_qnn_htp")
    rows = dict(_rows(name))
    assert rows["export"] == "dyn", rows
    row = rows[f"{backend}:{preset}"]
    if backend == "qnn_htp":  # lowered strictly; its model.onnx, run as Q/DQ arithmetic, is the program
        onnx_row = re.match(r"ok \S+ onnx (\S+)dB", row)
        assert onnx_row, row
        assert float(onnx_row[1]) > -1.0, row
        return
    found = re.match(r"ok (\S+) art (\S+) d", row)
    assert found, row
    program, artifact = float(found[1]), float(found[2])
    assert abs(program - artifact) < 0.5, row
