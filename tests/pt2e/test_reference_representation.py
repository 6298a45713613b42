"""convert(use_reference_representation=True), side by side with torchao's convert_pt2e.

quantplug writes PT2E's integer-arithmetic reference representation itself
(``_quantplug.flow.reference_representation``); on the same calibrated models torchao's
``convert_pt2e(..., use_reference_representation=True)`` must give the same kinds of ops and the
same numbers, bit for bit. Where torchao's own program cannot run (a linear without bias), quantplug's
must compute what the Q/DQ program computes, within one output quantum; what the representation
cannot express is refused naming the node.
"""

from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.fx import GraphModule

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, Quantizer, SharedQuantizationSpec
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)
from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

import quantplug
from quantplug import ConversionError

pytestmark = [pytest.mark.torchao, pytest.mark.filterwarnings("ignore::UserWarning")]

qd = torch.ops.quantized_decomposed
aten = torch.ops.aten
OUT_DTYPE = torch.ops.higher_order.out_dtype


class Linear(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 5, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class LinearAddRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x) + y) + y  # linear, add-relu, then a plain add


class ConvPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.max_pool2d(self.conv(x), 2)


class CoreAtenQuantizer(Quantizer):
    """XNNPACK's symmetric int8 specs on a program decomposed to core ATen: the convolution and
    the max-pool with indices that torchao's integer conv and max-pool rules read."""

    def annotate(self, model: GraphModule) -> GraphModule:
        config = get_symmetric_quantization_config()
        act, weight = config.input_activation, config.weight
        for node in model.graph.nodes:
            if node.target == aten.convolution.default:
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={node.args[0]: act, node.args[1]: weight},
                    output_qspec=act,
                    _annotated=True,
                )
            elif node.target == aten.max_pool2d_with_indices.default:
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={node.args[0]: act}, _annotated=True
                )
                (values,) = (u for u in node.users if u.target is operator.getitem and u.args[1] == 0)
                values.meta["quantization_annotation"] = QuantizationAnnotation(
                    output_qspec=SharedQuantizationSpec((node.args[0], node)), _annotated=True
                )
        return model

    def validate(self, model: GraphModule) -> None:
        pass


def _inputs(case: str, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    if case == "linear-add-relu":
        return (torch.randn(3, 6, generator=g), torch.randn(3, 5, generator=g))
    if case == "conv2d-maxpool":
        return (torch.randn(1, 3, 8, 8, generator=g),)
    return (torch.randn(3, 6, generator=g),)


def _quantizer(case: str) -> Quantizer:
    if case == "conv2d-maxpool":
        return CoreAtenQuantizer()
    config = get_symmetric_quantization_config(
        is_per_channel=case == "linear-per-channel", is_dynamic=case == "dynamic-linear"
    )
    return XNNPACKQuantizer().set_global(config)


def _model(case: str) -> nn.Module:
    torch.manual_seed(0)
    if case == "linear-add-relu":
        return LinearAddRelu()
    if case == "conv2d-maxpool":
        return ConvPool()
    return Linear(bias=case != "linear-no-bias")


def _program(case: str) -> torch.export.ExportedProgram:
    program = torch.export.export(_model(case).eval(), _inputs(case, 0), strict=True)
    return program.run_decompositions() if case == "conv2d-maxpool" else program


def _calibrated_quantplug(case: str) -> GraphModule:
    prepared = quantplug.prepare(_program(case), _quantizer(case))
    for seed in (1, 2):
        prepared(*_inputs(case, seed))
    return prepared


def _kinds(gm: GraphModule) -> Counter[str]:
    """The ops of ``gm`` by name, overloads merged (torchao leaves some as overload packets)."""
    return Counter(
        str(n.target.overloadpacket if isinstance(n.target, torch._ops.OpOverload) else n.target)
        for n in gm.graph.nodes
        if n.op == "call_function"
    )


def _quantization_ops(gm: GraphModule) -> list[str]:
    """The quantize/dequantize nodes of ``gm`` (``quantized_decomposed.choose_qparams`` is none)."""
    return [
        n.name
        for n in gm.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload) and "quantize" in n.target._schema.name.split("::")[1]
    ]


#: case -> what the integer rules must have written (an op of the kinds, and how many of it)
SIDE_BY_SIDE: dict[str, dict[str, int]] = {
    "linear-per-channel": {str(OUT_DTYPE): 0, "aten.transpose": 2},  # float linear, integer Q/DQ
    "dynamic-linear": {str(OUT_DTYPE): 2, "quantized_decomposed.choose_qparams": 1},
    # linear: int matmul, int32 bias, requantization; add-relu: both inputs rescaled as int32
    "linear-add-relu": {str(OUT_DTYPE): 5, "aten.relu": 0, "aten.linear": 0},
    "conv2d-maxpool": {str(OUT_DTYPE): 3, "aten.max_pool2d_with_indices": 1, "aten.convolution": 0},
}


@pytest.fixture(scope="module", params=list(SIDE_BY_SIDE))
def both(request: pytest.FixtureRequest) -> tuple[str, GraphModule, GraphModule, GraphModule]:
    case = request.param
    ao = prepare_pt2e(_program(case).module(), _quantizer(case))
    for seed in (1, 2):
        ao(*_inputs(case, seed))
    prepared = _calibrated_quantplug(case)
    return (
        case,
        convert_pt2e(ao, use_reference_representation=True),
        quantplug.convert(prepared, use_reference_representation=True),
        quantplug.convert(prepared),
    )


def test_same_ops_as_torchao(both: tuple[str, GraphModule, GraphModule, GraphModule]) -> None:
    case, ao, qp, _ = both
    assert _kinds(qp) == _kinds(ao)
    assert not _quantization_ops(qp)  # every Q/DQ written out as integer arithmetic
    for kind, count in SIDE_BY_SIDE[case].items():
        assert _kinds(qp)[kind] == count, kind


