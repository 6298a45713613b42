"""Hooks through their whole path: how a backend's and its extensions' answers combine, and what
reaches ``prepare``, ``convert`` and the conformance kit.

Every hook spec has a test named after it (``tests/docs/test_hook_documentation.py``); these are
the ones for ``quantplug_fusion_patterns``, ``quantplug_annotation_passes``,
``quantplug_io_config`` and ``quantplug_conformance_profile``. Backends are in-process plugins on
real exported programs.
"""

from __future__ import annotations

import importlib
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import quantplug
from quantplug.backend import (
    BackendContext,
    BackendInfo,
    ConformanceProfile,
    FusionPattern,
    NamedPass,
    QuantizationConfig,
    QuantizationSpec,
    RulesModule,
    SharedQuantizationSpec,
    annotate_node,
    get_annotation,
    hookimpl,
    is_annotated,
)
from quantplug.conformance import run_conformance

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed
I8 = QuantizationSpec(dtype=torch.int8, qscheme=torch.per_tensor_affine)
W8 = QuantizationSpec(dtype=torch.int8, qscheme=torch.per_tensor_symmetric)
U8 = QuantizationSpec(dtype=torch.uint8, qscheme=torch.per_tensor_affine)

RULES = """
import torch
from quantplug.backend import annotate_single_in_single_out, annotate_weighted, register_annotator

@register_annotator([torch.ops.aten.linear.default], backend_op="FC")
def linear(node, config):
    annotate_weighted(node, config)

@register_annotator([torch.ops.aten.relu.default], backend_op="Relu")
def relu(node, config):
    annotate_single_in_single_out(node, config)
"""


@pytest.fixture
def rules(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"qp_hook_rules_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(RULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(name)
    return name


class Net(nn.Module):
    """linear -> relu -> reshape (no rule) -> linear; an integer input passed through to the output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.b(torch.relu(self.a(x)).reshape(-1, 8)), index + 1


def _program() -> torch.export.ExportedProgram:
    return torch.export.export(Net().eval(), (torch.randn(2, 8), torch.arange(3)))


def _convert(q: quantplug.Quantizer) -> torch.fx.GraphModule:
    prepared = quantplug.prepare(_program(), q)
    for seed in range(2):
        prepared(torch.randn(2, 8, generator=torch.Generator().manual_seed(seed)), torch.arange(3))
    return quantplug.convert(prepared)


def _node(gm: torch.fx.GraphModule, target: Any) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.target == target)


class Extension:
    """An extension of it: hooks answering what it is given (None when not given)."""

    def __init__(self, **answers: Any) -> None:
        self.answers = answers

    @hookimpl
    def quantplug_fusion_patterns(self, context: BackendContext) -> Sequence[FusionPattern]:
        return self.answers.get("fusion", [])

    @hookimpl
    def quantplug_annotation_passes(self, context: BackendContext) -> Sequence[NamedPass]:
        return self.answers.get("passes", [])

    @hookimpl
    def quantplug_io_config(self, context: BackendContext) -> QuantizationConfig | None:
        return self.answers.get("io")

    @hookimpl
    def quantplug_conformance_profile(self, context: BackendContext) -> ConformanceProfile | None:
        return self.answers.get("profile")


class Chip(Extension):
    """A backend whose hooks' answers are given to it (as its extension's are): the rules above,
    an int8 config."""

    def __init__(self, rules: str, **answers: Any) -> None:
        super().__init__(**answers)
        self.rules = rules

    @hookimpl
    def quantplug_backend_info(self) -> BackendInfo:
        return BackendInfo(name="t_hooks", description="hook contract test backend")

    @hookimpl
    def quantplug_annotation_rules(self, context: BackendContext) -> list[RulesModule]:
        return [RulesModule(self.rules, ["aten.linear.default", "aten.relu.default"])]

    @hookimpl
    def quantplug_quantization_config(
        self, preset: str | None, context: BackendContext
    ) -> QuantizationConfig:
        return QuantizationConfig(I8, I8, W8, None)


# -- quantplug_annotation_rules ----------------------------------------------------------------

FAILING_RULES = """
import torch
import quantplug
from quantplug.backend import register_annotator

RAISE = [quantplug.AnnotationError("this linear has no weight the chip can store")]

@register_annotator([torch.ops.aten.linear.default], backend_op="FC")
def linear(node, config):
    raise RAISE[0]
