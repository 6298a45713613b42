"""Float arithmetic cast to integers stays float (OPT's position ids): a dequantized whole number
that comes back just below itself is truncated to the integer below by the cast."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.graph.index_arithmetic import index_arithmetic
from tests.zoo.harness import quiet, sqnr

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CONFIGS = [
    ("reference", {"preset": "int8"}),
    ("qnn_htp", {"precision": "8a8w"}),
    ("qnn_htp", {"precision": "16a16w"}),
]


class FloatPositions(nn.Module):
    """Token and position embeddings, the positions computed as OPT computes them: the running
    sum of a float mask of ones, minus one, cast to integers (``to``, which also makes the mask:
    a cast to float is not index arithmetic). ``gate=True`` passes the mask
    through a quantized op first and multiplies the tokens by it too, so a quantized tensor feeds
    both the model and the index arithmetic."""

    def __init__(self, gate: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.tokens = nn.Embedding(100, 32)
        self.positions = nn.Embedding(40, 32)
        self.fc = nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids >= 0).to(torch.float32)  # ones, from the input: nothing folds it to a constant
        if self.gate:
            mask = torch.relu(mask)
        positions = (torch.cumsum(mask, dim=1) * mask - 1).long()
        hidden = self.tokens(ids) * mask.unsqueeze(-1) if self.gate else self.tokens(ids)
        return self.fc(hidden + self.positions(positions + 2))  # type: ignore[no-any-return]


class ScaledToBytes(nn.Module):
    """An image model returning bytes: its network quantizes, only the scaling before the cast
    is index arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.sigmoid(self.conv(x)) * 255).to(torch.uint8)


def _ids(seed: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(seed)),)


def _held_out_sqnr_above(model: nn.Module, quantizer: Any, floor: float) -> Any:
    """Calibrated on two batches of token ids, converted, and checked against float on a third."""
    prepared = quantplug.prepare(torch.export.export(model, _ids(0)), quantizer)
    for seed in (1, 2):
        prepared(*_ids(seed))
    converted = quantplug.convert(prepared)
    with torch.no_grad():
        assert sqnr([model(*_ids(3))], [converted(*_ids(3))]) > floor
    return converted


def _ops(nodes: Any) -> set[str]:
    return {str(n.target).split(".")[1] for n in nodes}


def test_the_index_computation_and_its_cast_are_found() -> None:
    program = torch.export.export(FloatPositions().eval(), _ids(0))
    assert _ops(index_arithmetic(program.graph)) == {"cumsum", "mul", "sub", "to"}
    program = torch.export.export(ScaledToBytes().eval(), (torch.randn(1, 3, 8, 8),))
    assert _ops(index_arithmetic(program.graph)) == {"mul", "to"}  # not the sigmoid, not the conv


@pytest.mark.parametrize("gate", [False, True], ids=["mask", "quantized_mask"])
@pytest.mark.parametrize(
    ("backend", "options"), CONFIGS, ids=[f"{b}-{next(iter(o.values()))}" for b, o in CONFIGS]
)
def test_positions_computed_in_float_pick_their_own_rows(
    backend: str, options: dict[str, str], gate: bool
) -> None:
    """Quantizing the mask's running sum made tokens 1, 3, 7, 9 read the row before theirs:
    3.5 dB at reference int8, 6 dB at qnn_htp 16a16w, whatever the grid."""
    torch.manual_seed(0)
    model = FloatPositions(gate).eval()
    converted = _held_out_sqnr_above(model, quantplug.get_quantizer(backend, **options), 25.0)
    (cumsum,) = [n for n in converted.graph.nodes if n.target == torch.ops.aten.cumsum.default]
    assert all(  # the running sum reads the mask unquantized, whoever else quantizes it
        not str(arg.target).startswith("quantized_decomposed")
        for arg in cumsum.args
        if isinstance(arg, torch.fx.Node)
    )


def test_the_coverage_report_says_why_the_index_arithmetic_stays_float() -> None:
    program = torch.export.export(FloatPositions().eval(), _ids(0))
    coverage = quantplug.get_quantizer("reference", preset="int8").coverage(program)
    reasons = {node.node: node.reason for node in coverage.float_nodes}
    assert "index arithmetic" in reasons["cumsum"]
    assert "casts a float tensor to torch.int64" in reasons["to_1"]  # "to" makes the float mask


def test_a_scaled_image_keeps_its_network_quantized() -> None:
    torch.manual_seed(0)
    model, x = ScaledToBytes().eval(), torch.randn(2, 3, 8, 8)
    quantizer = quantplug.get_quantizer("reference", preset="int8")
    prepared = quantplug.prepare(torch.export.export(model, (x,)), quantizer)
    prepared(x)
    converted = quantplug.convert(prepared)
    quantized = {n.args[0].name for n in converted.graph.nodes if "quantize_per" in str(n.target)}
    assert "conv2d" in quantized  # the network still quantizes (the sigmoid's output, read only
    # by the scaling, is left float as any output whose readers all stay float)
    with torch.no_grad():
        diff = (converted(x).to(torch.int32) - model(x).to(torch.int32)).abs()
    assert int(diff.max()) <= 3  # a step of the sigmoid's grid (1/255) is one byte


def test_opt_computes_its_positions_right() -> None:
    """OPT (transformers, random weights) scored 5 dB at qnn_htp 16a16w, its peers 35."""
    transformers = pytest.importorskip("transformers")
    config = transformers.OPTConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=2,
        max_position_embeddings=32,
        word_embed_proj_dim=32,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.OPTModel(config).eval()

    class Hidden(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids)[0]  # type: ignore[no-any-return]

    with quiet():
        _held_out_sqnr_above(Hidden().eval(), quantplug.get_quantizer("qnn_htp", precision="16a16w"), 25.0)


def test_positions_stay_right_with_a_dynamic_batch() -> None:
    """Exported with a free batch dimension, calibrated on 4 sequences, run on 7."""
    torch.manual_seed(0)
    model = FloatPositions(gate=True).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, _ids(0), dynamic_shapes=({0: batch},))
    prepared = quantplug.prepare(program, quantplug.get_quantizer("qnn_htp", precision="16a16w"))
    for seed in (1, 2):
        prepared(*_ids(seed))
    converted = quantplug.convert(prepared)
    ids = torch.randint(0, 100, (7, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert sqnr([model(ids)], [converted(ids)]) > 25.0
