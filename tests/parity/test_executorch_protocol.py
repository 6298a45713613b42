"""ExecuTorch's QnnQuantizer through quantplug.prepare/convert gives torchao's result exactly."""

from __future__ import annotations

import os

import pytest
import torch

import quantplug
from _quantplug.demo.model import demo_calibration, demo_model
from _quantplug.flow.inspect import encodings

pytest.importorskip("torchao.quantization.pt2e")
os.environ.setdefault("QNN_SDK_ROOT", "")  # or ExecuTorch tries to download an SDK
qnn = pytest.importorskip("executorch.backends.qualcomm.quantizer.quantizer")


def _scales(gm: torch.fx.GraphModule) -> list[object]:
    return sorted((e["kind"], e["dtype"], repr(e["scale"]), repr(e["zero_point"])) for e in encodings(gm))


@pytest.mark.executorch
def test_qnn_quantizer_is_accepted_and_matches_torchao() -> None:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    model, example = demo_model()
    ep = torch.export.export(model, example)
    results = []
    for flow in ("torchao", "quantplug"):
        quantizer = qnn.QnnQuantizer()
        prepared = (
            prepare_pt2e(ep.module(), quantizer) if flow == "torchao" else quantplug.prepare(ep, quantizer)
        )
        for batch in demo_calibration(4):
            prepared(*batch)
        results.append(convert_pt2e(prepared) if flow == "torchao" else quantplug.convert(prepared))
    ao, qp = results
    torch.testing.assert_close(qp(*example), ao(*example), rtol=0, atol=1e-6)
    assert _scales(qp) == _scales(ao)
