"""Constraints v2: relations between ports and limits on calibrated values.

The rules are pure functions over plain values (``_quantplug.validation.relations``), driven here
by hypothesis; the torch-facing side (prepare, convert, the report, ``strict``) runs on real
exported models with in-process backends.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.fx import GraphModule, Node

import quantplug
from _quantplug.meta import CALIBRATED_REPORT_KEY, STATE_KEY
from _quantplug.validation.constraints import OUTPUT, RequantRatio, SameEncoding, SameScale, ScaleProduct
from _quantplug.validation.relations import (
    Encoding,
    PortFacts,
    check_port_values,
    check_static,
    check_values,
    share_merges,
)
from quantplug import (
    BackendContext,
    BackendInfo,
    ConstraintViolationError,
    DerivedQuantizationSpec,
    FixedQParamsQuantizationSpec,
    NamedPass,
    OpConstraint,
    PortConstraint,
    QuantizationConfig,
    QuantizationSpec,
    RulesModule,
    ValidationReport,
    Violation,
    derived_bias_spec,
)

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed

# --- pure rules: strategies ----------------------------------------------------------------------

scales = st.floats(min_value=1e-6, max_value=10.0, allow_nan=False, allow_infinity=False)
zero_points = st.integers(min_value=0, max_value=255)


def u8(scale: Sequence[float] | float, zp: Sequence[int] | int = 0) -> Encoding:
    s = tuple(scale) if isinstance(scale, (list, tuple)) else (float(scale),)
    z = tuple(zp) if isinstance(zp, (list, tuple)) else (int(zp),)
    return Encoding(s, z, "uint8", 0, 255)


@given(scales, zero_points, st.permutations([0, 1, OUTPUT]))
def test_same_encoding_holds_for_equal_encodings_in_any_port_order(
    s: float, z: int, order: list[Any]
) -> None:
    relation = SameEncoding(tuple(order))
    assert check_values(relation, {0: u8(s, z), 1: u8(s, z), OUTPUT: u8(s, z)}) == []


@given(scales, st.floats(min_value=1e-4, max_value=0.5), st.booleans())
def test_same_scale_detects_any_difference_beyond_rtol(s: float, rel: float, up: bool) -> None:
    other = s * (1 + rel) if up else s / (1 + rel)
    relation = SameScale((0, 1), rtol=1e-6)
    problems = check_values(relation, {0: u8(s, 3), 1: u8(other, 200)})
    assert [p.rule for p in problems] == ["same scale"]
    assert "input 0" in problems[0].actual and "input 1" in problems[0].actual
    # zero points may differ for SameScale, never for SameEncoding
    assert check_values(relation, {0: u8(s, 3), 1: u8(s * (1 + 1e-9), 200)}) == []
    assert check_values(SameEncoding((0, 1)), {0: u8(s, 3), 1: u8(s, 200)})[0].rule == "same encoding"


def test_same_scale_reads_as_output_equals_input_and_skips_float_ports() -> None:
    relation = SameScale((0, OUTPUT))
    assert relation.rule == "output scale = input scale"
    assert check_values(relation, {0: u8(0.1)}) == []  # the output is float: nothing to compare
    assert check_values(relation, {0: u8(0.1), OUTPUT: u8(0.2)})[0].rule == "output scale = input scale"


@given(scales, st.lists(scales, min_size=1, max_size=8), st.floats(min_value=1e-3, max_value=0.5))
def test_scale_product_per_channel(act: float, weight: list[float], bump: float) -> None:
    relation = ScaleProduct(2, (0, 1), rtol=1e-5)
    bias = [act * w for w in weight]
    encodings = {0: u8(act), 1: Encoding(tuple(weight), (0,) * len(weight), "int8", -127, 127)}
    assert (
        check_values(
            relation, {**encodings, 2: Encoding(tuple(bias), (0,) * len(bias), "int32", -(2**31), 2**31 - 1)}
        )
        == []
    )
    wrong = list(bias)
    wrong[-1] *= 1 + bump
    found = check_values(
        relation, {**encodings, 2: Encoding(tuple(wrong), (0,) * len(wrong), "int32", -(2**31), 2**31 - 1)}
    )
    assert [p.rule for p in found] == ["scale product"]
    if len(weight) > 1:
        assert f"channel {len(weight) - 1}" in found[0].expected


def test_scale_product_with_incompatible_lengths_is_reported() -> None:
    relation = ScaleProduct(2, (0, 1))
    found = check_values(relation, {0: u8(0.1), 1: u8([0.1, 0.2, 0.3]), 2: u8([0.01, 0.02])})
    assert found and "incompatible lengths" in found[0].actual


@given(
    st.lists(scales, min_size=1, max_size=4),
    scales,
    scales,
    st.floats(min_value=1e-6, max_value=1e6),
    st.floats(min_value=1e-6, max_value=1e6),
)
def test_requant_ratio_matches_its_definition_and_is_monotone_in_its_bounds(
    weight: list[float], act: float, out: float, a: float, b: float
) -> None:
    low, high = min(a, b), max(a, b)
    encodings = {0: u8(act), 1: u8(weight), OUTPUT: u8(out)}
    ratios = [act * w / out for w in weight]
    found = check_values(RequantRatio((0, 1), OUTPUT, minimum=low, maximum=high), encodings)
    assert bool(found) == any(not (low <= r <= high) for r in ratios)
    wider = check_values(RequantRatio((0, 1), OUTPUT, minimum=low / 2, maximum=high * 2), encodings)
    assert len(wider) <= len(found)  # widening the bounds never adds a violation


@given(
    st.lists(scales, min_size=1, max_size=6), st.lists(zero_points, min_size=1, max_size=6), scales, scales
)
def test_port_limits(scale: list[float], zp: list[int], a: float, b: float) -> None:
    low, high = min(a, b), max(a, b)
    enc = Encoding(tuple(scale), tuple(zp), "uint8", 0, 255)
    rules = {p.rule for p in check_port_values(OUTPUT, enc, (low, high), (10, 200))}
    assert ("scale range" in rules) == any(not (low <= s <= high) for s in scale)
    assert ("zero point range" in rules) == any(not (10 <= z <= 200) for z in zp)


def test_nan_scale_breaks_every_limit_and_relation() -> None:
    nan = Encoding((math.nan,), (0,), "uint8", 0, 255)
    assert check_port_values(0, nan, (0.0, math.inf), None)
    assert check_values(SameScale((0, 1)), {0: nan, 1: nan})


plain = st.builds(lambda g: PortFacts(g, "plain", ("uint8", 0, 255)), st.integers(0, 3))


@given(st.lists(plain, min_size=2, max_size=4))
def test_static_same_scale_needs_one_group_for_measured_ports(facts: list[PortFacts]) -> None:
    by_port = dict(enumerate(facts))
    relation = SameScale(tuple(range(len(facts))))
    problems = check_static(relation, by_port)
    assert bool(problems) == (len({f.group for f in facts}) > 1)
    assert check_static(relation, {p: PortFacts(None, f.kind, f.grid) for p, f in by_port.items()}) == []


def test_static_checks_of_fixed_derived_and_dynamic_ports() -> None:
    fixed = PortFacts(1, "fixed", ("uint8", 0, 255), encoding=u8(1 / 256))
    other_fixed = PortFacts(2, "fixed", ("uint8", 0, 255), encoding=u8(1 / 128))
    assert (
        check_static(
            SameScale((0, 1)), {0: fixed, 1: PortFacts(2, "fixed", fixed.grid, encoding=u8(1 / 256))}
        )
        == []
    )
    assert check_static(SameScale((0, 1)), {0: fixed, 1: other_fixed})[0].rule == "same scale"
    dynamic = PortFacts(3, "dynamic", ("uint8", 0, 255))
    assert check_static(SameScale((0, 1)), {0: fixed, 1: dynamic}) == []  # known only at run time
    grids = {0: PortFacts(1, "plain", ("uint8", 0, 255)), 1: PortFacts(1, "plain", ("int8", -128, 127))}
    assert check_static(SameEncoding((0, 1)), grids)[0].expected == "one grid"
    product = ScaleProduct(2, (0, 1))
    act, weight = PortFacts(0, "plain", ("uint8", 0, 255)), PortFacts(1, "plain", ("int8", -127, 127))
    good = PortFacts(2, "derived", ("int32", -(2**31), 2**31 - 1), derived_from=frozenset({0, 1}))
    assert check_static(product, {0: act, 1: weight, 2: good}) == []
    elsewhere = PortFacts(2, "derived", good.grid, derived_from=frozenset({0, 5}))
    assert "groups [0, 5]" in check_static(product, {0: act, 1: weight, 2: elsewhere})[0].actual
    measured = PortFacts(2, "plain", good.grid)
    assert "DerivedQuantizationSpec" in check_static(product, {0: act, 1: weight, 2: measured})[0].expected
    assert check_static(product, {0: act, 1: weight}) == []  # a float bias is coverage, not a violation


@given(st.lists(st.sampled_from(["a", "b"]), min_size=2, max_size=5))
def test_share_merges_join_the_ports_that_agree_with_the_first(signatures: list[str]) -> None:
    ports = tuple(range(len(signatures)))
    keys = {p: f"k{p}" for p in ports}
    merges = share_merges(SameScale(ports, enforce="share"), keys, dict(enumerate(signatures)))
    joined = {b for _, b in merges} | {a for a, _ in merges}
    expected = {f"k{p}" for p, s in enumerate(signatures) if s == signatures[0]}
    assert joined == (expected if len(expected) > 1 else set())
    assert share_merges(SameScale(ports), keys, dict(enumerate(signatures))) == []  # "check" never merges


@pytest.mark.parametrize(
    "build",
    [
        lambda: SameScale((0,)),
        lambda: SameScale((0, 0)),
        lambda: SameScale((0, 1), enforce="merge"),
        lambda: SameEncoding((0, -1)),
        lambda: RequantRatio((0,), OUTPUT),
        lambda: RequantRatio((0,), OUTPUT, minimum=2.0, maximum=1.0),
        lambda: PortConstraint(scale_range=(1.0, 0.5)),
        lambda: PortConstraint(scale_range=(-1.0, 0.0)),
        lambda: OpConstraint("X", relations=("same scale",)),  # type: ignore[arg-type]
    ],
)
def test_bad_constraint_data_is_rejected_when_built(build: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        build()


# --- on real graphs -----------------------------------------------------------------------------

U8 = QuantizationSpec(dtype=torch.uint8, qscheme=torch.per_tensor_affine)
W8 = QuantizationSpec(
    dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0
)

RULES_SOURCE = """
import torch
from quantplug import annotate_binary, annotate_weighted, register_annotator

