"""PT2E prepare/convert behaviours torchao users rely on (issue 44, kinds 10, 17, 19, 21, 23, 10.x).

Each runs torchao's flow beside quantplug's on the same exported program; where quantplug differs
on purpose, the test pins the difference (and docs/migrating-from-torchao.md says why).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.fx import GraphModule, Node

import quantplug

from .flows import FLOWS, batches, calibrated, convert, op_counts, prepare, qdq_counts, run_flow, x86

pytest.importorskip("torchao.quantization.pt2e")

from torchao.quantization.pt2e import observer as ao_observer
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
    SharedQuantizationSpec,
)

pytestmark = [pytest.mark.torchao]

aten = torch.ops.aten

ACT = QuantizationSpec(
    dtype=torch.uint8,
    quant_min=0,
    quant_max=255,
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


class _Annotating(Quantizer):
    """A from-scratch PT2E quantizer: ``rule(node)`` gives a node's annotation or None."""

    def rule(self, node: Node) -> QuantizationAnnotation | None:
        raise NotImplementedError

    def annotate(self, model: GraphModule) -> GraphModule:
        for node in model.graph.nodes:
            if node.op == "call_function" and (annotation := self.rule(node)) is not None:
                node.meta["quantization_annotation"] = annotation
        return model

    def validate(self, model: GraphModule) -> None:
        pass


# ----------------------------------------------------------------------------- in-place state writes


class WritesItsBuffer(_Annotating):
    """``buf.index_put_((idx,), x)``: the destination, the values and the result share one spec."""

    def rule(self, node: Node) -> QuantizationAnnotation | None:
        if node.target != aten.index_put_.default:
            return None
        dst, values = node.args[0], node.args[2]
        assert isinstance(dst, Node) and isinstance(values, Node)
        shared = SharedQuantizationSpec((dst, node))
        return QuantizationAnnotation(
            input_qspec_map={dst: ACT, values: shared}, output_qspec=shared, _annotated=True
        )


class Accumulate(nn.Module):
    def __init__(self, view: bool) -> None:
        super().__init__()
        self.view = view
        self.register_buffer("buf", torch.zeros(2, 4))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        target = self.buf.select(0, 0) if self.view else self.buf
        return target.index_put_((idx,), x, accumulate=True).clone()


@pytest.mark.parametrize("view", [False, True], ids=["buffer", "view_of_buffer"])
def test_a_buffer_written_in_place_stays_a_buffer_and_keeps_its_writes(view: bool) -> None:
    idx = torch.tensor([1, 3]) if view else torch.tensor([0, 1])
    data = [(torch.tensor([0.5, 1.0]) if view else torch.ones(2, 4), idx)]
    program = torch.export.export(Accumulate(view).eval(), data[0])
    converted = {f: run_flow(f, program, WritesItsBuffer, data) for f in FLOWS}
    for flow, gm in converted.items():
        assert "buf" in dict(gm.named_buffers()), flow
        before = gm.buf.clone()
        with torch.no_grad():
            gm(*data[0])
        assert not torch.equal(gm.buf, before), f"{flow}: the write into the buffer was lost"
    signature = {
        f: torch.export.export(gm, data[0]).run_decompositions({}).graph_signature.buffers_to_mutate
        for f, gm in converted.items()
    }
    assert signature["quantplug"] == signature["torchao"]
    assert list(signature["quantplug"].values()) == ["buf"]


# ----------------------------------------------------------------------------- observer convert() hooks

_LIB = torch.library.Library("quantplug_pt2e_test", "DEF")
_LIB.define("q4(Tensor x, float scale) -> Tensor")
_LIB.define("dq4(Tensor x, float scale) -> Tensor")


