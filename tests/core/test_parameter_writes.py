"""Weights a model prepares on its first forward (``_quantplug.rewrites.parameter_writes``).

transformers' RWKV divides weights in place under ``torch.no_grad()`` on its first call and sets
a flag; exported before that call, the program divides them again at every run. quantplug makes
such a write functional in its working copy, so every call computes what the model computes
after its first one (tests/zoo/test_rwkv.py has the real model)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.rewrites.parameter_writes import _functional_twin

pytest.importorskip("onnxruntime")


class RescaledOnFirstCall(nn.Module):
    def __init__(self, write: str = "div") -> None:
        super().__init__()
        self.fc = nn.Linear(64, 16)
        self.out = nn.Linear(16, 8)
        self.write = write
        self.rescaled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rescaled:
            with torch.no_grad():
                if self.write == "div":
                    self.fc.weight.div_(4)
                    self.out.weight.mul_(2)
                else:  # no functional form in ATen
                    self.out.weight.fill_diagonal_(0)
            self.rescaled = True
        return self.out(torch.relu(self.fc(x)))  # type: ignore[no-any-return]


def _program(write: str = "div") -> tuple[torch.export.ExportedProgram, nn.Module]:
    torch.manual_seed(0)
    model = RescaledOnFirstCall(write).eval()
    program = torch.export.export(model, (torch.randn(4, 64),))
    eager = copy.deepcopy(model)  # the program shares the model's tensors: warm a copy up
    eager(torch.randn(4, 64))
    return program, eager


@pytest.mark.parametrize("preset", ["int8", "weight_only_int4"])
def test_a_first_forward_write_is_applied_once_at_every_call(
    preset: str, caplog: pytest.LogCaptureFixture
) -> None:
    program, eager = _program()
    before = program.graph_module.submod_1.code  # type: ignore[union-attr]
    quantizer = quantplug.get_quantizer("reference", preset=preset)
    with caplog.at_level(logging.WARNING, logger="quantplug.flow.parameter_writes"):
        prepared = quantplug.prepare(program, quantizer)
    assert "fc.weight, out.weight in place at every call" in caplog.text
    batches = [torch.randn(4, 64) for _ in range(3)]
    with torch.no_grad():
        for x in batches:  # no drift: each calibration call computes the warmed-up model
            torch.testing.assert_close(prepared(x), eager(x))
    converted = quantplug.convert(prepared)
    # the weights are constants again: stored quantized, nothing written at run time
    assert not any("wrap_with_set_grad_enabled" in str(n.target) for n in converted.graph.nodes)
    artifact = quantplug.lower(converted, quantizer)  # weight-only: refused while computed
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(artifact.run(x), converted(x), atol=1e-4, rtol=1e-4)
        error = (converted(x) - eager(x)).pow(2).mean() / eager(x).pow(2).mean()
    assert float(error) < 0.05, float(error)
    # the debugger's float side computes the same weights (41 and 26 dB; 10 when it drifted)
    report = quantplug.debug.compare(program, converted, [(b,) for b in batches])
    assert report.output_sqnr_db is not None and report.output_sqnr_db > 20, report.output_sqnr_db
    assert program.graph_module.submod_1.code == before  # type: ignore[union-attr]
    assert "div_" in before
    # given the module, never called yet, the debugger exports it and reads the same weights
    torch.manual_seed(0)
    fresh = RescaledOnFirstCall().eval()
    untouched = {k: v.clone() for k, v in fresh.state_dict().items()}
    from_module = quantplug.debug.compare(fresh, converted, [(b,) for b in batches])
    assert from_module.output_sqnr_db == pytest.approx(report.output_sqnr_db, abs=1e-3)
    assert not fresh.rescaled
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, untouched[name]), name


def test_quantization_aware_training_keeps_the_write(caplog: pytest.LogCaptureFixture) -> None:
    """The trained parameter is the written one; a functional value would carry no gradient."""
    program, _ = _program()
    with caplog.at_level(logging.WARNING, logger="quantplug.flow.parameter_writes"):
        prepared = quantplug.prepare(program, quantplug.get_quantizer("qnn_htp", qat=True), qat=True)
    assert "quantization-aware training trains the written parameter" in caplog.text
    weight = prepared.get_parameter("fc.weight").detach().clone()
    prepared(torch.randn(4, 64))
    torch.testing.assert_close(prepared.get_parameter("fc.weight").detach(), weight / 4)


def test_a_write_without_a_functional_form_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    program, _ = _program("fill_diagonal")
    with caplog.at_level(logging.WARNING, logger="quantplug.flow.parameter_writes"):
        prepared = quantplug.prepare(program, quantplug.get_quantizer("reference"))
    assert "out.weight in place at every call, and quantplug leaves the write" in caplog.text
    assert "no functional form" in caplog.text
    prepared(torch.randn(4, 64))
    quantplug.convert(prepared)(torch.randn(4, 64))


def test_programs_without_parameter_writes_say_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Buffers are state by design (batch-norm statistics, counters): nothing to report."""

    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.calls.add_(1)
            return self.fc(x)  # type: ignore[no-any-return]

    program = torch.export.export(Counter().eval(), (torch.randn(2, 8),))
    with caplog.at_level(logging.WARNING, logger="quantplug.flow.parameter_writes"):
        quantplug.prepare(program, quantplug.get_quantizer("reference"))
    assert caplog.text == ""


def test_functional_twins() -> None:
    aten = torch.ops.aten
    assert _functional_twin(aten.div_.Tensor) is aten.div.Tensor
    assert _functional_twin(aten.mul_.Scalar) is aten.mul.Scalar
    assert _functional_twin(aten.copy_.default) is aten.copy.default
    assert _functional_twin(aten.clamp_.default) is aten.clamp.default
    assert _functional_twin(aten.fill_diagonal_.default) is None
    assert _functional_twin(aten.div.Tensor) is None  # not a write
    assert _functional_twin(print) is None