"""


def test_annotation_rules_raising_a_quantplug_error_reach_the_user_as_raised(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule's own verdict (``AnnotationError``) is the user's error as the rule raised it; any other
    exception is the rule's bug, wrapped in a ``BackendFailedError`` (a ``BackendLoadError``) naming
    the rule and the node, and saying it is the plugin's defect."""
    name = f"qp_failing_rules_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(FAILING_RULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    with quantplug.registered_backend("t_hooks", Chip(name)):
        with pytest.raises(quantplug.AnnotationError, match="no weight the chip can store"):
            quantplug.prepare(_program(), quantplug.get_quantizer("t_hooks"))
        module.RAISE[0] = ZeroDivisionError("division by zero")
        with pytest.raises(quantplug.BackendFailedError) as caught:
            quantplug.prepare(_program(), quantplug.get_quantizer("t_hooks"))
    assert "failed in rule linear on node 'linear' (aten.linear.default)" in str(caught.value)
    assert "ZeroDivisionError" in str(caught.value) and "defect of that plugin" in str(caught.value)
    assert "failed to load" not in str(caught.value)
    assert isinstance(caught.value, quantplug.BackendLoadError)  # what 0.1.0's callers caught
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


# -- quantplug_fusion_patterns -----------------------------------------------------------------

LINEAR_RELU = FusionPattern([aten.linear.default], [aten.relu.default], when_tail_float="quantize_head")
WHOLE_KERNEL = FusionPattern([aten.linear.default], [aten.relu.default], when_tail_float="float")


def test_fusion_patterns_fuse_on_the_program_and_an_extensions_pattern_wins_its_head(rules: str) -> None:
    with quantplug.registered_backend("t_hooks", Chip(rules, fusion=[LINEAR_RELU])):
        converted = _convert(quantplug.get_quantizer("t_hooks"))
        relu = _node(converted, aten.relu.default)
        assert relu.args[0].target == aten.linear.default  # one kernel: no encoding between
        kept_float = quantplug.get_quantizer("t_hooks").set_node_name("relu", None)
        linear = kept_float.coverage(_program()).node("linear")
        assert linear.quantized and linear.fused_with is None  # "quantize_head": the linear alone
    # an extension declares the pair whole-or-nothing: declared later, it wins for the head
    with quantplug.registered_backend(
        "t_hooks", Chip(rules, fusion=[LINEAR_RELU]), Extension(fusion=[WHOLE_KERNEL])
    ):
        kept_float = quantplug.get_quantizer("t_hooks").set_node_name("relu", None)
        linear = kept_float.coverage(_program()).node("linear")
        assert not linear.quantized and "when_tail_float='float'" in linear.reason


# -- quantplug_annotation_passes ---------------------------------------------------------------


def _reshape_from_consumer(
    seen: list[tuple[str, bool]],
) -> Callable[[torch.fx.GraphModule, BackendContext], None]:
    def stage(gm: torch.fx.GraphModule, context: BackendContext) -> None:
        reshape = _node(gm, aten.reshape.default)
        seen.append(("backend", is_annotated(reshape)))
        consumer = next(iter(reshape.users))
        if get_annotation(consumer).input_qspec_map.get(reshape) is not None:
            shared = SharedQuantizationSpec((reshape, consumer))
            annotate_node(reshape, {reshape.args[0]: shared}, shared)

    return stage


def _observe(seen: list[tuple[str, bool]]) -> Callable[[torch.fx.GraphModule, BackendContext], None]:
    def stage(gm: torch.fx.GraphModule, context: BackendContext) -> None:
        seen.append(("extension", is_annotated(_node(gm, aten.reshape.default))))

    return stage


def test_annotation_passes_run_after_every_rule_backend_first_then_extensions(rules: str) -> None:
    seen: list[tuple[str, bool]] = []
    backend = Chip(rules, passes=[NamedPass("reshape", _reshape_from_consumer(seen))])
    extension = Extension(passes=[NamedPass("observe", _observe(seen))])
    with quantplug.registered_backend("t_hooks", backend, extension):
        q = quantplug.get_quantizer("t_hooks")
        assert q.coverage(_program()).node("reshape").quantized  # no rule: the backend's stage
        assert seen == [("backend", False), ("extension", True)]
        converted = _convert(q)
    reshape = _node(converted, aten.reshape.default)
    before, after = reshape.args[0], next(iter(reshape.users))
    assert before.target == qd.dequantize_per_tensor.default
    assert after.target == qd.quantize_per_tensor.default
    assert before.args[1:] == after.args[1:]  # one encoding through the reshape