@register_annotator([torch.ops.aten.add.Tensor], backend_op="Add")
def add(node, config):
    annotate_binary(node, config)

@register_annotator([torch.ops.aten.linear.default], backend_op="Dense")
def dense(node, config):
    annotate_weighted(node, config)
"""


@pytest.fixture
def rules_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    import uuid

    name = f"qp_v2_rules_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(RULES_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + y * 3  # add's inputs have different ranges


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)


def _program() -> torch.export.ExportedProgram:
    return torch.export.export(Net().eval(), _inputs(0))


def _bias_times(factor: float) -> Callable[[Node], DerivedQuantizationSpec]:
    """A derived bias whose scale is ``factor`` x input x weight (1.0: the right one)."""

    def spec(node: Node) -> DerivedQuantizationSpec:
        right = derived_bias_spec(node, weight_spec=W8)

        def derive(observers: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
            scale, zp = right.derive_qparams_fn(observers)
            return scale * factor, zp

        return DerivedQuantizationSpec(**{**right.__dict__, "derive_qparams_fn": derive})

    return spec


class V2Backend:
    """Constraints given per test; records what its lowering pass saw of ``strict``."""

    def __init__(
        self,
        rules: str,
        constraints: dict[str, OpConstraint],
        *,
        bias: Any = None,
        lowering_report: ValidationReport | None = None,
    ) -> None:
        self.rules = rules
        self.table = constraints
        self.bias = _bias_times(1.0) if bias is None else bias
        self.lowering_report = lowering_report
        self.seen_strict: list[bool] = []

    @quantplug.hookimpl
    def quantplug_backend_info(self) -> BackendInfo:
        return BackendInfo(name="t_v2", description="constraints v2 test backend")

    @quantplug.hookimpl
    def quantplug_annotation_rules(self, context: BackendContext) -> list[RulesModule]:
        return [RulesModule(self.rules, ["aten.add.Tensor", "aten.linear.default"])]

    @quantplug.hookimpl
    def quantplug_quantization_config(
        self, preset: str | None, context: BackendContext
    ) -> QuantizationConfig:
        return QuantizationConfig(U8, U8, W8, self.bias)

    @quantplug.hookimpl
    def quantplug_op_constraints(
        self, op: str, backend_op: str | None, context: BackendContext
    ) -> list[OpConstraint]:
        found = self.table.get(backend_op or "")
        return [found] if found else []

    @quantplug.hookimpl
    def quantplug_lowering_passes(self, context: BackendContext) -> list[NamedPass]:
        def check(gm: GraphModule, ctx: BackendContext) -> None:
            self.seen_strict.append(ctx.options["strict"])
            if self.lowering_report is not None:
                self.lowering_report.enforce(ctx.strict)

        return [NamedPass("check", check)]

    @quantplug.hookimpl
    def quantplug_artifact_writer(
        self, context: BackendContext
    ) -> Callable[[GraphModule, BackendContext], Any]:
        return lambda gm, ctx: quantplug.Artifact(backend=ctx.backend)


def _calibrated(q: quantplug.Quantizer) -> GraphModule:
    prepared = quantplug.prepare(_program(), q)
    with torch.no_grad():
        for seed in range(3):
            prepared(*_inputs(seed))
    return prepared


ADD_SAME_SCALE = SameScale((0, 1), description="the adder adds raw integers")


def test_add_inputs_on_separate_observers_violate_at_prepare(rules_module: str) -> None:
    backend = V2Backend(
        rules_module, {"Add": OpConstraint("Add", relations=(ADD_SAME_SCALE,), source="test table")}
    )
    with quantplug.registered_backend("t_v2", backend):
        with pytest.raises(ConstraintViolationError) as info:
            quantplug.prepare(_program(), quantplug.get_quantizer("t_v2"))
    (violation,) = info.value.report.violations
    assert (violation.node, violation.rule, violation.port, violation.stage) == (
        "add",
        "same scale",
        "input 0, input 1",
        "prepare",
    )
    assert "calibrated separately" in violation.actual
    text = str(info.value)
    assert (
        "the adder adds raw integers" in text and "source: test table" in text
    )  # description and source shown


def test_add_inputs_non_strict_warn_at_prepare_and_again_at_convert(
    rules_module: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = V2Backend(rules_module, {"Add": OpConstraint("Add", relations=(ADD_SAME_SCALE,))})
    with quantplug.registered_backend("t_v2", backend):
        q = quantplug.get_quantizer("t_v2", strict="false")  # text, as from the command line
        with caplog.at_level(logging.WARNING, logger="quantplug.validation"):
            prepared = _calibrated(q)
            converted = quantplug.convert(prepared)
    assert not prepared.meta[STATE_KEY].validation.ok
    calibrated = converted.meta[CALIBRATED_REPORT_KEY]
    assert [(v.node, v.rule, v.stage) for v in calibrated.violations] == [("add", "same scale", "convert")]
    messages = [r.getMessage() for r in caplog.records]
    assert any("same scale (convert)" in m for m in messages)


def test_enforce_share_satisfies_the_relation_by_construction(rules_module: str) -> None:
    shared = SameScale((0, 1), enforce="share")
    backend = V2Backend(rules_module, {"Add": OpConstraint("Add", relations=(shared,))})
    with quantplug.registered_backend("t_v2", backend):
        q = quantplug.get_quantizer("t_v2")
        prepared = _calibrated(q)  # strict: would raise on any violation
        converted = quantplug.convert(prepared)
    group_of = prepared.meta[STATE_KEY].group_of
    assert group_of[("linear", "add")] == group_of[("mul", "add")]
    add = next(n for n in converted.graph.nodes if n.target == aten.add.Tensor)
    assert add.args[0].args[1:3] == add.args[1].args[1:3]  # one scale and zero point
    assert converted.meta[CALIBRATED_REPORT_KEY].ok
    coverage = q.coverage(_program())  # resolves sharing with the relation's merge too
    assert coverage.node("add").quantized and not coverage.node("add").note


def test_bias_scale_product_is_checked_at_prepare_and_at_convert(rules_module: str) -> None:
    dense = OpConstraint("Dense", relations=(ScaleProduct(2, (0, 1)),))
    # the right derived bias passes both checks
    with quantplug.registered_backend("t_v2", V2Backend(rules_module, {"Dense": dense})):
        converted = quantplug.convert(_calibrated(quantplug.get_quantizer("t_v2")))
        assert converted.meta[CALIBRATED_REPORT_KEY].ok
    # a bias measured by its own observer cannot be input x weight: known at prepare
    measured = QuantizationSpec(dtype=torch.int32, qscheme=torch.per_tensor_symmetric)
    with quantplug.registered_backend("t_v2", V2Backend(rules_module, {"Dense": dense}, bias=measured)):
        with pytest.raises(ConstraintViolationError, match="scale product") as info:
            quantplug.prepare(_program(), quantplug.get_quantizer("t_v2"))
        assert info.value.report.violations[0].port == "input 2, input 0, input 1"
    # derived from the right observers but computed wrong: only the calibrated values show it
    with quantplug.registered_backend(
        "t_v2", V2Backend(rules_module, {"Dense": dense}, bias=_bias_times(2.0))
    ):
        prepared = _calibrated(quantplug.get_quantizer("t_v2"))
        with pytest.raises(ConstraintViolationError) as info:
            quantplug.convert(prepared)
    violations = info.value.report.violations
    assert {(v.node, v.rule, v.stage) for v in violations} == {("linear", "scale product", "convert")}
    assert "channel" in violations[0].expected


def test_requantization_ratio_and_scale_limits_on_calibrated_values(rules_module: str) -> None:
    dense = OpConstraint(
        "Dense",
        ports={OUTPUT: PortConstraint(scale_range=(10.0, math.inf), zero_point_range=(0, 0))},
        relations=(RequantRatio((0, 1), OUTPUT, maximum=1e-9, description="multiplier below 1e-9"),),
    )
    with quantplug.registered_backend("t_v2", V2Backend(rules_module, {"Dense": dense})):
        prepared = _calibrated(quantplug.get_quantizer("t_v2"))  # nothing is known before calibration
        assert prepared.meta[STATE_KEY].validation.ok
        with pytest.raises(ConstraintViolationError) as info:
            quantplug.convert(prepared)
    rules = sorted(v.rule for v in info.value.report.violations)
    assert rules == ["requantization ratio", "scale range", "zero point range"]  # the whole report
    assert "multiplier below 1e-9" in str(info.value)


def test_fixed_encodings_are_checked_against_limits_at_prepare(rules_module: str) -> None:
    fixed = FixedQParamsQuantizationSpec(dtype=torch.uint8, scale=1 / 256, zero_point=0)
    add = OpConstraint("Add", ports={OUTPUT: PortConstraint(scale_range=(0.01, 1.0))})
    with quantplug.registered_backend("t_v2", V2Backend(rules_module, {"Add": add})):
        q = quantplug.get_quantizer("t_v2").set_op(aten.add.Tensor, QuantizationConfig(U8, fixed, None, None))
        with pytest.raises(ConstraintViolationError, match="scale range"):
            quantplug.prepare(_program(), q)


def test_strict_is_an_option_every_hook_sees(rules_module: str) -> None:
    backend = V2Backend(rules_module, {})
    with quantplug.registered_backend("t_v2", backend):
        for given, expected in ((None, True), (False, False), ("off", False), ("yes", True)):
            q = (
                quantplug.get_quantizer("t_v2")
                if given is None
                else quantplug.get_quantizer("t_v2", strict=given)
            )
            assert (
                q.strict is expected
                and q.context.options["strict"] is expected
                and q.context.strict is expected
            )
            converted = quantplug.convert(_calibrated(q))
            quantplug.lower(converted, q)
        assert backend.seen_strict == [True, False, False, True]
        with pytest.raises(quantplug.OptionError, match="option 'strict' of backend 't_v2' must be bool"):
            quantplug.get_quantizer("t_v2", strict="maybe")


def test_a_lowering_check_raises_in_strict_mode_and_warns_otherwise(
    rules_module: str, caplog: pytest.LogCaptureFixture
) -> None:
    found = ValidationReport(
        violations=[
            Violation(
                "linear", "aten.linear.default", "Dense", "output", "<= 4 MB", "5 MB", "size", stage="lower"
            )
        ]
    )
    with quantplug.registered_backend("t_v2", V2Backend(rules_module, {}, lowering_report=found)):
        q = quantplug.get_quantizer("t_v2")
        converted = quantplug.convert(_calibrated(q))
        with pytest.raises(ConstraintViolationError, match=r"size \(lower\): expected <= 4 MB"):
            quantplug.lower(converted, q)
        q = quantplug.get_quantizer("t_v2", strict=False)
        with caplog.at_level(logging.WARNING, logger="quantplug.validation"):
            quantplug.lower(quantplug.convert(_calibrated(q)), q)
    assert any("size (lower)" in r.getMessage() for r in caplog.records)


def test_report_to_dict_carries_stage_and_detail() -> None:
    v = Violation("n", "op", None, "output", "a", "b", "rule", stage="convert", detail="why")
    assert ValidationReport([v]).to_dict()["violations"][0] | {} == {
        "node": "n",
        "op": "op",
        "backend_op": None,
        "port": "output",
        "expected": "a",
        "actual": "b",
        "rule": "rule",
        "stage": "convert",
        "detail": "why",
    }


@settings(max_examples=25, deadline=None)
@given(st.lists(scales, min_size=1, max_size=4))
def test_calibrated_plan_checks_only_groups_it_knows(values: list[float]) -> None:
    """``check_encodings`` over group ids: a group without an encoding (dynamic) is skipped."""
    from _quantplug.validation.calibrated import check_encodings
    from _quantplug.validation.engine import CalibratedPlan, NodeValueChecks

    relation = SameScale((0, 1))
    plan = CalibratedPlan(
        nodes=[NodeValueChecks("add", "aten.add.Tensor", "Add", {0: 0, 1: 1}, (), ((relation, ""),))]
    )
    same = {0: u8(values[0]), 1: u8(values[0])}
    assert check_encodings(plan, same).ok
    assert check_encodings(plan, {0: u8(values[0]), 1: None}).ok
    different = {0: u8(values[0]), 1: u8(values[0] * 2)}
    assert not check_encodings(plan, different).ok
