"""Tensors the program writes in place stay float (Swin's shifted-window mask): a quantize on
them would copy the tensor, and the in-place write would no longer reach its readers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantplug
from quantplug.quantizer.mutation import mutated_aliases

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
