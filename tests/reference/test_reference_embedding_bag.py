"""``nn.EmbeddingBag`` on fixed-size bags: rewritten before annotation into an embedding and a
reduction (``_quantplug.rewrites.embedding_bag``). Exported whole, it became an ONNX ``Loop`` whose
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
from _quantplug.rewrites.embedding_bag import fixed_bag_ids

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


_OFFSETS = textwrap.dedent(
    """
    import torch, quantplug
    from torch import nn
    from _quantplug.errors import LoweringError

    class Offsets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(50, 16, mode="mean")
            self.fc = nn.Linear(16, 4)

        def forward(self, ids, offsets):
            return self.fc(self.bag(ids, offsets))

    torch.manual_seed(0)
    ids, offsets = torch.randint(0, 50, (20,)), torch.tensor([0, 3, 7, 12])
    program = torch.export.export(Offsets().eval(), (ids, offsets))
    quantizer = quantplug.get_quantizer("reference", preset="int8")
    prepared = quantplug.prepare(program, quantizer)
    prepared(ids, offsets)
    try:
        quantplug.lower(quantplug.convert(prepared), quantizer)
    except LoweringError as exc:
        print("refused:", exc)
    else:
        print("lowered")
    """
)


def test_a_model_onnx_runtime_would_crash_on_is_refused_not_fatal() -> None:
    """Bags of varying size (offsets) stay an ONNX Loop that ONNX Runtime 1.32 crashes on when
    quantized: lowering probes the session in a child and raises a typed error naming the Loop,
    instead of the user's process dying (run in a child here too: the failure is a segfault)."""
    done = subprocess.run([sys.executable, "-c", _OFFSETS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    out = done.stdout
    # either ONNX Runtime no longer crashes (a newer release) or the crash is a named refusal
    assert "lowered" in out or ("refused:" in out and "Loop" in out and "SIGSEGV" in out), out
