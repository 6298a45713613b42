"""Issue 13.6: ``Artifact.save``'s temporary names keep the file's suffix; requantized edges in
``encodings()`` are named producer->consumer."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

import quantplug
from _quantplug.flow.inspect import encodings
from quantplug import Artifact, QuantizationConfig, QuantizationSpec


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def test_a_file_writing_callable_sees_the_final_suffix(tmp_path: Path) -> None:
    program = torch.export.export(Two().eval(), (torch.randn(2, 8),))
    seen: list[Path] = []

    def write_pt2(path: Path) -> None:
        seen.append(path)
        torch.export.save(program, path)  # warns about any suffix but .pt2

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = Artifact("t", files={"sub/model.pt2": write_pt2, "notes": "x"}).save(tmp_path)
    # the writer gets the file's own name, in a private temporary folder beside the final file
    assert seen[0].name == "model.pt2" and seen[0].parent.parent == tmp_path / "sub"
    assert seen[0].parent.name.startswith(".model.pt2.") and not seen[0].parent.exists()
    assert sorted(p.name for p in written) == ["artifact.json", "model.pt2", "notes"]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        "artifact.json",
        "model.pt2",
        "notes",
    ]
    torch.export.load(tmp_path / "sub" / "model.pt2")


def test_a_requantized_edge_is_named_producer_to_consumer() -> None:
    program = torch.export.export(Two().eval(), (torch.randn(2, 8),))
    int8 = QuantizationSpec(dtype=torch.int8, qscheme=torch.per_tensor_affine)
    q = quantplug.get_quantizer("reference", activation_observer="minmax")
    base = q.global_config
    assert base is not None
    # fc2 reads its input on an int8 grid; fc1 writes uint8: the edge is requantized
    q.set_node_name("linear_1", QuantizationConfig(int8, base.output_activation, base.weight, base.bias))
    prepared = quantplug.prepare(program, q)
    with torch.no_grad():
        prepared(torch.randn(2, 8))
    table = encodings(quantplug.convert(prepared))
    requantized = [e for e in table if "producer" in e]
    assert len(requantized) == 1
    (edge,) = requantized
    assert (edge["tensor"], edge["producer"], edge["consumers"], edge["dtype"]) == (
        "linear->linear_1",
        "linear",
        ["linear_1"],
        "int8",
    )
    assert edge["node"].startswith("quantize_per_tensor")  # the field writers map to ONNX is kept
    plain = next(e for e in table if e["tensor"] == "linear")
    assert "producer" not in plain and plain["dtype"] == "uint8"
