"""torch.compile of a converted program gives inductor's int8 kernels as torchao's does (issue 45.1(c)).

The X86 deployment path of a PT2E user: X86InductorQuantizer, prepare, calibrate,
``move_exported_model_to_eval``, convert, then ``torch.compile`` with freezing, where inductor's
quantization passes fold the weights' dequantize (constant folding: ``_frozen_param``) and match
``dq -> conv/linear -> q`` into oneDNN's int8 ``qconv``/``qlinear`` kernels. The pattern matcher's
counters after compiling quantplug's converted program must equal those after compiling torchao's
(issue 44, kinds 1, 4 and 18: quantplug's lost weight observers failed this before any compile).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from .flows import FLOWS, batches, run_flow, x86

pytest.importorskip("torchao.quantization.pt2e")

from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torchao.quantization.pt2e import move_exported_model_to_eval

pytestmark = [pytest.mark.torchao, pytest.mark.slow]

if not torch.backends.mkldnn.is_available():  # inductor's int8 CPU kernels are oneDNN's
    pytest.skip("oneDNN (mkldnn) is not available", allow_module_level=True)


class ConvRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class LinearRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "conv_bn_relu": (ConvRelu, (1, 3, 8, 8)),
    "linear_relu_linear": (LinearRelu, (4, 16)),
}


def _compiled_counters(
    converted: torch.fx.GraphModule, x: tuple[torch.Tensor, ...]
) -> tuple[dict[str, int], torch.Tensor]:
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), inductor_config.patch({"freezing": True}):
        out = torch.compile(converted)(*x)
    found = {
        k: int(v) for k, v in counters["inductor"].items() if k.startswith(("qconv", "qlinear", "dequant"))
    }
    return found, out


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_converted_program_uses_inductor_int8_kernels_as_torchao(case: str) -> None:
    make, shape = CASES[case]
    torch.manual_seed(0)
    program = torch.export.export(make().eval(), batches(shape, 1)[0])
    data = batches(shape, 3, seed=1)
    x = batches(shape, 1, seed=2)[0]
    results = {}
    for flow in FLOWS:
        converted = run_flow(flow, program, x86, data, between=move_exported_model_to_eval)
        results[flow] = _compiled_counters(converted, x)
    (ours, out), (theirs, reference) = results["quantplug"], results["torchao"]
    assert any(k.endswith("matcher_count") and v for k, v in theirs.items()), theirs  # the oracle fuses
    assert ours == theirs
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-4)
