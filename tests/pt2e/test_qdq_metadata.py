"""Q/DQ metadata after convert, side by side with torchao's convert_pt2e (issue 44, item 9).

A backend's partitioner groups the ops of a pattern by the ``quantization_tag`` its quantizer
put on them, and expects the Q/DQ nodes convert made around them to carry the same tag (and
``stack_trace``); torchao's numeric debugger matches a quantized program's nodes to the float
program's by their ``from_node`` provenance. Both must come out of quantplug.convert as they
come out of torchao's, for the same quantizer on the same export.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx import GraphModule, Node

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e._numeric_debugger import (
    compare_results,
    extract_results_from_loggers,
    prepare_for_propagation_comparison,
)
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, Quantizer
from torchao.testing.pt2e._xnnpack_quantizer import (
    XNNPACKQuantizer,
    get_symmetric_quantization_config,
)
from torchao.testing.pt2e._xnnpack_quantizer_utils import OP_TO_ANNOTATOR

from ._side_by_side import both

pytestmark = [pytest.mark.torchao, pytest.mark.filterwarnings("ignore::UserWarning")]

qd = torch.ops.quantized_decomposed
QDQ_OPS = {
    qd.quantize_per_tensor.default,
    qd.quantize_per_tensor.tensor,
    qd.quantize_per_channel.default,
    qd.dequantize_per_tensor.default,
    qd.dequantize_per_tensor.tensor,
    qd.dequantize_per_channel.default,
    qd.choose_qparams.tensor,
    qd.choose_qparams_symmetric.tensor,
}


class ConvPoolLinear(torch.nn.Module):
    """conv -> pool -> hardtanh -> view -> linear: a tagged op, an op sharing its input's
    encoding, an op no quantizer here annotates, and a weighted op after it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.pool = torch.nn.AdaptiveAvgPool2d((1, 1))
        self.linear = torch.nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.hardtanh(self.pool(self.conv(x)))
        return self.linear(y.view(-1, 4))


class TaggingQuantizer(Quantizer):
    """Annotates ``ops`` with XNNPACK's annotators and tags each partition ``<op>_<index>``."""

    def __init__(self, ops: tuple[str, ...], *, dynamic: frozenset[str] = frozenset(), tag: bool = True):
        super().__init__()
        self.ops, self.dynamic, self.tag = ops, dynamic, tag

    def annotate(self, model: GraphModule) -> GraphModule:
        for op in self.ops:
            config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=op in self.dynamic)
            for index, partition in enumerate(OP_TO_ANNOTATOR[op](model, config)):
                for node in partition:
                    if self.tag:
                        node.meta["quantization_tag"] = f"{op}_{index}"
                        node.meta["custom"] = {"partition": f"{op}_{index}"}  # stays on the ops
        return model

    def validate(self, model: GraphModule) -> None:
        pass


