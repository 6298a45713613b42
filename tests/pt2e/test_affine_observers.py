"""torchao's affine observers (per-group, per-token, dynamic) through quantplug, beside torchao.

A quantizer that asks for torchao's ``AffineQuantized*Observer`` gets what torchao's convert
gives: the observer's own ``convert`` writes torchao's ``choose_qparams_affine`` /
``quantize_affine`` / ``dequantize_affine`` with its granularity's block size (never a
per-tensor encoding), and a grouped weight's quantize is folded to integers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule, Node

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e._affine_quantization import (
    AffineQuantizedMinMaxObserver,
    AffineQuantizedMovingAverageMinMaxObserver,
    AffineQuantizedPlaceholderObserver,
)
from torchao.quantization.pt2e.observer import MappingType, PerChannelMinMaxObserver, PerGroup, PerToken
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, Quantizer

import quantplug

pytestmark = [pytest.mark.torchao, pytest.mark.filterwarnings("ignore::UserWarning")]

ao_ops = torch.ops.torchao
qd = torch.ops.quantized_decomposed


def _spec(
    dtype: torch.dtype, qmin: int, qmax: int, ctr: Any, *, dynamic: bool = False, **kw: Any
) -> QuantizationSpec:
    return QuantizationSpec(
        dtype=dtype, quant_min=qmin, quant_max=qmax, is_dynamic=dynamic, observer_or_fake_quant_ctr=ctr, **kw
    )


#: name -> (activation spec, weight spec)
SCHEMES: dict[str, tuple[QuantizationSpec, QuantizationSpec]] = {
    "static-per-token-act-per-group-weight": (
        _spec(
            torch.uint8,
            0,
            255,
            AffineQuantizedMinMaxObserver.with_args(
                target_dtype=torch.uint8, mapping_type=MappingType.SYMMETRIC, granularity=PerToken()
            ),
            qscheme=None,
        ),
        _spec(
            torch.uint8,
            0,
            255,
            AffineQuantizedMinMaxObserver.with_args(
                target_dtype=torch.uint8,
                mapping_type=MappingType.SYMMETRIC,
                granularity=PerGroup(group_size=32),
            ),
            qscheme=None,
        ),
    ),
    "dynamic-per-token-act-per-channel-weight": (
        _spec(
            torch.int8,
            -128,
            127,
            AffineQuantizedMovingAverageMinMaxObserver.with_args(
                target_dtype=torch.int8,
                mapping_type=MappingType.SYMMETRIC,
                granularity=PerToken(),
                averaging_constant=1,
            ),
            dynamic=True,
            qscheme=None,
        ),
        _spec(
            torch.int8,
            -127,
            127,
            PerChannelMinMaxObserver.with_args(),
            qscheme=torch.per_channel_symmetric,
            ch_axis=0,
        ),
    ),
    "dynamic-per-token-act-per-group-weight": (
        _spec(
            torch.int8,
            -128,
            127,
            AffineQuantizedPlaceholderObserver.with_args(
                target_dtype=torch.int8, mapping_type=MappingType.SYMMETRIC, granularity=PerToken()
            ),
            dynamic=True,
            qscheme=None,
        ),
        _spec(
            torch.int8,
            -127,
            127,
            AffineQuantizedMinMaxObserver.with_args(
                target_dtype=torch.int8,
                mapping_type=MappingType.SYMMETRIC,
                granularity=PerGroup(group_size=32),
            ),
            qscheme=None,
        ),
    ),
}


class LinearQuantizer(Quantizer):
    def __init__(self, scheme: str) -> None:
        super().__init__()
        self.act, self.weight = SCHEMES[scheme]

    def annotate(self, model: GraphModule) -> GraphModule:
        for node in model.graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={node.args[0]: self.act, node.args[1]: self.weight}, _annotated=True
                )
        return model

    def validate(self, model: GraphModule) -> None:
        pass


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _ops(gm: GraphModule) -> Counter[Any]:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_affine_schemes_convert_as_torchao(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = TwoLinears().eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 64, generator=g) * (1 + i),) for i in range(3)]
    program = torch.export.export(model, batches[0], strict=True)
    ao = prepare_pt2e(program.module(), LinearQuantizer(scheme))
    qp = quantplug.prepare(program, LinearQuantizer(scheme))
    for x in batches[:2]:
        torch.testing.assert_close(qp(*x), ao(*x))
    ao_c = convert_pt2e(ao)
    compiled: list[GraphModule] = []
    recompile = GraphModule.recompile

    def counting(gm: GraphModule) -> Any:
        compiled.append(gm)
        return recompile(gm)

    monkeypatch.setattr(GraphModule, "recompile", counting)
    qp_c = quantplug.convert(qp)
    monkeypatch.undo()
    # the observers edit the graph before the module's one code generation
    assert compiled == [qp_c]
    assert _ops(qp_c) == _ops(ao_c)
    # the weights folded from torchao's ops carry torchao's constant-folding names, code included
    assert _frozen(qp_c) == _frozen(ao_c)
    assert ("_frozen_param0" in qp_c.code) == ("per-group-weight" in scheme)
    assert _ops(qp_c)[ao_ops.dequantize_affine] >= 2
    weights = [
        n for n in qp_c.graph.nodes if n.target == ao_ops.dequantize_affine and n.args[0].op == "get_attr"
    ]
    if "per-group-weight" in scheme:  # the grouped weight is stored as integers, one scale per group
        (dq,) = weights[:1]
        assert list(dq.args[1]) == [1, 32]
        assert fetch(qp_c, dq.args[0]).dtype in (torch.int8, torch.uint8)
        assert fetch(qp_c, dq.args[2]).shape == (64, 2)
    # per-token / per-group numbers: the same outputs as torchao (a per-tensor encoding differs by ~0.1)
    torch.testing.assert_close(qp_c(*batches[2]), ao_c(*batches[2]))


def _frozen(gm: GraphModule) -> list[tuple[str, torch.dtype]]:
    """The integer constants torchao's ``dequantize_affine`` reads (the weights folded from
    ``quantize_affine``): attribute and dtype, in graph order."""
    return [
        (str(n.target), fetch(gm, n).dtype)
        for n in gm.graph.nodes
        if n.op == "get_attr"
        and not fetch(gm, n).is_floating_point()
        and any(u.target == ao_ops.dequantize_affine for u in n.users)
    ]


def fetch(gm: GraphModule, node: Node) -> torch.Tensor:
    value = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    assert isinstance(value, torch.Tensor)
    return value
