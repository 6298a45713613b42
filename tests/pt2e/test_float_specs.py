"""Float "specs": ``QuantizationSpec(dtype=torch.float32, observer_or_fake_quant_ctr=PlaceholderObserver)``.

PT2E's way to say "this edge stays float" (issue 44, kind 3). torchao groups it like any spec
(sharing through it included) and its convert drops the observer; float16 becomes a cast to half
and back (X86InductorQuantizer's dynamic fp16 linear config). quantplug refused both.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx import GraphModule, Node

from .flows import FLOWS, batches, op_counts, qdq_counts, run_flow

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e import observer as ao_observer
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
    SharedQuantizationSpec,
)
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_x86_inductor_linear_dynamic_fp16_config,
)

pytestmark = [pytest.mark.torchao]

aten = torch.ops.aten

INT8 = QuantizationSpec(
    dtype=torch.int8,
    quant_min=-128,
    quant_max=127,
    qscheme=torch.per_tensor_affine,
    observer_or_fake_quant_ctr=ao_observer.MinMaxObserver,
)
WEIGHT = QuantizationSpec(
    dtype=torch.int8,
    quant_min=-127,
    quant_max=127,
    qscheme=torch.per_tensor_symmetric,
    observer_or_fake_quant_ctr=ao_observer.MinMaxObserver,
)
FLOAT = QuantizationSpec(dtype=torch.float32, observer_or_fake_quant_ctr=ao_observer.PlaceholderObserver)


class FloatConvOutput(Quantizer):
    """Quantized conv inputs, a float conv output; max-pool's input and output share the conv's
    output spec (so they stay float too), the add after it quantized again."""

    def annotate(self, model: GraphModule) -> GraphModule:
        for node in model.graph.nodes:
            if node.target == aten.conv2d.default:
                x, w = node.args[0], node.args[1]
                assert isinstance(x, Node) and isinstance(w, Node)
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={x: INT8, w: WEIGHT}, output_qspec=FLOAT, _annotated=True
                )
            elif node.target == aten.max_pool2d.default:
                x = node.args[0]
                assert isinstance(x, Node)
                shared = SharedQuantizationSpec((x, node))
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={x: SharedQuantizationSpec(x)}, output_qspec=shared, _annotated=True
                )
            elif node.target == aten.add.Tensor:
                a, b = node.args[0], node.args[1]
                assert isinstance(a, Node) and isinstance(b, Node)
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={a: INT8, b: INT8}, output_qspec=INT8, _annotated=True
                )
        return model

    def validate(self, model: GraphModule) -> None:
        pass


class ConvPoolAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.max_pool2d(self.conv(x), 2) + y


def test_float_spec_and_sharing_through_it_as_torchao() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(2, 3, 8, 8, generator=gen), torch.randn(2, 4, 4, 4, generator=gen)) for _ in range(3)
    ]
    program = torch.export.export(ConvPoolAdd().eval(), data[0])
    converted = {f: run_flow(f, program, FloatConvOutput, data) for f in FLOWS}
    counts = qdq_counts(converted["quantplug"])
    assert counts == qdq_counts(converted["torchao"])
    # the conv's float output and the pool that shares it carry no Q/DQ: quantized are x, the add's
    # two inputs and its output (the weight is stored as integers, dequantized only)
    assert counts["quantized_decomposed.quantize_per_tensor.default"] == 4
    for flow, gm in converted.items():
        pool = next(n for n in gm.graph.nodes if n.target == aten.max_pool2d.default)
        assert pool.args[0].target == aten.conv2d.default, flow  # nothing between them
    with torch.no_grad():
        torch.testing.assert_close(
            converted["quantplug"](*data[0]), converted["torchao"](*data[0]), rtol=0, atol=1e-5
        )


def test_x86_dynamic_fp16_linear_config_casts_weights_as_torchao() -> None:
    def quantizer() -> X86InductorQuantizer:
        return X86InductorQuantizer().set_global(get_x86_inductor_linear_dynamic_fp16_config())

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    data = batches((3, 16), 2)
    program = torch.export.export(model, data[0])
    converted = {f: run_flow(f, program, quantizer, data) for f in FLOWS}
    counts = op_counts(converted["quantplug"])
    assert counts == op_counts(converted["torchao"])
    assert counts["quantized_decomposed.convert_element_type.no_fuse"] == 4  # half and back, per weight
    for flow, gm in converted.items():  # each linear's weight is the cast back of a cast to half
        for linear in (n for n in gm.graph.nodes if n.target == aten.linear.default):
            back = linear.args[1]
            assert back.args[1] == torch.float32 and back.args[0].args[1] == torch.float16, flow
            assert back.args[0].args[0].op == "get_attr", flow
    with torch.no_grad():
        x = batches((3, 16), 1, seed=5)[0]
        torch.testing.assert_close(converted["quantplug"](*x), converted["torchao"](*x), rtol=0, atol=0)
