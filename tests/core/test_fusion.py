"""Fusion the core understands: declared patterns, decided from both nodes' configs, truthful coverage.

The decision is a pure function over names (hypothesis below); the rest runs real exported
models through the shipped ``reference`` backend (which declares conv/linear/add + relu with the
``"quantize_head"`` fallback), ``qnn_htp`` (no fusion; its sharing hook closes float regions) and
an in-process backend declaring the ``"float"`` fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import quantplug
from _quantplug.annotation.specs import get_annotation
from _quantplug.quantizer.fusion import FusionPattern, OpNode, fused_head, plan_fusions
from quantplug import BackendContext, BackendInfo, QuantizationConfig, QuantizationSpec, RulesModule

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed

# --- the decision, on names ----------------------------------------------------------------------


@st.composite
def chains(draw: st.DrawFn) -> tuple[list[OpNode], set[str], str]:
    """A chain of ops (each feeding the next), which of them the user quantizes, and a fallback."""
    ops = draw(st.lists(st.sampled_from(["conv", "relu", "add"]), min_size=1, max_size=6))
    names = [f"n{i}" for i in range(len(ops))]
    nodes = [
        OpNode(name, op, (names[i + 1],) if i + 1 < len(ops) else (), names[i - 1] if i else None)
        for i, (name, op) in enumerate(zip(names, ops))
    ]
    quantized = set(draw(st.lists(st.sampled_from(names), unique=True)))
    return nodes, quantized, draw(st.sampled_from(["quantize_head", "float"]))


@given(chains())
def test_plan_fuses_exactly_the_pairs_whose_both_ends_are_quantized(
    case: tuple[list[OpNode], set[str], str],
) -> None:
    nodes, quantized, fallback = case
    pattern = FusionPattern(["conv", "add"], ["relu"], when_tail_float=fallback)
    plan = plan_fusions(nodes, [pattern], lambda name: name in quantized)
    by_name = {n.name: n for n in nodes}
    for head in nodes:
        tail = by_name.get(head.users[0]) if head.users else None
        matches = tail is not None and head.op in ("conv", "add") and tail.op == "relu"
        if not matches or head.name not in quantized:
            assert (
                head.name not in plan.fused
                and head.name not in plan.float_heads
                and head.name not in plan.split
            )
            continue
        assert tail is not None
        if tail.name in quantized:
            assert plan.fused[head.name] == tail.name
        elif fallback == "float":
            assert plan.float_heads[head.name] == tail.name
        else:
            assert plan.split[head.name] == tail.name
    # every node is in at most one role per side
    assert not set(plan.fused) & set(plan.float_heads)


def test_later_patterns_win_and_a_head_with_two_users_never_fuses() -> None:
    nodes = [OpNode("c", "conv", ("r",), None), OpNode("r", "relu", (), "c")]
    first = FusionPattern(["conv"], ["relu"], when_tail_float="quantize_head")
    second = FusionPattern(["conv"], ["relu"], when_tail_float="float")
    assert plan_fusions(nodes, [first, second], lambda n: n == "c").float_heads == {"c": "r"}
    branched = [
        OpNode("c", "conv", ("r", "x"), None),
        OpNode("r", "relu", (), "c"),
        OpNode("x", "relu", (), "c"),
    ]
    assert not plan_fusions(branched, [first], lambda n: True)


def test_fusion_pattern_data_is_checked() -> None:
    with pytest.raises(ValueError, match="when_tail_float"):
        FusionPattern(["aten.conv2d.default"], ["aten.relu.default"], when_tail_float="drop")
    with pytest.raises(ValueError, match="at least one"):
        FusionPattern([], ["aten.relu.default"])
    assert FusionPattern([aten.conv2d.default], ["aten.relu.default"]).heads == {"aten.conv2d.default"}


# --- real graphs --------------------------------------------------------------------------------


class ConvRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)) * 2


def _program() -> torch.export.ExportedProgram:
    return torch.export.export(ConvRelu().eval(), (torch.randn(1, 3, 8, 8),))


def _converted(q: quantplug.Quantizer) -> torch.fx.GraphModule:
    prepared = quantplug.prepare(_program(), q)
    with torch.no_grad():
        prepared(torch.randn(1, 3, 8, 8))
    return quantplug.convert(prepared)


def _node(gm: torch.fx.GraphModule, target: Any) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.target == target)


def test_reference_fuses_conv_and_relu_through_the_core() -> None:
    q = quantplug.get_quantizer("reference", activation_observer="minmax")
    coverage = q.coverage(_program())
    assert coverage.node("conv2d").fused_with == "relu" and coverage.node("relu").fused_with == "conv2d"
    assert coverage.node("conv2d").quantized and "conv2d+relu" in coverage.format()
    converted = _converted(q)
    relu = _node(converted, aten.relu.default)
    assert relu.args[0].target == aten.conv2d.default  # no Q/DQ inside the fused pair
    assert [u.target for u in relu.users] == [qd.quantize_per_tensor.default]


def test_reference_relu_kept_float_leaves_the_conv_quantized_on_its_own() -> None:
    """The issue's case: ``set_node_name("relu", None)`` after a conv that fuses it."""
    q = quantplug.get_quantizer("reference", activation_observer="minmax").set_node_name("relu", None)
    coverage = q.coverage(_program())
    conv, relu = coverage.node("conv2d"), coverage.node("relu")
    assert conv.quantized and conv.fused_with is None and not conv.note
    assert not relu.quantized and "discarded by override" in relu.reason
    converted = _converted(q)
    conv_node = _node(converted, aten.conv2d.default)
    assert [u.target for u in conv_node.users] == [qd.quantize_per_tensor.default]  # its output is quantized
    assert _node(converted, aten.relu.default).args[0].target == qd.dequantize_per_tensor.default


