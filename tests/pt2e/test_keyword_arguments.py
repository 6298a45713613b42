"""Keyword arguments of annotated nodes, validated as torchao validates them (issue 44, item 11).

PT2E observes positional inputs only. torchao's prepare_pt2e refuses an annotated node that
takes a node as a keyword argument (an ``out=`` tensor, or a tensor a symbolically traced model
passes by keyword), since it would stay unquantized without a word, and accepts non-tensor
keywords (``device=``, a scalar ``max=``). quantplug must refuse and accept the same programs, and
refuse with a typed error that is also the ``AssertionError`` torchao raises.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.fx import GraphModule, symbolic_trace

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e import observer
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, Quantizer

import quantplug

pytestmark = [pytest.mark.torchao, pytest.mark.filterwarnings("ignore::UserWarning")]


class EveryInput(Quantizer):
    """Annotates every call with a spec on each of its input nodes, keywords included."""

    def annotate(self, model: GraphModule) -> GraphModule:
        spec = QuantizationSpec(torch.int8, observer.default_observer, qscheme=torch.per_tensor_symmetric)
        for node in model.graph.nodes:
            if node.op == "call_function":
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map=dict.fromkeys(node.all_input_nodes, spec), output_qspec=spec
                )
        return model

    def validate(self, model: GraphModule) -> None:
        pass


class OnesLike(torch.nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(t, device="cpu", pin_memory=False) + t


class Clamp(torch.nn.Module):
    def __init__(self, bound: float | torch.Tensor, in_place: bool) -> None:
        super().__init__()
        self.bound, self.in_place = bound, in_place

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            torch.clamp(t, max=self.bound, out=t)
            return t
        return torch.clamp(t, max=self.bound)


INPUT = torch.randn(1, 2, 3, 3)
#: name -> (how the program is captured, model, whether torchao refuses it)
CASES: dict[str, tuple[str, Any, bool]] = {
    "non_tensor_keywords": ("export", lambda: OnesLike(), False),
    "tensor_keyword_made_positional_by_export": ("export", lambda: Clamp(INPUT - 0.2, False), False),
    "out_tensor": ("export", lambda: Clamp(0.5, True), True),
    "traced_scalar_keyword": ("trace", lambda: Clamp(0.5, False), False),
    "traced_tensor_keyword": ("trace", lambda: Clamp(INPUT - 0.2, False), True),
}


def _capture(how: str, model: torch.nn.Module) -> GraphModule:
    if how == "trace":
        return symbolic_trace(model)
    return torch.export.export(model, (INPUT.clone(),)).module()


def _qdq(gm: GraphModule) -> Counter[str]:
    return Counter(
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "quantized_decomposed"
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_keyword_arguments_are_refused_where_torchao_refuses_them(case: str) -> None:
    how, make, refused = CASES[case]
    results: dict[str, Any] = {}
    for flow, prepare, convert in (
        ("torchao", prepare_pt2e, convert_pt2e),
        ("quantplug", quantplug.prepare, quantplug.convert),
    ):
        program = _capture(how, make())
        try:
            prepared = prepare(program, EveryInput())
        except AssertionError as error:
            results[flow] = error
            continue
        prepared(INPUT.clone())
        converted = convert(prepared)
        results[flow] = (_qdq(converted), converted(INPUT.clone()))
    if refused:
        assert isinstance(results["torchao"], AssertionError)
        assert isinstance(results["quantplug"], quantplug.backend.TensorKwargError)
        assert isinstance(results["quantplug"], quantplug.AnnotationError)
        assert "keyword argument" in str(results["quantplug"])
        return
    (ours, our_output), (theirs, their_output) = results["quantplug"], results["torchao"]
    assert sum(ours.values()) > 0
    if how == "trace":
        # a deliberate difference: torchao observes an output only when its node carries a
        # FakeTensor ``val`` (symbolic_trace records none) and drops the output spec in silence;
        # quantplug quantizes the output the quantizer asked for
        assert ours == theirs + Counter(
            {str(torch.ops.quantized_decomposed.quantize_per_tensor.default): 1}
        ) + Counter({str(torch.ops.quantized_decomposed.dequantize_per_tensor.default): 1})
        return
    assert ours == theirs
    torch.testing.assert_close(our_output, their_output, atol=1e-6, rtol=0)
