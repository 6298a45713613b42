"""qnn_htp's model.onnx is pure Q/DQ and runs as Q/DQ arithmetic (issue 45.2).

A transformer block with two LayerNorms at 16a8w holds activations on the symmetric 16-bit grid
``int16 [-32767, 32767]`` (the LayerNorm weights, the second MatMul input). That range is
narrower than int16; 0.1.0 wrote it as an int16 ``Clip`` after the ``QuantizeLinear``, which
ONNX Runtime cannot run (``NOT_IMPLEMENTED: Where(16)``) and Qualcomm's converter does not expect.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import quantplug
from quantplug.backend import export_qdq_onnx
from tests.zoo import pure_qdq

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, attention, residual, LayerNorm, MLP, residual."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def _batches(count: int, seed: int) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 8, 32, generator=gen),) for _ in range(count)]


@pytest.fixture(scope="module")
def quantized() -> tuple[nn.Module, torch.fx.GraphModule, object]:
    torch.manual_seed(0)
    model = Block().eval()
    quantizer = quantplug.get_quantizer("qnn_htp", soc_model="SM8650", precision="16a8w")
    prepared = quantplug.prepare(torch.export.export(model, _batches(1, 0)[0]), quantizer)
    with torch.no_grad():
        for batch in _batches(3, 1):
            prepared(*batch)
    return model, quantplug.convert(prepared), quantizer


def _narrowed(program: torch.fx.GraphModule) -> list[str]:
    q = torch.ops.quantized_decomposed.quantize_per_tensor.default
    return [
        n.name
        for n in program.graph.nodes
        if n.target is q and tuple(n.args[3:6]) == (-32767, 32767, torch.int16)
    ]


def test_lowered_model_is_pure_qdq_and_runs_within_1db(quantized, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, program, quantizer = quantized
    assert _narrowed(program), "the block no longer has a restricted 16-bit range: the test tests nothing"
    quantplug.lower(program, quantizer).save(tmp_path)
    data = (tmp_path / "model.onnx").read_bytes()
    assert pure_qdq.integer_domain_ops(onnx.load_from_string(data)) == []
    # the restricted range is in the encodings file: symmetric 16-bit (AIMET's offset -2^15)
    doc = json.loads((tmp_path / "model.encodings").read_text())
    symmetric = [e for e in doc["activation_encodings"] if e["bw"] == 16 and e["is_sym"]]
    assert len(symmetric) == len(_narrowed(program))
    assert {e["offset"][0] for e in symmetric} == {-32768}
    held_out = _batches(4, 2)
    with torch.no_grad():
        reference = [model(*b) for b in held_out]
        program_out = [program(*b) for b in held_out]
    onnx_out = pure_qdq.run_without_optimizations(data, held_out)
    assert abs(pure_qdq.decibels_below(reference, program_out, onnx_out)) <= 1.0


def test_the_check_finds_integer_clips(quantized) -> None:  # type: ignore[no-untyped-def]
    """The check fails on what 0.1.0 wrote (an integer Clip on each restricted 16-bit range)."""
    _, program, _ = quantized
    clipped = export_qdq_onnx(program, clip_narrowed_ranges=True).model
    found = pure_qdq.integer_domain_ops(clipped)
    assert all(f.startswith("Clip ") for f in found)
    assert len({f.split("'")[1] for f in found if "quantized tensor" in f}) == len(_narrowed(program))
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):
        pure_qdq.run_without_optimizations(clipped.SerializeToString(), _batches(1, 2))
