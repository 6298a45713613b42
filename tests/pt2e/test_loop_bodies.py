"""Loop bodies of higher-order ops quantized as torchao quantizes them (issue 44, item 5).

torchao's prepare_pt2e prepares the combine function of a ``scan`` and the body of a
``while_loop`` with the program's quantizer, and convert_pt2e converts them: the ops inside a
loop are quantized like those outside. quantplug must insert observers there, convert them to
the same Q/DQ ops with the same encodings, and leave the caller's program (whose body modules
``ExportedProgram.module()`` shares between its copies) untouched.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.fx import GraphModule

pytest.importorskip("torchao.quantization.pt2e")

from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

import quantplug

pytestmark = [pytest.mark.torchao, pytest.mark.filterwarnings("ignore::UserWarning")]

FLOWS = {"torchao": (prepare_pt2e, convert_pt2e), "quantplug": (quantplug.prepare, quantplug.convert)}


class RunningSum(torch.nn.Module):
    """scan: each step projects its slice and adds it to the carry."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 5)

    def forward(self, xs: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
        def step(carry: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            projected = self.linear(x)
            return carry + projected, projected

        return scan(step, init=init, xs=xs, dim=0)[1]


class RepeatedProjection(torch.nn.Module):
    """while_loop: the same layer applied three times."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def more(i: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            return i < 3

        def body(i: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return i + 1, torch.relu(self.linear(h))

        return while_loop(more, body, (torch.tensor(0), x))[1]


CASES: dict[str, tuple[type[torch.nn.Module], Any, int, list[tuple[torch.Tensor, ...]]]] = {
    "scan": (
        RunningSum,
        torch.ops.higher_order.scan,
        0,
        [(torch.randn(4, 5), torch.zeros(5)) for _ in range(3)],
    ),
    "while_loop": (
        RepeatedProjection,
        torch.ops.higher_order.while_loop,
        1,
        [(torch.randn(5),) for _ in range(3)],
    ),
}


def _body(gm: GraphModule, op: Any, index: int) -> GraphModule:
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is op)
    body = gm.get_submodule(node.args[index].target)
    assert isinstance(body, GraphModule)
    return body


def _qdq(gm: GraphModule) -> Counter[str]:
    return Counter(
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "quantized_decomposed"
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_loop_body_is_observed_and_converted_as_torchao_does(case: str) -> None:
    model_class, op, index, batches = CASES[case]
    torch.manual_seed(0)
    model = model_class().eval()
    observers, bodies, outputs = {}, {}, {}
    for flow, (prepare, convert) in FLOWS.items():
        program = torch.export.export(model, batches[0], strict=True).module()  # torchao changes it
        caller_code = _body(program, op, index).code
        prepared = prepare(program, XNNPACKQuantizer().set_global(get_symmetric_quantization_config()))
        observers[flow] = sum(n.op == "call_module" for n in _body(prepared, op, index).graph.nodes)
        with torch.no_grad():
            for batch in batches:
                prepared(*batch)
        converted = convert(prepared)
        bodies[flow] = _qdq(_body(converted, op, index))
        with torch.no_grad():
            outputs[flow] = [converted(*batch) for batch in batches]
        if flow == "quantplug":  # the caller's program and its body are as they were
            assert _body(program, op, index).code == caller_code
            assert not any(n.op == "call_module" for n in _body(program, op, index).graph.nodes)
    assert observers["quantplug"] == observers["torchao"] > 0
    assert bodies["quantplug"] == bodies["torchao"]
    assert bodies["quantplug"]  # the body holds Q/DQ ops
    for ours, theirs in zip(outputs["quantplug"], outputs["torchao"], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantplug_backends_quantize_loop_bodies_too(case: str) -> None:
    """The body is prepared by the same quantizer, quantplug's own backends included: the
    reference backend's linear rule (per-channel weights, derived bias) reaches the loop's ops."""
    model_class, op, index, batches = CASES[case]
    torch.manual_seed(0)
    model = model_class().eval()
    exported = torch.export.export(model, batches[0], strict=True)
    prepared = quantplug.prepare(exported, quantplug.get_quantizer("reference"))
    with torch.no_grad():  # in grad mode torch's loops trace their body with fake tensors
        for batch in batches:
            prepared(*batch)
        converted = quantplug.convert(prepared)
        body = _qdq(_body(converted, op, index))
        assert body[str(torch.ops.quantized_decomposed.dequantize_per_channel.default)] >= 1  # the weight
        assert body[str(torch.ops.quantized_decomposed.quantize_per_tensor.default)] >= 1
        for batch in batches:
            torch.testing.assert_close(converted(*batch), model(*batch), atol=0.05, rtol=0)


def test_lowering_a_program_with_a_loop_is_refused_naming_the_loop() -> None:
    model_class, _, _, batches = CASES["while_loop"]
    exported = torch.export.export(model_class().eval(), batches[0], strict=True)
    quantizer = quantplug.get_quantizer("reference")
    prepared = quantplug.prepare(exported, quantizer)
    with torch.no_grad():
        prepared(*batches[0])
    converted = quantplug.convert(prepared)
    with pytest.raises(quantplug.LoweringError, match=r"runs a loop .*while_loop_body.*unroll the loop"):
        quantplug.lower(converted, quantizer)
