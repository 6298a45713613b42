"""Re-entrant quantization, side by side with torchao (issue 44, item 6).

A program that already holds quantize/dequantize ops (a converted part embedded in a float
model and exported again, a model that fake-quantizes in its own forward, or a converted program
given straight back to prepare) is prepared as torchao's ``prepare_pt2e`` prepares it: the Q/DQ
ops are ops like any other, the second quantizer annotates what it wants around them, and
convert keeps them. Only a *prepared* module given again is refused (a deliberate difference:
torchao nests observers in observers).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.fx import GraphModule, Node

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

import quantplug

pytestmark = [pytest.mark.torchao, pytest.mark.filterwarnings("ignore::UserWarning")]

qd = torch.ops.quantized_decomposed
FLOWS = {"torchao": (prepare_pt2e, convert_pt2e), "quantplug": (quantplug.prepare, quantplug.convert)}


def _is_qdq(node: Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "quantized_decomposed"


def qdq_ops(gm: GraphModule) -> Counter[str]:
    return Counter(str(n.target) for n in gm.graph.nodes if _is_qdq(n))


def runtime_qdq_ops(gm: GraphModule) -> Counter[str]:
    """The Q/DQ ops on values computed from the inputs. Those on constants only differ by design:
    quantplug stores a re-quantized constant as integers where torchao's constant folding, which
    never folds a dequantize, keeps ``dq(int) -> q -> dq``; both compute the same integers."""
    from_inputs: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a in from_inputs for a in node.all_input_nodes):
            from_inputs.add(node)
    return Counter(str(n.target) for n in gm.graph.nodes if _is_qdq(n) and n in from_inputs)


def linear_only() -> Any:
    return XNNPACKQuantizer().set_module_type(torch.nn.Linear, get_symmetric_quantization_config())


def everything() -> Any:
    return XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))


class ConvThenLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.head(self.features(x)))


IMAGES = [(torch.randn(2, 3, 10, 10),) for _ in range(3)]


def _embedded_then_exported(flow: str) -> tuple[GraphModule, torch.nn.Module]:
    """``features`` quantized on its own by one quantizer, then the whole model by another."""
    prepare, convert = FLOWS[flow]
    torch.manual_seed(0)
    model = ConvThenLinear().eval()
    part = prepare(torch.export.export(model.features, IMAGES[0], strict=True).module(), everything())
    for batch in IMAGES:
        part(*batch)
    model.features = convert(part)
    prepared = prepare(torch.export.export(model, IMAGES[0], strict=True).module(), linear_only())
    for batch in IMAGES:
        prepared(*batch)
    return convert(prepared), model


def test_a_converted_part_exported_again_is_quantized_as_torchao_does() -> None:
    ours, model = _embedded_then_exported("quantplug")
    theirs, _ = _embedded_then_exported("torchao")
    assert qdq_ops(ours) == qdq_ops(theirs)
    # the first part's Q/DQ are kept, the head gets its own: more than the first part had
    assert qdq_ops(ours)[str(qd.dequantize_per_channel.default)] == 1
    assert sum(qdq_ops(ours).values()) > sum(qdq_ops(model.features).values())
    for batch in IMAGES:
        torch.testing.assert_close(ours(*batch), theirs(*batch), atol=1e-6, rtol=0)


class FakeQuantizesItsInput(torch.nn.Module):
    """A float model whose forward quantizes and dequantizes one of its inputs itself."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y = qd.quantize_per_tensor.default(y, 0.02, 3, -128, 127, torch.int8)
        y = qd.dequantize_per_tensor.default(y, 0.02, 3, -128, 127, torch.int8)
        return self.linear(x) + y


def test_a_model_quantizing_in_its_own_forward_is_prepared_as_torchao_does() -> None:
    inputs = [(torch.randn(4, 6), torch.randn(4, 6)) for _ in range(3)]
    converted = {}
    for flow, (prepare, convert) in FLOWS.items():
        torch.manual_seed(0)
        exported = torch.export.export(FakeQuantizesItsInput().eval(), inputs[0], strict=True)
        prepared = prepare(exported.module(), everything())
        for batch in inputs:
            prepared(*batch)
        converted[flow] = convert(prepared)
    assert qdq_ops(converted["quantplug"]) == qdq_ops(converted["torchao"])
    for batch in inputs:
        ours, theirs = converted["quantplug"](*batch), converted["torchao"](*batch)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_a_converted_program_given_back_to_prepare_is_quantized_as_after_a_new_export() -> None:
    """quantplug's converted program, not exported again: the first flow's annotations (keyed by
    the nodes of the graph it prepared) are forgotten, so the second quantizer alone decides, as
    it does in torchao's flow once the converted program is exported again (torch.export drops
    annotations; torchao given the converted module itself reuses what is left of them)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).eval()
    batches = [(torch.randn(3, 8),) for _ in range(3)]
    prepared = quantplug.prepare(torch.export.export(model, batches[0], strict=True), everything())
    for batch in batches:
        prepared(*batch)
    first = quantplug.convert(prepared)
    converted = {}
    for flow, program in (
        ("quantplug", first),
        ("torchao", torch.export.export(first, batches[0], strict=True).module()),
    ):
        prepare, convert = FLOWS[flow]
        again = prepare(program, linear_only())
        for batch in batches:
            again(*batch)
        converted[flow] = convert(again)
    assert runtime_qdq_ops(converted["quantplug"]) == runtime_qdq_ops(converted["torchao"])
    assert sum(runtime_qdq_ops(converted["quantplug"]).values()) > sum(runtime_qdq_ops(first).values())
    for batch in batches:
        ours, theirs = converted["quantplug"](*batch), converted["torchao"](*batch)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_a_prepared_module_given_again_is_refused_with_the_fix() -> None:
    exported = torch.export.export(torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),), strict=True)
    prepared = quantplug.prepare(exported, everything())
    with pytest.raises(quantplug.QuantplugError, match=r"already prepared.*convert it first"):
        quantplug.prepare(prepared, everything())
