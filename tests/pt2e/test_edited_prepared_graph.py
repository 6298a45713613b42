"""A prepared graph the user edited before convert, side by side with torchao (issue 44, item 11).

torchao's users may take an observer out of the prepared graph (an output they want float) and
still convert: the tensor that observer watched, read by other ops too, stays float where the
observer was and is quantized where others still observe it. quantplug must convert such a
graph, to the same Q/DQ ops and outputs.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.fx import GraphModule

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

import quantplug

pytestmark = [pytest.mark.torchao, pytest.mark.filterwarnings("ignore::UserWarning")]


class TwoUsers(torch.nn.Module):
    """conv's output is returned and read by an add."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv(x)
        return y, y + 1


def _qdq(gm: GraphModule) -> Counter[str]:
    return Counter(
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "quantized_decomposed"
    )


def test_converting_after_the_output_observer_of_a_shared_tensor_was_removed() -> None:
    inputs = (torch.randn(1, 3, 6, 6),)
    torch.manual_seed(0)
    model = TwoUsers().eval()
    results = {}
    for flow, prepare, convert in (
        ("torchao", prepare_pt2e, convert_pt2e),
        ("quantplug", quantplug.prepare, quantplug.convert),
    ):
        program = torch.export.export(model, inputs, strict=True).module()
        prepared = prepare(program, XNNPACKQuantizer().set_global(get_symmetric_quantization_config()))
        prepared(*inputs)
        output = next(n for n in prepared.graph.nodes if n.op == "output")
        observer = output.args[0][0]
        assert observer.op == "call_module" and len(observer.users) == 2  # the output and the add
        observer.replace_all_uses_with(observer.args[0])
        prepared.graph.erase_node(observer)
        prepared.recompile()
        converted = convert(prepared)
        returned = next(n for n in converted.graph.nodes if n.op == "output").args[0][0]
        assert returned.target is torch.ops.aten.conv2d.default  # returned float, as edited
        results[flow] = (_qdq(converted), converted(*inputs))
    (ours, our_outputs), (theirs, their_outputs) = results["quantplug"], results["torchao"]
    assert ours == theirs
    for a, b in zip(our_outputs, their_outputs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
