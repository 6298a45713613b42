"""A buffer the program writes in forward is state: its reads stay float (issue 42, item 10(c)).

``self.calls.add_(1)`` read into the output: calibration sees the counter at 1..N only, so a
quantize on its readers (or on the ``add_`` result they read) clamps every later value to N, and
the converted program stops counting. quantplug's backends keep those nodes float with a reason;
a foreign quantizer's annotations there (torchao's XNNPACKQuantizer quantizes the reader as any
add) get no observer. torchao's own flow freezes the counter's read into a constant at convert
(pinned below; docs/migrating-from-torchao.md, "In-place writes into buffers").
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import quantplug

CALIBRATION = 4
LATER = 20  # calls of the converted program, far past the counter values calibration saw


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.fc(x) + self.calls  # type: ignore[no-any-return]


def _xnnpack() -> Any:
    pytest.importorskip("torchao.quantization.pt2e")
    from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

    return XNNPACKQuantizer().set_global(get_symmetric_quantization_config())


QUANTIZERS = {
    "reference": lambda: quantplug.get_quantizer("reference"),
    "qnn_htp": lambda: quantplug.get_quantizer("qnn_htp", soc_model="SM8650"),
    "xnnpack": _xnnpack,
}


@pytest.fixture(scope="module")
def setup() -> tuple[torch.export.ExportedProgram, list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=g) for _ in range(CALIBRATION)]
    program = torch.export.export(Counts().eval(), (batches[0],))
    return program, batches, batches[-1]  # within the calibrated range: only the counter moves


def _float_after_calibration(program: torch.export.ExportedProgram, batches: list[torch.Tensor]) -> Any:
    reference = torch.export.export(Counts().eval(), (batches[0],)).module()
    reference.load_state_dict(program.module().state_dict())
    for b in batches:
        reference(b)
    return reference


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_a_counter_buffer_keeps_counting_after_convert(name: str, setup: Any) -> None:
    program, batches, x = setup
    prepared = quantplug.prepare(program, QUANTIZERS[name]())
    for b in batches:
        prepared(b)
    converted = quantplug.convert(prepared)
    reference = _float_after_calibration(program, batches)
    assert float(converted.calls) == float(reference.calls) == CALIBRATION
    with torch.no_grad():
        for _ in range(LATER):
            torch.testing.assert_close(converted(x), reference(x), atol=0.05, rtol=0)
    assert float(converted.calls) == float(reference.calls) == CALIBRATION + LATER
    assert float(program.module().calls) == 0  # the caller's buffer counted nothing


def test_the_counters_readers_are_float_with_a_reason(setup: Any) -> None:
    program, _, _ = setup
    report = quantplug.get_quantizer("reference").coverage(program)
    reader = [n for n in report.float_nodes if n.op == "aten.add.Tensor"]
    assert len(reader) == 1 and "reads buffer 'calls', which the program writes in place" in reader[0].reason
    assert report.node("linear").quantized  # the rest of the program is quantized as before


def test_torchao_freezes_the_counters_read(setup: Any) -> None:
    """torchao 0.18 (prepare_pt2e, convert_pt2e, XNNPACKQuantizer) folds ``calls.add_(1)`` and its
    quantize into a constant at convert: the buffer keeps counting, the output does not."""
    pytest.importorskip("torchao.quantization.pt2e")
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    program, batches, x = setup
    prepared = prepare_pt2e(program.module(), _xnnpack())
    for b in batches:
        prepared(b)
    converted = convert_pt2e(prepared)
    with torch.no_grad():
        first, later = converted(x), [converted(x) for _ in range(LATER)][-1]
    torch.testing.assert_close(first, later)  # the counter's read stopped counting
