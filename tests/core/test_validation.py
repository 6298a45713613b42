"""The validation engine: constraints from a backend hook, reports, strict vs warnings."""

from __future__ import annotations

import logging

import pytest
import torch

import quantplug
from _quantplug.validation.constraints import OUTPUT
from quantplug import (
    ArchRequirement,
    ConstraintViolationError,
    FixedQParamsQuantizationSpec,
    OpConstraint,
    PortConstraint,
    QuantizationConfig,
    QuantizationSpec,
    RulesModule,
)

RULES = RulesModule(
    "tests.core._validation_rules", ["aten.linear.default", "aten.sigmoid.default", "aten.view.default"]
)

U8 = QuantizationSpec(dtype=torch.uint8, qscheme=torch.per_tensor_affine)
W_AFFINE = QuantizationSpec(dtype=torch.int8, qscheme=torch.per_tensor_affine)
W_CHANNEL = QuantizationSpec(dtype=torch.int8, qscheme=torch.per_channel_symmetric, ch_axis=0)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).sigmoid().view(2, 8)


class Backend:
    """An in-process backend whose constraints say: symmetric int8 weights, fixed sigmoid, shared view."""

    def __init__(self, weight: QuantizationSpec, arch: int = 73) -> None:
        self.weight = weight
        self.arch = arch

    @quantplug.hookimpl
    def quantplug_backend_info(self) -> quantplug.BackendInfo:
        return quantplug.BackendInfo(name="t_valid", description="validation test backend")

    @quantplug.hookimpl
    def quantplug_annotation_rules(self, context: quantplug.BackendContext) -> list[RulesModule]:
        return [RULES]

    @quantplug.hookimpl
    def quantplug_quantization_config(
        self, preset: str | None, context: quantplug.BackendContext
    ) -> QuantizationConfig:
        return QuantizationConfig(U8, U8, self.weight, None)

    @quantplug.hookimpl
    def quantplug_target_arch(self, context: quantplug.BackendContext) -> int:
        return self.arch

    @quantplug.hookimpl
    def quantplug_op_constraints(
        self, op: str, backend_op: str | None, context: quantplug.BackendContext
    ) -> list[OpConstraint]:
        if backend_op == "FullyConnected":
            return [
                OpConstraint(
                    "FullyConnected",
                    ports={1: PortConstraint(dtypes=frozenset({torch.int8}), symmetric=True)},
                    arch=(
                        ArchRequirement(
                            75,
                            "per-channel weights",
                            when=lambda ports: (
                                ports[1] is not None and ports[1].qscheme == torch.per_channel_symmetric
                            ),
                        ),
                    ),
                )
            ]
        if backend_op == "Sigmoid":
            return [
                OpConstraint(
                    "Sigmoid", ports={OUTPUT: PortConstraint(fixed_scale=1 / 256, fixed_zero_point=0)}
                )
            ]
        if backend_op == "Reshape":
            return [OpConstraint("Reshape", must_share_input_output=True)]
        return []


def _program() -> torch.export.ExportedProgram:
    return torch.export.export(Net().eval(), (torch.randn(2, 8),))


def test_report_lists_every_violation_with_node_port_expected_actual() -> None:
    with quantplug.registered_backend("t_valid", Backend(W_AFFINE)):
        q = quantplug.get_quantizer("t_valid", strict=False)
        gm = q.transform_for_annotation(_program().module())
        q.annotate(gm)
        report = q.validate(gm)
    rules = {(v.node, v.rule) for v in report.violations}
    assert ("linear", "symmetric") in rules
    assert ("sigmoid", "fixed encoding") in rules
    assert ("view", "must share input encoding") in rules
    text = report.format()
    assert "node 'linear'" in text and "input 1" in text and "expected symmetric qscheme" in text
    assert report.checked_nodes == 3 and not report.ok


def test_strict_raises_with_the_report() -> None:
    with quantplug.registered_backend("t_valid", Backend(W_AFFINE)):
        q = quantplug.get_quantizer("t_valid")
        with pytest.raises(ConstraintViolationError) as info:
            quantplug.prepare(_program(), q)
    assert info.value.report.by_node()["linear"][0].op == "aten.linear.default"
    assert "sigmoid" in str(info.value)


def test_non_strict_warns_and_prepares(caplog: pytest.LogCaptureFixture) -> None:
    with quantplug.registered_backend("t_valid", Backend(W_AFFINE)):
        q = quantplug.get_quantizer("t_valid", strict=False)
        with caplog.at_level(logging.WARNING, logger="quantplug.validation"):
            prepared = quantplug.prepare(_program(), q)
    assert any("node 'linear'" in r.getMessage() for r in caplog.records)
    prepared(torch.randn(2, 8))
    quantplug.convert(prepared)


def test_arch_gate_applies_only_when_condition_holds() -> None:
    with quantplug.registered_backend("t_valid", Backend(W_CHANNEL, arch=73)):
        q = quantplug.get_quantizer("t_valid", strict=False)
        gm = q.transform_for_annotation(_program().module())
        q.annotate(gm)
        report = q.validate(gm)
    arch = [v for v in report.violations if v.rule == "architecture"]
    assert len(arch) == 1 and arch[0].node == "linear" and "75" in arch[0].expected
    with quantplug.registered_backend("t_valid", Backend(W_CHANNEL, arch=75)):
        q = quantplug.get_quantizer("t_valid", strict=False)
        gm = q.transform_for_annotation(_program().module())
        q.annotate(gm)
        assert not [v for v in q.validate(gm).violations if v.rule == "architecture"]


def test_fixed_sigmoid_and_shared_view_pass() -> None:
    from tests.core import _validation_rules

    _validation_rules.SIGMOID_SPEC = FixedQParamsQuantizationSpec(
        dtype=torch.uint8, scale=1 / 256, zero_point=0
    )
    try:
        with quantplug.registered_backend("t_valid", Backend(W_CHANNEL, arch=80)):
            q = quantplug.get_quantizer("t_valid")
            prepared = quantplug.prepare(_program(), q)  # strict: would raise on any violation
        assert prepared.meta["quantplug_prepared"].validation.ok
    finally:
        _validation_rules.SIGMOID_SPEC = None
