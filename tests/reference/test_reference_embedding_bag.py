"""``nn.EmbeddingBag`` on fixed-size bags: rewritten before annotation into an embedding and a
reduction (``quantplug.flow.embedding_bag``). Exported whole, it became an ONNX ``Loop`` whose
quantized form crashed ONNX Runtime's constant folding with a segmentation fault while the
reference backend lowered it (the user's process died); its table stayed float."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import quantplug
from quantplug.flow.embedding_bag import fixed_bag_ids

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
pytest.importorskip("onnxruntime")


class Bags(nn.Module):
    """Token embeddings plus the mean (or sum, max) of the sequence's bag, then a linear head."""

    def __init__(self, mode: str = "mean") -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.bag = nn.EmbeddingBag(50, 8, mode=mode)
        self.fc = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.emb(ids) + self.bag(ids).unsqueeze(1)))  # type: ignore[no-any-return]


def _program(mode: str = "mean") -> tuple[nn.Module, torch.export.ExportedProgram]:
    torch.manual_seed(0)
    model = Bags(mode).eval()
    ids = torch.randint(0, 50, (3, 6))
    return model, torch.export.export(model, (ids,), dynamic_shapes=({0: torch.export.Dim("batch", max=64)},))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_fixed_bags_become_an_embedding_and_a_reduction(mode: str) -> None:
    model, program = _program(mode)
    bags = [n for n in program.graph.nodes if "embedding_bag" in str(n.target)]
    assert len(bags) == 1 and fixed_bag_ids(bags[0]) is not None
    quantizer = quantplug.get_quantizer("reference", preset="int8")
    prepared = quantplug.prepare(program, quantizer)
    ids = torch.randint(0, 50, (5, 6))
    assert not any("embedding_bag" in str(n.target) for n in prepared.graph.nodes)
    torch.testing.assert_close(prepared(ids), model(ids))  # observers only: the same function


_LOWER = textwrap.dedent(
    """
    import torch, quantplug
    from tests.reference.test_reference_embedding_bag import _program
    model, program = _program()
    quantizer = quantplug.get_quantizer("reference", preset="int8")
    prepared = quantplug.prepare(program, quantizer)
    ids = torch.randint(0, 50, (7, 6))
    prepared(ids)
    converted = quantplug.convert(prepared)
    artifact = quantplug.lower(converted, quantizer)
    ours, theirs = artifact.run(ids), converted(ids)
    assert float((ours - theirs).abs().max()) <= 1e-5 + float(theirs.abs().max()) / 127, "artifact != program"
    print("lowered")
    """
)


def test_lowering_an_embedding_bag_model_runs_in_onnx_runtime() -> None:
    """In a child process: the failure this guards against is a segmentation fault."""
    done = subprocess.run([sys.executable, "-c", _LOWER], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "lowered" in done.stdout, (done.returncode, done.stderr[-2000:])