def test_same_numbers_as_torchao(both: tuple[str, GraphModule, GraphModule, GraphModule]) -> None:
    case, ao, qp, qdq = both
    for seed in (3, 4):
        x = _inputs(case, seed)
        out = qp(*x)
        assert torch.equal(out, ao(*x))
        # and what the Q/DQ program computes, up to integer rounding (torchao's tolerance: two
        # quanta of the output; the dynamic linear's output is float)
        assert (out - qdq(*x)).abs().max() <= 0.05


def test_linear_without_bias_has_no_bias_term() -> None:
    """torchao's integer linear divides its ``None`` bias (the program fails when run); quantplug's
    accumulates without one."""
    prepared = _calibrated_quantplug("linear-no-bias")
    qp = quantplug.convert(prepared, use_reference_representation=True)
    assert _kinds(qp)[str(OUT_DTYPE)] == 2 and not _quantization_ops(qp)  # matmul, requantization
    qdq = quantplug.convert(prepared)
    x = _inputs("linear-no-bias", 3)
    out_scale = [n.args[1] for n in qdq.graph.nodes if n.target == qd.quantize_per_tensor.default][-1]
    assert (qp(*x) - qdq(*x)).abs().max() <= out_scale + 1e-6


def test_unrepresentable_dtype_is_refused_naming_the_node() -> None:
    """X86's uint8 activations have no int8 reference: torchao leaves their Q/DQ ops in its
    "reference" program; quantplug names the first and keeps the prepared model usable."""
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = quantplug.prepare(_program("linear-per-channel"), quantizer)
    prepared(*_inputs("linear-per-channel", 1))
    with pytest.raises(ConversionError, match=r"node 'quantize_per_tensor\w*'.*torch.uint8.*int8"):
        quantplug.convert(prepared, use_reference_representation=True)
    assert _quantization_ops(quantplug.convert(prepared))  # the prepared model is unchanged


def test_loop_body_is_rewritten() -> None:
    """torchao's convert_pt2e converts a while_loop's body with the same options (checked side by
    side by hand: the same ops, equal outputs): its Q/DQ ops become integer arithmetic there too."""
    from tests.pt2e.test_loop_bodies import CASES, _body

    model_class, op, index, batches = CASES["while_loop"]
    torch.manual_seed(0)
    program = torch.export.export(model_class().eval(), batches[0], strict=True)
    prepared = quantplug.prepare(program, XNNPACKQuantizer().set_global(get_symmetric_quantization_config()))
    with torch.no_grad():  # in grad mode torch's loops trace their body with fake tensors
        for batch in batches:
            prepared(*batch)
        ours, qdq = (quantplug.convert(prepared, use_reference_representation=r) for r in (True, False))
        body = _body(ours, op, index)
        assert not _quantization_ops(body) and _kinds(body)["aten.round"]
        qdq_body = _body(qdq, op, index)
        assert _quantization_ops(qdq_body)
        out_scale = [n.args[1] for n in qdq_body.graph.nodes if n.target == qd.quantize_per_tensor.default][
            -1
        ]
        # three steps, each off by at most one quantum of its output
        assert (ours(*batches[0]) - qdq(*batches[0])).abs().max() <= 3 * out_scale + 1e-6


def _int8_add_program(
    scales: tuple[float, float, float], zero_points: tuple[int, int, int], relu: bool
) -> GraphModule:
    """``dequantize(x), dequantize(y) -> add (-> relu) -> quantize`` on int8 tensors: the chain
    convert writes for a quantized add, with the given encodings."""
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    (sx, sy, so), (zx, zy, zo) = scales, zero_points
    dx = graph.call_function(qd.dequantize_per_tensor.default, (x, sx, zx, -128, 127, torch.int8))
    dy = graph.call_function(qd.dequantize_per_tensor.default, (y, sy, zy, -128, 127, torch.int8))
    out = graph.call_function(aten.add.Tensor, (dx, dy))
    if relu:
        out = graph.call_function(aten.relu.default, (out,))
    graph.output(graph.call_function(qd.quantize_per_tensor.default, (out, so, zo, -128, 127, torch.int8)))
    return GraphModule(torch.nn.Module(), graph)


@settings(max_examples=25, deadline=None)
@given(
    scales=st.tuples(*(st.floats(1e-3, 1.0) for _ in range(3))),
    zero_points=st.tuples(*(st.integers(-128, 127) for _ in range(3))),
    relu=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_integer_add_is_within_one_step_of_the_qdq_add(
    scales: tuple[float, float, float], zero_points: tuple[int, int, int], relu: bool, seed: int
) -> None:
    """The integer add (each input rescaled to the output's scale and rounded, then summed) gives
    the Q/DQ chain's int8 result or its neighbour, at any encodings. The add-relu's rescaling is
    an ``out_dtype`` multiply, which truncates each input toward zero (torchao's arithmetic): two
    steps at most, and never below the output's zero point."""
    from _quantplug.flow.reference_representation import to_reference_representation

    qdq = _int8_add_program(scales, zero_points, relu)
    reference = to_reference_representation(_int8_add_program(scales, zero_points, relu))
    assert str(OUT_DTYPE if relu else aten.round.default) in {str(n.target) for n in reference.graph.nodes}
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(-128, 128, (64,), generator=g, dtype=torch.int8) for _ in range(2))
    ours, theirs = reference(x, y), qdq(x, y)
    assert ours.dtype == torch.int8
    assert (ours.int() - theirs.int()).abs().max() <= (2 if relu else 1)
    if relu:
        assert ours.min() >= zero_points[2]
