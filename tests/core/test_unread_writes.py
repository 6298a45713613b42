"""In-place writes nothing can see (``_quantplug.rewrites.unread_writes``): Hugging Face's Mamba
copies its state into a ``zeros`` cache that the exported program does not return. Quantized,
that dead subgraph vanished from the exported ONNX and ``qnn_htp`` refused to lower Mamba."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.graph.working_copy import working_copy
from _quantplug.rewrites.unread_writes import drop_unread_writes

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class StateCache(nn.Module):
    """A step whose new state is also copied into a cache: returned, or (Mamba) not."""

    def __init__(self, return_cache: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.return_cache = return_cache

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        state = torch.tanh(self.fc(x))
        cache = torch.zeros(x.shape[0], 4)
        cache.copy_(state[:, :4] * 2)  # the slice and the product are read only by the write
        seen = torch.zeros_like(state)
        seen.copy_(state)
        out = self.fc(seen)
        return (out, cache) if self.return_cache else out


def _export(return_cache: bool = False) -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=64)
    model = StateCache(return_cache).eval()
    return torch.export.export(model, (torch.randn(2, 8),), dynamic_shapes=({0: batch},))


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target).split(".")[1] for n in gm.graph.nodes if n.op == "call_function"]


def test_only_the_write_nothing_reads_goes_with_what_only_it_reads() -> None:
    program = _export()
    gm = working_copy(program)
    before = _targets(gm)
    assert before.count("copy_") == 2 and before.count("mul") == 1
    assert drop_unread_writes(gm) == 1
    after = _targets(gm)
    # the cache, its write, the slice and the product went; the write into a tensor read after stays
    assert after.count("copy_") == 1 and "zeros" not in after and "zeros_like" in after
    assert "mul" not in after and "slice" not in after
    x = torch.randn(5, 8)
    assert torch.equal(gm(x), program.module()(x))
    assert drop_unread_writes(gm) == 0


def test_a_returned_cache_keeps_its_write() -> None:
    gm = working_copy(_export(return_cache=True))
    assert drop_unread_writes(gm) == 0 and _targets(gm).count("copy_") == 2


def test_a_written_input_keeps_its_write() -> None:
    """A write into a caller's tensor (here a view of the input) is the program's business."""

    class WritesInput(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            view = x[:, :2]
            view.copy_(torch.zeros(x.shape[0], 2))
            return x * 2

    program = torch.export.export(WritesInput(), (torch.randn(3, 4),))
    gm = working_copy(program)
    count = _targets(gm).count("copy_")
    assert drop_unread_writes(gm) == 0 and _targets(gm).count("copy_") == count


@pytest.mark.parametrize(("backend", "options"), [("qnn_htp", {"soc_model": "SM8650"}), ("reference", {})])
def test_a_model_with_an_unread_cache_lowers(backend: str, options: dict[str, str]) -> None:
    """Strict ``qnn_htp`` lowering refused it: "quantized tensor(s) are not in the exported ONNX
    model" (the cache's quantize nodes, dropped by the exporter as dead code)."""
    pytest.importorskip(f"quantplug_{backend}")
    program = _export()
    quantizer = quantplug.get_quantizer(backend, **options)
    prepared = quantplug.prepare(program, quantizer)
    assert "copy_" in _targets(program.module())  # the caller's program is not touched
    for _ in range(2):
        prepared(torch.randn(4, 8))
    converted = quantplug.convert(prepared)
    artifact = quantplug.lower(converted, quantizer)  # strict: every quantized tensor is in the model
    with tempfile.TemporaryDirectory() as out:
        artifact.save(out)