def test_annotation_passes_that_fail_name_the_pass_and_keep_the_cause(rules: str) -> None:
    def broken_stage(gm: torch.fx.GraphModule, context: BackendContext) -> None:
        raise KeyError("no consumer")

    with quantplug.registered_backend(
        "t_hooks", Chip(rules, passes=[NamedPass("data movement", broken_stage)])
    ):
        with pytest.raises(quantplug.BackendFailedError) as caught:
            quantplug.prepare(_program(), quantplug.get_quantizer("t_hooks"))
    error = caught.value
    assert "failed in annotation pass 'data movement'" in str(error)
    assert "KeyError: 'no consumer'" in str(error)
    # the wrapper's traceback ends in the core; the pass's own frame is in the chained cause
    assert isinstance(error.__cause__, KeyError)
    assert traceback.extract_tb(error.__cause__.__traceback__)[-1].name == "broken_stage"


# -- quantplug_io_config -----------------------------------------------------------------------


def _io(gm: torch.fx.GraphModule) -> tuple[dict[str, Any], list[Any]]:
    """The grid each program input is quantized to where it enters (None: stays float), and each
    output's last dequantize (None: returned as computed)."""
    inputs = {
        n.name: next((u.args[-1] for u in n.users if u.target == qd.quantize_per_tensor.default), None)
        for n in gm.graph.nodes
        if n.op == "placeholder"
    }
    returned = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outputs = [v.args[-1] if v.target == qd.dequantize_per_tensor.default else None for v in returned]
    return inputs, outputs


def test_io_config_quantizes_float_inputs_and_outputs_and_an_extension_overrides_it(rules: str) -> None:
    u8_io = QuantizationConfig(U8, U8, None, None)
    with quantplug.registered_backend("t_hooks", Chip(rules)):  # no I/O specs: the rules decide
        assert _io(_convert(quantplug.get_quantizer("t_hooks"))) == (
            {"x": torch.int8, "index": None},
            [torch.int8, None],
        )
    with quantplug.registered_backend("t_hooks", Chip(rules, io=u8_io), Extension()):  # None defers
        q = quantplug.get_quantizer("t_hooks")
        assert q.io_config == u8_io
        # the float input enters as uint8 (then requantized to the rules' int8), the integer one
        # is untouched; the float output leaves as uint8
        assert _io(_convert(q)) == ({"x": torch.uint8, "index": None}, [torch.uint8, None])
    i8_io = QuantizationConfig(I8, None, None, None)
    with quantplug.registered_backend("t_hooks", Chip(rules, io=u8_io), Extension(io=i8_io)):
        q = quantplug.get_quantizer("t_hooks")
        assert q.io_config == i8_io  # the extension's answer wins
        assert _io(_convert(q)) == ({"x": torch.int8, "index": None}, [torch.int8, None])
        assert quantplug.get_quantizer("t_hooks").set_io(None).io_config is None  # the user's word last


# -- quantplug_conformance_profile -------------------------------------------------------------


def _lowering_case(name: str) -> Any:
    report = run_conformance(name, only=["lowering"])
    (check,) = report.checks
    (case,) = check.cases
    return case


def test_conformance_profile_states_what_the_kit_skips_and_an_extension_overrides_it(rules: str) -> None:
    later = ConformanceProfile(unsupported={"lowering": "the compiler ships in Q3"})
    with quantplug.registered_backend("t_hooks", Chip(rules)):  # no writer, no profile: a failure
        case = _lowering_case("t_hooks")
        assert case.status == "fail" and "artifact writer" in case.message
    with quantplug.registered_backend("t_hooks", Chip(rules, profile=later), Extension()):
        case = _lowering_case("t_hooks")
        assert case.status == "skip" and "the compiler ships in Q3" in case.message
    sooner = ConformanceProfile(unsupported={"lowering": "the extension's compiler is in beta"})
    with quantplug.registered_backend("t_hooks", Chip(rules, profile=later), Extension(profile=sooner)):
        assert "the extension's compiler is in beta" in _lowering_case("t_hooks").message