@torch.library.impl(_LIB, "q4", "CompositeExplicitAutograd")
def _q4(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.clamp(torch.round(x / scale) + 8, 0, 15).to(torch.uint8)


@torch.library.impl(_LIB, "dq4", "CompositeExplicitAutograd")
def _dq4(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.to(torch.float32) - 8) * scale


class Int4Observer(ao_observer.ObserverBase):
    """Measures nothing; its ``convert`` writes the custom int4 pair in place of its node."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(dtype=torch.int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self, **kwargs: object) -> None:
        return None

    def convert(self, model: GraphModule, observer_node: Node) -> None:
        with model.graph.inserting_before(observer_node):
            q = model.graph.call_function(
                torch.ops.quantplug_pt2e_test.q4.default, (observer_node.args[0], 0.25)
            )
            dq = model.graph.call_function(torch.ops.quantplug_pt2e_test.dq4.default, (q, 0.25))
        observer_node.replace_all_uses_with(dq)
        model.graph.erase_node(observer_node)


class Int4Add(_Annotating):
    def rule(self, node: Node) -> QuantizationAnnotation | None:
        if node.target != aten.add.Tensor:
            return None
        spec = QuantizationSpec(dtype=torch.int8, observer_or_fake_quant_ctr=Int4Observer)
        a, b = node.args[0], node.args[1]
        assert isinstance(a, Node) and isinstance(b, Node)
        return QuantizationAnnotation(input_qspec_map={a: spec, b: spec}, output_qspec=spec, _annotated=True)


class Add(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


def test_an_observer_s_convert_hook_writes_its_own_ops_as_in_torchao() -> None:
    data = [(torch.randn(2, 5), torch.randn(2, 5))]
    program = torch.export.export(Add(), data[0])
    converted = {f: run_flow(f, program, Int4Add, data) for f in FLOWS}
    counts = {f: op_counts(gm) for f, gm in converted.items()}
    assert counts["quantplug"] == counts["torchao"]
    assert counts["quantplug"]["quantplug_pt2e_test.q4.default"] == 3  # both inputs and the output
    assert not qdq_counts(converted["quantplug"])
    with torch.no_grad():
        torch.testing.assert_close(
            converted["quantplug"](*data[0]), converted["torchao"](*data[0]), rtol=0, atol=0
        )


# ----------------------------------------------------------------------------- uncalibrated convert


def test_uncalibrated_observers_of_a_foreign_quantizer_convert_with_their_defaults() -> None:
    torch.manual_seed(0)
    program = torch.export.export(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval(), batches((1, 3, 6, 6), 1)[0]
    )
    converted = {}
    for flow in FLOWS:
        prepared = prepare(flow, program.module(), x86())
        with pytest.warns(UserWarning, match="must run observer|never saw data"):
            converted[flow] = convert(flow, prepared)

    def input_encoding(gm: GraphModule) -> tuple[object, ...]:
        q = next(
            n
            for n in gm.graph.nodes
            if n.target == torch.ops.quantized_decomposed.quantize_per_tensor.default
        )
        return tuple(q.args[1:])

    # the activation gets the observer's defaults in both (torchao's weights, observed only in
    # calibration, get them too: quantplug measures weights at convert, a documented difference)
    assert input_encoding(converted["quantplug"]) == input_encoding(converted["torchao"])
    assert qdq_counts(converted["quantplug"]) == qdq_counts(converted["torchao"])


def test_uncalibrated_observers_of_a_quantplug_backend_are_refused() -> None:
    program = torch.export.export(nn.Sequential(nn.Linear(4, 4)).eval(), (torch.randn(2, 4),))
    prepared = quantplug.prepare(program, quantplug.get_quantizer("reference"))
    with pytest.raises(quantplug.CalibrationError, match="never saw data"):
        quantplug.convert(prepared)


# ----------------------------------------------------------------------------- batch-norm folding


def test_linear_batch_norm_on_a_3d_input_is_left_unfolded_with_torchao_s_warning() -> None:
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5)).eval()
    with torch.no_grad():  # statistics far from identity, so a wrong fold shows
        model[1].running_mean.uniform_(-2, 2)
        model[1].running_var.uniform_(0.2, 4)
    x = torch.randn(2, 5, 3)
    program = torch.export.export(model, (x,))
    for flow in FLOWS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prepared = prepare(flow, program.module(), x86())
        assert any("Not fusing linear+bn" in str(w.message) for w in caught), flow
        with torch.no_grad():
            torch.testing.assert_close(prepared(x), model(x), rtol=1e-5, atol=1e-5)


class PaddedConvBnRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding="same")
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class PaddedConvRelu(_Annotating):
    """conv (its ``.padding`` overload) + relu: quantized input and weight, a float bias spec."""

    def rule(self, node: Node) -> QuantizationAnnotation | None:
        if node.target == aten.relu.default and getattr(node.args[0], "target", None) == aten.conv2d.padding:
            return QuantizationAnnotation(output_qspec=ACT, _annotated=True)
        if node.target != aten.conv2d.padding:
            return None
        x, w, b = node.args[0], node.args[1], node.args[2]
        assert isinstance(x, Node) and isinstance(w, Node) and isinstance(b, Node)
        bias = QuantizationSpec(
            dtype=torch.float32, observer_or_fake_quant_ctr=ao_observer.PlaceholderObserver
        )
        return QuantizationAnnotation(input_qspec_map={x: ACT, w: WEIGHT, b: bias}, _annotated=True)


def test_conv_with_string_padding_and_batch_norm_is_folded_as_torchao() -> None:
    torch.manual_seed(0)
    model = PaddedConvBnRelu().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    data = batches((2, 3, 6, 6), 2)
    program = torch.export.export(model, data[0])
    assert any(n.target == aten.conv2d.padding for n in program.graph.nodes)
    converted = {f: run_flow(f, program, PaddedConvRelu, data) for f in FLOWS}
    for flow, gm in converted.items():
        assert not any("batch_norm" in str(n.target) for n in gm.graph.nodes), flow
    assert qdq_counts(converted["quantplug"]) == qdq_counts(converted["torchao"])
    assert qdq_counts(converted["quantplug"])["quantized_decomposed.quantize_per_tensor.default"] == 2
    with torch.no_grad():
        torch.testing.assert_close(
            converted["quantplug"](*data[0]), converted["torchao"](*data[0]), rtol=0, atol=1e-5
        )


# ------------------------------------------------------------------------ per-channel spec without ch_axis


class PerChannelWithoutAxis(_Annotating):
    def rule(self, node: Node) -> QuantizationAnnotation | None:
        if node.target != aten.linear.default:
            return None
        weight = QuantizationSpec(
            dtype=torch.int8,
            quant_min=-127,
            quant_max=127,
            qscheme=torch.per_channel_symmetric,
            observer_or_fake_quant_ctr=ao_observer.PerChannelMinMaxObserver,
        )
        x, w = node.args[0], node.args[1]
        assert isinstance(x, Node) and isinstance(w, Node)
        return QuantizationAnnotation(input_qspec_map={x: ACT, w: weight}, _annotated=True)


def test_a_per_channel_spec_without_ch_axis_is_named_at_prepare() -> None:
    program = torch.export.export(nn.Sequential(nn.Linear(4, 3)).eval(), (torch.randn(2, 4),))
    with pytest.raises(quantplug.AnnotationError, match=r"input '.*weight' of node 'linear' has no ch_axis"):
        quantplug.prepare(program, PerChannelWithoutAxis())
    # torchao accepts it and fails later, in the observer (a TypeError): the quantplug error is the difference
    with pytest.raises(TypeError):
        calibrated("torchao", program, PerChannelWithoutAxis, [(torch.randn(2, 4),)])


class SharedAdd(_Annotating):
    """``add``'s second input and its output share its first input's encoding: annotations naming
    input nodes and an input edge (``SharedQuantizationSpec``)."""

    def rule(self, node: Node) -> QuantizationAnnotation | None:
        if node.target != aten.add.Tensor:
            return None
        a, b = node.args[0], node.args[1]
        assert isinstance(a, Node) and isinstance(b, Node)
        return QuantizationAnnotation(
            input_qspec_map={a: ACT, b: SharedQuantizationSpec((a, node))},
            output_qspec=SharedQuantizationSpec((a, node)),
            _annotated=True,
        )


def _named_nodes(value: object, found: list[Node], depth: int = 0) -> list[Node]:
    """The nodes an annotation names (dict keys, shared edges, derived-from lists)."""
    if isinstance(value, Node):
        found.append(value)
    elif depth < 6 and isinstance(value, dict):
        for item in [*value.keys(), *value.values()]:
            _named_nodes(item, found, depth + 1)
    elif depth < 6 and isinstance(value, (list, tuple)):
        for item in value:
            _named_nodes(item, found, depth + 1)
    elif depth < 6 and hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:  # type: ignore[attr-defined]
            _named_nodes(getattr(value, name), found, depth + 1)
    return found


@pytest.mark.parametrize("flow", FLOWS)
def test_the_converted_program_s_annotations_name_its_own_nodes(flow: str) -> None:
    """torchao converts the prepared graph in place, so an annotation left on a converted node
    names nodes of that graph; quantplug builds a new graph and maps them onto the copies. Named
    as they were, they held the prepared module (its observers, the algorithms' statistics)."""
    program = torch.export.export(Add(), (torch.randn(4, 8), torch.randn(4, 8)))
    data = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(3)]
    converted = run_flow(flow, program, SharedAdd, data)
    (annotation,) = [
        n.meta["quantization_annotation"] for n in converted.graph.nodes if n.target == aten.add.Tensor
    ]
    named = _named_nodes(annotation, [])
    assert len(named) == 6  # the two inputs, and the shared edge's two ends twice
    assert all(node.graph is converted.graph for node in named), {
        node.name for node in named if node.graph is not converted.graph
    }