def test_reference_relu_after_a_float_conv_quantizes_its_output_only() -> None:
    """No fusion with a float head; the reference's relu then reads the float value directly."""
    q = quantplug.get_quantizer("reference", activation_observer="minmax").set_node_name("conv2d", None)
    gm = q.transform_for_annotation(_program().module())
    q.annotate(gm)
    relu = next(n for n in gm.graph.nodes if n.target == aten.relu.default)
    ann = get_annotation(relu)
    assert fused_head(relu) is None and not ann.input_qspec_map and ann.output_qspec is not None


U8 = QuantizationSpec(dtype=torch.uint8, qscheme=torch.per_tensor_affine)
W8 = QuantizationSpec(dtype=torch.int8, qscheme=torch.per_tensor_symmetric)

RULES_SOURCE = """
import torch
from quantplug import annotate_single_in_single_out, annotate_weighted, register_annotator
from _quantplug.quantizer.fusion import fused_tail

SEEN = []

@register_annotator([torch.ops.aten.conv2d.default], backend_op="Conv")
def conv(node, config, context):
    relu = next(iter(node.users))
    SEEN.append((node.name, fused_tail(node) is not None, context.config_for(relu) is not None))
    annotate_weighted(node, config)  # quantizes the output even when fused: the core removes it

@register_annotator([torch.ops.aten.relu.default, torch.ops.aten.mul.Tensor], backend_op="Act")
def act(node, config):
    annotate_single_in_single_out(node, config)
"""


@pytest.fixture
def rules_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    import importlib
    import uuid

    name = f"qp_fusion_rules_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(RULES_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


class WholeOrNothing:
    """A chip whose only conv kernel has the relu built in: a float relu makes the conv float."""

    def __init__(self, rules: str) -> None:
        self.rules = rules

    @quantplug.hookimpl
    def quantplug_backend_info(self) -> BackendInfo:
        return BackendInfo(name="t_fuse", description="fusion test backend")

    @quantplug.hookimpl
    def quantplug_annotation_rules(self, context: BackendContext) -> list[RulesModule]:
        return [RulesModule(self.rules, ["aten.conv2d.default", "aten.relu.default", "aten.mul.Tensor"])]

    @quantplug.hookimpl
    def quantplug_quantization_config(
        self, preset: str | None, context: BackendContext
    ) -> QuantizationConfig:
        return QuantizationConfig(U8, U8, W8, None)

    @quantplug.hookimpl
    def quantplug_fusion_patterns(self, context: BackendContext) -> Sequence[FusionPattern]:
        return [FusionPattern([aten.conv2d.default], [aten.relu.default], when_tail_float="float")]


def test_whole_pattern_float_when_the_backend_declares_it(rules_module: Any) -> None:
    with quantplug.registered_backend("t_fuse", WholeOrNothing(rules_module.__name__)):
        q = quantplug.get_quantizer("t_fuse")
        converted = _converted(q)
        relu = _node(converted, aten.relu.default)
        assert relu.args[0].target == aten.conv2d.default  # fused, although the rule quantized conv's output
        assert rules_module.SEEN[-1] == ("conv2d", True, True)

        q = quantplug.get_quantizer("t_fuse").set_node_name("relu", None)
        runs = len(rules_module.SEEN)
        coverage = q.coverage(_program())
        conv = coverage.node("conv2d")
        assert not conv.quantized and "fused with 'relu', which stays float" in conv.reason
        assert "when_tail_float='float'" in conv.reason
        assert coverage.node("mul").quantized  # the rest of the graph is unaffected
        converted = _converted(q)
        conv_node = _node(converted, aten.conv2d.default)
        assert all(a.op != "call_function" for a in conv_node.args[:2])  # float input and weight
        assert len(rules_module.SEEN) == runs  # the conv rule never ran: the whole pattern is float

        # a float head: no fusion, the tail's rule runs on its own (input and output quantized)
        q = quantplug.get_quantizer("t_fuse").set_node_name("conv2d", None)
        gm = q.transform_for_annotation(_program().module())
        q.annotate(gm)
        relu = next(n for n in gm.graph.nodes if n.target == aten.relu.default)
        assert fused_head(relu) is None and get_annotation(relu).input_qspec_map


def test_context_config_for_needs_a_quantizer() -> None:
    with pytest.raises(quantplug.QuantplugError, match="config_for"):
        BackendContext("x", {}).config_for(None)  # type: ignore[arg-type]


def test_qnn_htp_coverage_reports_an_output_its_sharing_drops() -> None:
    """qnn_htp fuses nothing (QNN runs conv and relu as separate ops); its sharing hook keeps the
    edges of a discarded node float, so a conv whose only consumer is discarded has a float
    output: coverage says so instead of calling the conv fully quantized."""
    pytest.importorskip("quantplug_qnn_htp")
    q = quantplug.get_quantizer("qnn_htp").set_node_name("relu", None)
    coverage = q.coverage(_program())
    conv = coverage.node("conv2d")
    assert conv.quantized and conv.note.startswith("output float")
    assert "note conv2d" in coverage.format()
    plain = quantplug.get_quantizer("qnn_htp").coverage(_program())
    assert not plain.node("conv2d").note and plain.node("conv2d").fused_with is None
