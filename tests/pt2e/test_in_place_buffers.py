"""In-place writes into buffers quantized as torchao quantizes them (issue 44, item 11), and their
reads kept float on purpose (issue 42, item 10).

``buf.index_put_((idx,), x)`` (or the same write into a view of ``buf``) annotated with its value
and output sharing the buffer edge's spec: torchao puts no observer on the written buffer (the
op must write the buffer, not a dequantized copy) and quantizes the value, as quantplug does. The
converted program must keep writing the buffer, under its own name, so that torch.export of it
still lists the buffer as mutated; and quantplug must leave the caller's buffer untouched.

The op's output is the buffer itself: torchao quantizes it as annotated, on the range the buffer
had in calibration; quantplug reads it float (a written buffer is state, whose later values
calibration never saw; docs/migrating-from-torchao.md, "In-place writes into buffers").
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.fx import GraphModule

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e import observer
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
    SharedQuantizationSpec,
)

import quantplug

pytestmark = [pytest.mark.torchao, pytest.mark.filterwarnings("ignore::UserWarning")]


class WriteQuantizer(Quantizer):
    """index_put_: the written tensor's edge gets a spec; the value and the result share it."""

    def annotate(self, model: GraphModule) -> GraphModule:
        spec = QuantizationSpec(
            dtype=torch.int8,
            observer_or_fake_quant_ctr=observer.default_observer,
            quant_min=-128,
            quant_max=127,
            qscheme=torch.per_tensor_symmetric,
        )
        for node in model.graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.index_put_.default:
                written, value = node.args[0], node.args[2]
                shared = SharedQuantizationSpec((written, node))
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={written: spec, value: shared}, output_qspec=shared
                )
        return model

    def validate(self, model: GraphModule) -> None:
        pass


class AddQuantizer(Quantizer):
    """add_: each input and the output with a spec of its own (the written edge alone in its group)."""

    def annotate(self, model: GraphModule) -> GraphModule:
        for node in model.graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.add_.Tensor:
                spec = QuantizationSpec(
                    dtype=torch.int8,
                    observer_or_fake_quant_ctr=observer.default_observer,
                    quant_min=-128,
                    quant_max=127,
                    qscheme=torch.per_tensor_symmetric,
                )
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={node.args[0]: spec, node.args[1]: spec}, output_qspec=spec
                )
        return model

    def validate(self, model: GraphModule) -> None:
        pass


class AddsToRowOfBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(3, 2))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.buf.select(0, 2).add_(x).clone()


class WritesBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(5))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.buf.index_put_((idx,), x).clone()


class WritesRowOfBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(3, 5))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.buf.select(0, 1).index_put_((idx,), x).clone()


BATCHES = [
    (torch.tensor([0.5, -1.5]), torch.tensor([0, 3])),
    (torch.tensor([2.0, 0.25]), torch.tensor([1, 4])),
]


def _qdq(gm: GraphModule) -> Counter[str]:
    return Counter(
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "quantized_decomposed"
    )


#: case -> (model, quantizer, what the program returns of its buffer)
CASES = {
    "index_put_buffer": (WritesBuffer, WriteQuantizer, lambda buf: buf),
    "index_put_view_of_buffer": (WritesRowOfBuffer, WriteQuantizer, lambda buf: buf[1]),
    "add_view_of_buffer_own_spec": (AddsToRowOfBuffer, AddQuantizer, lambda buf: buf[2]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_written_buffer_stays_a_written_buffer(case: str) -> None:
    model_class, quantizer_class, returned = CASES[case]
    seen: dict[str, Any] = {}
    for flow, prepare, convert in (
        ("torchao", prepare_pt2e, convert_pt2e),
        ("quantplug", quantplug.prepare, quantplug.convert),
    ):
        program = torch.export.export(model_class().eval(), BATCHES[0], strict=True).module()
        prepared = prepare(program, quantizer_class())
        for batch in BATCHES:
            prepared(*batch)
        converted = convert(prepared)
        outputs = [converted(*batch) for batch in reversed(BATCHES)]
        mutated = torch.export.export(converted, BATCHES[0], strict=True).run_decompositions({})
        seen[flow] = (
            _qdq(converted),
            {name: b.clone() for name, b in converted.named_buffers()},
            outputs,
            mutated.graph_signature.buffers_to_mutate,
        )
        if flow == "quantplug":  # the caller's buffer saw none of the writes
            assert not program.buf.any()
    (ours, our_buffers, our_outputs, our_mutated), (theirs, their_buffers, _, their_mutated) = (
        seen["quantplug"],
        seen["torchao"],
    )
    # the written value quantized in both; the op's result (the buffer) read float by quantplug only
    read_of_result = Counter(
        f"quantized_decomposed.{op}_per_tensor.default" for op in ("quantize", "dequantize")
    )
    assert ours == theirs - read_of_result and sum(ours.values()) > 0
    assert our_buffers.keys() == their_buffers.keys() == {"buf"}
    torch.testing.assert_close(our_buffers, their_buffers, atol=0, rtol=0)  # the same writes landed
    assert our_buffers["buf"].dtype == torch.float32 and our_buffers["buf"].any()  # written, not frozen
    assert our_mutated == their_mutated and set(our_mutated.values()) == {"buf"}
    torch.testing.assert_close(our_outputs[-1], returned(our_buffers["buf"]), atol=0, rtol=0)