class ConstantOperand(torch.nn.Module):
    """matmul with a parameter as its first operand, then add and relu."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(6, 10))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.matmul(self.w, x) + y)


class FirstOperandQuantizer(Quantizer):
    """Quantizes every op's first operand and output, tagging it (and a parameter it reads) with
    the op: the add's operand is the matmul's output, whose own operand is a parameter."""

    def annotate(self, model: GraphModule) -> GraphModule:
        spec = get_symmetric_quantization_config().input_activation
        for node in model.graph.nodes:
            if node.op != "call_function" or not isinstance(node.args[0], Node):
                continue
            node.meta["quantization_annotation"] = QuantizationAnnotation(
                input_qspec_map={node.args[0]: spec}, output_qspec=spec
            )
            node.meta["quantization_tag"] = str(node.target)
            if node.args[0].op == "get_attr":
                node.args[0].meta["quantization_tag"] = str(node.target)
        return model

    def validate(self, model: GraphModule) -> None:
        pass


def _kind(node: Node) -> str | None:
    if node.op == "call_function" and node.target in QDQ_OPS:
        return str(node.target)
    if node.op == "get_attr":
        return "get_attr"
    return None


def tagged(gm: GraphModule) -> Counter[tuple[str, str | None, str | None, str]]:
    """(Q/DQ op or ``get_attr``, tag, stack trace, ``custom``) of every Q/DQ or constant node
    carrying a tag or ``custom`` metadata."""
    found: Counter[tuple[str, str | None, str | None, str]] = Counter()
    for node in gm.graph.nodes:
        kind, tag, custom = _kind(node), node.meta.get("quantization_tag"), node.meta.get("custom")
        if kind is not None and (tag is not None or custom is not None):
            trace = node.meta.get("stack_trace") if kind != "get_attr" else None
            found[(kind, tag, trace, repr(custom))] += 1
    return found


CONV_INPUT = (torch.randn(2, 3, 6, 6),)
CASES: dict[str, tuple[Callable[[], torch.nn.Module], tuple[Any, ...], Callable[[], Any]]] = {
    "static": (
        ConvPoolLinear,
        CONV_INPUT,
        lambda: TaggingQuantizer(("linear", "conv", "adaptive_avg_pool2d")),
    ),
    "float_between": (ConvPoolLinear, CONV_INPUT, lambda: TaggingQuantizer(("linear", "conv"))),
    "two_dynamic": (
        ConvPoolLinear,
        CONV_INPUT,
        lambda: TaggingQuantizer(("conv", "linear"), dynamic=frozenset({"conv", "linear"})),
    ),
    "dynamic_only": (
        ConvPoolLinear,
        CONV_INPUT,
        lambda: TaggingQuantizer(("linear",), dynamic=frozenset({"linear"})),
    ),
    "untagged": (ConvPoolLinear, CONV_INPUT, lambda: TaggingQuantizer(("linear", "conv"), tag=False)),
    "through_unknown_op": (
        ConstantOperand,
        (torch.randn(10, 7), torch.randn(6, 7)),
        FirstOperandQuantizer,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tags_and_stack_traces_as_torchao(case: str) -> None:
    make_model, inputs, make_quantizer = CASES[case]
    torch.manual_seed(0)
    converted = both(make_model(), inputs, make_quantizer)
    expected = tagged(converted.torchao)
    assert tagged(converted.quantplug) == expected
    if case == "untagged":
        assert not expected
    else:  # the comparison sees Q/DQ nodes, not only constants
        assert any(kind != "get_attr" for kind, _, _, _ in expected)


def _debug_results(model: GraphModule, inputs: tuple[Any, ...]) -> dict[Any, Any]:
    logged = prepare_for_propagation_comparison(model)
    logged(*inputs)
    return extract_results_from_loggers(logged)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_numeric_debugger_matches_the_same_nodes_as_torchao(dynamic: bool) -> None:
    """torchao's numeric debugger compares each float op with what the quantized program
    computes under the same provenance: with torchao's convert that is the op's dequantized
    output. quantplug's converted program must give the debugger the same pairs and values."""
    torch.manual_seed(0)
    model = ConvPoolLinear().eval()
    inputs = CONV_INPUT
    exported = torch.export.export(model, inputs, strict=True)  # one export: one provenance
    reference = _debug_results(exported.module(), inputs)

    def quantizer() -> Any:
        return XNNPACKQuantizer().set_global(
            get_symmetric_quantization_config(is_per_channel=True, is_dynamic=dynamic)
        )

    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    import quantplug

    compared = {}
    for name, prepare, convert in (
        ("torchao", prepare_pt2e, convert_pt2e),
        ("quantplug", quantplug.prepare, quantplug.convert),
    ):
        prepared = prepare(exported.module(), quantizer())
        prepared(*inputs)
        compared[name] = compare_results(reference, _debug_results(convert(prepared), inputs))
    assert compared["quantplug"].keys() == compared["torchao"].keys()
    assert len(compared["torchao"]) >= 3
    for info, summary in compared["torchao"].items():
        ours = compared["quantplug"][info]
        assert ours.ref_node_name == summary.ref_node_name
        for a, b in zip(ours.results, summary.results, strict=True):
            torch.testing.assert_close(a.actual, b.actual, atol=1e-5, rtol=1e-5)
