"""A projected LSTM (``nn.LSTM(..., proj_size=P)``) lowers: torch's ONNX exporter writes a model
ONNX Runtime refuses for it, so lowering decomposes that op (``_quantplug.peers.onnx_projected_lstm``),
in its own copy of the program, and leaves an LSTM without projection to ONNX's ``LSTM`` op."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import quantplug

from .models import ProjectedLSTM, Recurrent

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PRESETS = [{"preset": "int8"}, {"preset": "weight_only_int4"}]


def _lowered(model: nn.Module, options: dict[str, Any]) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 16, generator=gen)
    program = torch.export.export(
        model.eval(), (x,), dynamic_shapes=({0: torch.export.Dim("batch", max=64)},)
    )
    quantizer = quantplug.get_quantizer("reference", **options)
    prepared = quantplug.prepare(program, quantizer)
    with torch.no_grad():
        for _ in range(3):
            prepared(torch.randn(3, 8, 16, generator=gen))
    converted = quantplug.convert(prepared)
    return converted, quantplug.lower(converted, quantizer), gen


@pytest.mark.parametrize("options", PRESETS, ids=[o["preset"] for o in PRESETS])
def test_a_projected_lstm_lowers_and_runs_at_any_batch(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    converted, artifact, gen = _lowered(ProjectedLSTM(), options)
    model = onnx.load_from_string(artifact.files["model.onnx"])
    assert "LSTM" not in {n.op_type for n in model.graph.node}
    # lowering decomposed its own copy: the caller's program still holds the op
    assert [n for n in converted.graph.nodes if str(n.target) == "aten.lstm.input"]
    for batch in (1, 5):
        x = torch.randn(batch, 8, 16, generator=gen)
        with torch.no_grad():
            want = converted(x).numpy()
        got = np.asarray(artifact.run(x))
        assert got.shape == want.shape == (batch, 8, 4)
        # the same weights and the same op, in ORT's summation order
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))


def test_an_lstm_without_projection_keeps_the_onnx_lstm_op() -> None:
    torch.manual_seed(0)
    _, artifact, _ = _lowered(Recurrent(nn.LSTM), {"preset": "int8"})
    model = onnx.load_from_string(artifact.files["model.onnx"])
    assert [n.op_type for n in model.graph.node].count("LSTM") == 1
