"""What plugin API 1.1 adds to the contract, each used by an in-process backend on real programs.

A port of ExecuTorch's Arm Ethos-U quantizer had to fake these (issue 41): a whole-graph
annotation stage (data movement annotated from its already-annotated consumers), data the
backend's compiler needs on the nodes it takes, fusion only under a condition, specs for the
program's own inputs and outputs. Also: ``strict`` is no longer one of a backend's options, and a
backend can require a plugin API version.
"""

from __future__ import annotations

import importlib
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

import quantplug
from quantplug.backend import (
    BackendContext,
    BackendInfo,
    BackendOption,
    FusionPattern,
    NamedPass,
    QuantizationAnnotation,
    QuantizationConfig,
    QuantizationSpec,
    RulesModule,
    SharedQuantizationSpec,
    backend_node_data,
    float_reason,
    get_annotation,
    hookimpl,
    is_discarded,
    set_backend_node_data,
    to_exported_program,
)

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed
I8 = QuantizationSpec(dtype=torch.int8, qscheme=torch.per_tensor_affine)
W8 = QuantizationSpec(dtype=torch.int8, qscheme=torch.per_tensor_symmetric)
U8 = QuantizationSpec(dtype=torch.uint8, qscheme=torch.per_tensor_affine)

RULES = """
import torch
from quantplug.backend import annotate_single_in_single_out, annotate_weighted, register_annotator
from quantplug.backend import set_backend_node_data

@register_annotator([torch.ops.aten.linear.default], backend_op="FC")
def linear(node, config):
    annotate_weighted(node, config)
    set_backend_node_data(node, "npu.kernel", "fc")

@register_annotator([torch.ops.aten.relu.default, torch.ops.aten.hardtanh.default], backend_op="Act")
def act(node, config):
    annotate_single_in_single_out(node, config)
"""


class Model(nn.Module):
    """linear -> hardtanh -> reshape (data movement, no rule) -> linear -> relu."""

    def __init__(self, low: float = 0.0) -> None:
        super().__init__()
        self.a, self.b, self.low = nn.Linear(8, 8), nn.Linear(8, 4), low

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.hardtanh(self.a(x), self.low, 6.0)
        return torch.relu(self.b(y.reshape(-1, 8)))


def _program(low: float = 0.0) -> torch.export.ExportedProgram:
    return torch.export.export(Model(low).eval(), (torch.randn(2, 8),))


@pytest.fixture
def rules(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"qp_contract_rules_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(RULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(name)
    return name


def _shares_consumer(gm: torch.fx.GraphModule, context: BackendContext) -> None:
    """Arm's second stage: a reshape takes the encoding its consumer's input already has. (It need
    not check the user's overrides: the core takes annotations off nodes the user keeps float.)"""
    for node in gm.graph.nodes:
        if node.target != aten.reshape.default:
            continue
        consumer = next(iter(node.users))
        spec = get_annotation(consumer).input_qspec_map.get(node) if get_annotation(consumer) else None
        if spec is not None:
            node.meta["quantization_annotation"] = QuantizationAnnotation(
                input_qspec_map={node.args[0]: SharedQuantizationSpec((node, consumer))},
                output_qspec=SharedQuantizationSpec((node, consumer)),
            )


class Npu:
    """A chip that runs hardtanh fused into a linear only as a relu (minimum 0)."""

    def __init__(self, rules: str, *, io: bool = False) -> None:
        self.rules, self.io = rules, io

    @hookimpl
    def quantplug_backend_info(self) -> BackendInfo:
        return BackendInfo(
            name="t_npu",
            description="contract test backend",
            options=(BackendOption("mode", str, "a", choices=("a", "b")),),
            requires_api="1.1",
        )

    @hookimpl
    def quantplug_annotation_rules(self, context: BackendContext) -> list[RulesModule]:
        return [
            RulesModule(self.rules, ["aten.linear.default", "aten.relu.default", "aten.hardtanh.default"])
        ]

    @hookimpl
    def quantplug_quantization_config(
        self, preset: str | None, context: BackendContext
    ) -> QuantizationConfig:
        return QuantizationConfig(I8, I8, W8, None)

    @hookimpl
    def quantplug_fusion_patterns(self, context: BackendContext) -> Sequence[FusionPattern]:
        return [
            FusionPattern(
                [aten.linear.default],
                [aten.hardtanh.default],
                when=lambda head, tail, ctx: tail.args[1] == 0.0,
                name="linear+relu6",
            )
        ]

    @hookimpl
    def quantplug_annotation_passes(self, context: BackendContext) -> Sequence[NamedPass]:
        return [NamedPass("data movement", _shares_consumer)]

    @hookimpl
    def quantplug_io_config(self, context: BackendContext) -> QuantizationConfig | None:
        return QuantizationConfig(U8, U8, None, None) if self.io else None


def _node(gm: torch.fx.GraphModule, target: Any) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.target == target)


