"""Tensors the program writes in place stay float (Swin's shifted-window mask): a quantize on
them would copy the tensor, and the in-place write would no longer reach its readers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.graph.mutation import mutated_aliases

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class WindowMask(nn.Module):
    """A linear layer plus a mask built as torchvision's Swin builds it: zeros, then slices of it
    filled in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x.new_zeros((6, 6))
        mask[:3, :3] = 4.0
        mask[3:, 3:] = -4.0
        return self.fc(x) + mask.unsqueeze(0)


def test_the_written_tensor_its_views_and_the_writes_are_found() -> None:
    program = torch.export.export(WindowMask().eval(), (torch.randn(4, 6, 6),))
    found = {str(n.target).split(".")[1] for n in mutated_aliases(program.graph)}
    assert found == {"new_zeros", "slice", "fill_", "unsqueeze"}  # unsqueeze: a view of the mask


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("reference", {"preset": "int8"}),
        ("qnn_htp", {"precision": "8a8w"}),
        ("qnn_htp", {"precision": "16a8w"}),
    ],
)
def test_a_mask_written_in_place_reaches_its_readers(backend: str, options: dict[str, str]) -> None:
    torch.manual_seed(0)
    model = WindowMask().eval()
    calibration, held_out = torch.randn(4, 6, 6), torch.randn(4, 6, 6)
    quantizer = quantplug.get_quantizer(backend, **options)
    prepared = quantplug.prepare(torch.export.export(model, (calibration,)), quantizer)
    prepared(calibration)
    converted = quantplug.convert(prepared)
    with torch.no_grad():
        expected, out = model(held_out), converted(held_out)
    # the mask (+-4) dominates the output (a linear layer's ~0.5): without it the error is that big
    assert float((out - expected).abs().max()) < 0.2
    quantplug.lower(converted, quantizer)  # qnn_htp strict: every quantized tensor is in the model


class InPlaceActivation(nn.Module):
    """torchvision's ``ReLU(inplace=True)`` after a conv: the write's readers take its result."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x))  # type: ignore[no-any-return]


def test_an_in_place_activation_is_quantized_as_usual() -> None:
    x = torch.randn(2, 3, 8, 8)
    program = torch.export.export(InPlaceActivation().eval(), (x,))
    assert any(n.target == torch.ops.aten.relu_.default for n in program.graph.nodes)
    assert mutated_aliases(program.graph) == {}
    quantizer = quantplug.get_quantizer("qnn_htp", precision="8a8w")  # strict
    prepared = quantplug.prepare(program, quantizer)
    prepared(x)
    quantplug.lower(quantplug.convert(prepared), quantizer)


class StepsWrittenIntoZeros(nn.Module):
    """RWKV's attention (transformers' CPU path): ``out = zeros_like(h)``, each step's result
    written into ``out[:, t]``, then ``out`` read by a product and a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        out = torch.zeros_like(h)
        for t in range(h.shape[1]):
            out[:, t] = torch.tanh(h[:, t]) * 2.0
        return self.head(out * torch.sigmoid(h))


class StepsStacked(StepsWrittenIntoZeros):
    """The same function with the steps stacked: no tensor written in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        out = torch.stack([torch.tanh(h[:, t]) * 2.0 for t in range(h.shape[1])], dim=1)
        return self.head(out * torch.sigmoid(h))


def _quantized_sqnr(model: nn.Module, backend: str, options: dict[str, str]) -> float:
    """Measured on the calibration batch: each written step has its own encoding, the stack
    one shared by all, and held-out values past one step's 32 calibrated ones would clip."""
    calibration = held_out = torch.randn(4, 5, 8)
    quantizer = quantplug.get_quantizer(backend, **options)
    prepared = quantplug.prepare(torch.export.export(model, (calibration,)), quantizer)
    prepared(calibration)
    converted = quantplug.convert(prepared)
    quantplug.lower(converted, quantizer)
    with torch.no_grad():
        expected, out = model(held_out), converted(held_out)
    return float(10 * torch.log10(expected.pow(2).mean() / (out - expected).pow(2).mean()))


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("reference", {"preset": "int8", "activation_observer": "minmax"}),
        ("qnn_htp", {"precision": "8a8w"}),
        ("qnn_htp", {"precision": "16a8w"}),
    ],
)
def test_a_reader_of_a_tensor_written_later_observes_it_where_it_reads(
    backend: str, options: dict[str, str]
) -> None:
    """The product's input edge on ``out`` was observed (and, converted, quantized) right after
    ``zeros_like``: the observer saw zeros, the quantize copied them, and the product read zeros
    whatever the steps wrote (RWKV at int8: -2.2 dB). Now the program is as accurate as the same
    function written without in-place writes."""
    torch.manual_seed(0)
    written = StepsWrittenIntoZeros().eval()
    stacked = StepsStacked().eval()
    stacked.load_state_dict(written.state_dict())
    torch.manual_seed(1)
    got = _quantized_sqnr(written, backend, options)
    torch.manual_seed(1)
    assert got > 15 and abs(got - _quantized_sqnr(stacked, backend, options)) < 0.5, got


def test_the_debugger_compares_a_tensor_written_later_as_made() -> None:
    """Its only dequantize is a reader's, after the writes: paired with the float tensor as made
    (zeros), it reported -inf dB."""
    from _quantplug.debug.compare import compare

    torch.manual_seed(0)
    model, x = StepsWrittenIntoZeros().eval(), torch.randn(4, 5, 8)
    program = torch.export.export(model, (x,))
    prepared = quantplug.prepare(program, quantplug.get_quantizer("reference", preset="int8"))
    prepared(x)
    report = compare(program, quantplug.convert(prepared), [x])
    (entry,) = [e for e in report.nodes if e.node == "zeros_like"]
    assert entry.sqnr_db == float("inf") and "written in place later" in entry.note
    assert report.output_sqnr_db is not None and report.output_sqnr_db > 15


class WritesReadOrNot(nn.Module):
    """Three writes: one read afterwards through a view taken before it, one through the base of
    the view it writes, one whose readers take the op's result only (Falcon's ``y += x``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2.0
        row = h[0]
        h.add_(1.0)  # read below through row
        base = x * 3.0
        base.view(-1).mul_(0.5)  # the base is read below
        y = x * 4.0
        y += x  # readers take the result
        return row + base + y


def test_lowering_writes_out_of_place_only_what_no_one_reads_afterwards() -> None:
    """Exact by construction: a write is rewritten only when every later reader takes the op's
    result; the others stay writes (``_quantplug.peers.onnx_in_place_writes``)."""
    from _quantplug.graph.working_copy import working_copy
    from _quantplug.peers.onnx_in_place_writes import writes_out_of_place

    x = torch.randn(3, 4)
    model = WritesReadOrNot()
    gm = working_copy(torch.export.export(model, (x,)))
    in_place = (torch.ops.aten.add_.Tensor, torch.ops.aten.mul_.Tensor)
    writes = [n.name for n in gm.graph.nodes if n.target in in_place]
    assert len(writes) == 3
    assert writes_out_of_place(gm.graph) == 1
    gm.recompile()
    assert [n.name for n in gm.graph.nodes if n.target in in_place] == writes[:2]
    torch.testing.assert_close(gm(x), model(x))