def _convert(q: quantplug.Quantizer, program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    prepared = quantplug.prepare(program, q)
    prepared(torch.randn(2, 8))
    return quantplug.convert(prepared)


def test_an_annotation_pass_annotates_from_the_rules_annotations(rules: str) -> None:
    with quantplug.registered_backend("t_npu", Npu(rules)):
        q = quantplug.get_quantizer("t_npu")
        coverage = q.coverage(_program())
        assert coverage.node("reshape").quantized  # no rule: the pass annotated it
        converted = _convert(q, _program())
        reshape = _node(converted, aten.reshape.default)
        # one encoding through the reshape: the quantize before it and the one after it agree
        before, after = reshape.args[0], next(iter(reshape.users))
        assert (
            before.target == qd.dequantize_per_tensor.default
            and after.target == qd.quantize_per_tensor.default
        )
        assert before.args[1:3] == after.args[1:3]


def test_what_a_pass_puts_on_a_node_the_user_keeps_float_is_taken_off(rules: str) -> None:
    with quantplug.registered_backend("t_npu", Npu(rules)):
        q = quantplug.get_quantizer("t_npu").set_node_name("reshape", None)
        gm = q.transform_for_annotation(_program().module())
        q.annotate(gm)
        reshape = _node(gm, aten.reshape.default)
        assert get_annotation(reshape) is None and is_discarded(reshape)
        assert "discarded by override" in (float_reason(reshape) or "")


def test_a_fusion_pattern_fuses_only_where_its_condition_holds(rules: str) -> None:
    with quantplug.registered_backend("t_npu", Npu(rules)):
        q = quantplug.get_quantizer("t_npu")
        assert q.coverage(_program(low=0.0)).node("linear").fused_with == "hardtanh"
        split = q.coverage(_program(low=-1.0))
        assert split.node("linear").fused_with is None and split.node("linear").quantized
        converted = _convert(q, _program(low=-1.0))  # unfused: the linear's output is quantized
        assert [u.target for u in _node(converted, aten.linear.default).users] == [
            qd.quantize_per_tensor.default
        ]


def test_backend_node_data_reaches_lowering_and_the_exported_program(rules: str) -> None:
    with quantplug.registered_backend("t_npu", Npu(rules)):
        converted = _convert(quantplug.get_quantizer("t_npu"), _program())
        linears = [n for n in converted.graph.nodes if n.target == aten.linear.default]
        assert [backend_node_data(n, "npu.kernel") for n in linears] == ["fc", "fc"]
        assert backend_node_data(linears[0]) == {"npu.kernel": "fc"}
        exported = to_exported_program(converted)
        assert [
            backend_node_data(n, "npu.kernel")
            for n in exported.graph_module.graph.nodes
            if n.target == aten.linear.default
        ] == ["fc", "fc"]
    node = torch.fx.Graph().placeholder("x")
    assert backend_node_data(node, "missing", 3) == 3
    set_backend_node_data(node, "k", (1, 2))
    assert backend_node_data(node) == {"k": (1, 2)}


def _io_dtypes(gm: torch.fx.GraphModule) -> tuple[torch.dtype, torch.dtype]:
    """The dtype the program's input is quantized to first, and its output's last dequantize."""
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    first = next(u for u in x.users if u.target == qd.quantize_per_tensor.default)
    last = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert last.target == qd.dequantize_per_tensor.default
    return first.args[-1], last.args[-1]


@pytest.mark.parametrize("how", ["hook", "set_io"])
def test_inputs_and_outputs_get_the_io_specs(rules: str, how: str) -> None:
    """The chip's I/O is uint8 while its ops compute in int8: the program's input is observed as
    uint8 where it enters, its output requantized to uint8 where it leaves."""
    with quantplug.registered_backend("t_npu", Npu(rules, io=how == "hook")):
        q = quantplug.get_quantizer("t_npu")
        if how == "set_io":
            q.set_io(QuantizationConfig(U8, U8, None, None))
        converted = _convert(q, _program())
        assert _io_dtypes(converted) == (torch.uint8, torch.uint8)
        assert converted(torch.randn(2, 8)).shape == (2, 4)
        # set_io(None) overrides the backend's default: I/O as the rules leave them (int8)
        plain = _convert(quantplug.get_quantizer("t_npu").set_io(None), _program())
        assert _io_dtypes(plain) == (torch.int8, torch.int8)


def test_strict_is_not_a_backend_option_but_old_readers_keep_working(rules: str) -> None:
    with quantplug.registered_backend("t_npu", Npu(rules)):
        q = quantplug.get_quantizer("t_npu", strict=False)
        assert q.options == {"mode": "a"} and "strict" not in q.options and len(q.options) == 1
        assert q.strict is False and q.context.strict is False
        with pytest.warns(DeprecationWarning, match="context.strict"):
            assert q.options["strict"] is False
        with pytest.warns(DeprecationWarning):
            assert q.context.options.get("strict") is False
        with pytest.warns(DeprecationWarning):
            assert q.options == {"mode": "a", "strict": False}  # how a 0.1.0 plugin's test compared
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert q.options != {"mode": "b"}
        q.strict = True
        assert q.context.strict is True and q.options == {"mode": "a"}


class _Future(Npu):
    @hookimpl
    def quantplug_backend_info(self) -> BackendInfo:
        return BackendInfo(name="t_future", description="needs a newer quantplug", requires_api="1.99")


def test_a_backend_requiring_a_newer_plugin_api_is_refused_with_the_fix(rules: str) -> None:
    with quantplug.registered_backend("t_future", _Future(rules)):
        with pytest.raises(quantplug.BackendLoadError, match=r"needs plugin API 1\.99.*upgrade quantplug"):
            quantplug.get_quantizer("t_future")
    from quantplug.backend import require_api

    require_api("1.0")
    require_api(quantplug.PLUGIN_API_VERSION)
    with pytest.raises(quantplug.OptionError, match="different major version"):
        require_api("2.0")
    with pytest.raises(quantplug.OptionError, match="MAJOR"):
        require_api("one")
