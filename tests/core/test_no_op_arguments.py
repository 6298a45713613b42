"""Arguments that change nothing a program computes but split or vanish in the exported ONNX
(``_quantplug.rewrites.no_op_arguments``): an empty tensor ``cat`` skips (Gemma 2's cache starts as
``torch.tensor([])``), a ``softmax`` dtype that is its input's own (Hugging Face's eager
attention). Both once stopped ``qnn_htp`` from lowering Gemma 2."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.graph.working_copy import working_copy
from _quantplug.rewrites.no_op_arguments import drop_no_op_arguments


class EagerAttention(nn.Module):
    def __init__(self, real_cast: bool = False) -> None:
        super().__init__()
        self.key = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        self.real_cast = real_cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([torch.tensor([]), self.key(x)], dim=1)  # the empty start is skipped
        scores = torch.softmax(x @ keys.transpose(1, 2), dim=-1, dtype=torch.float32)
        if self.real_cast:  # a dtype that is not the input's: kept
            scores = torch.softmax(scores, dim=-1, dtype=torch.float64).to(torch.float32)
        return self.out(scores @ x)  # type: ignore[no-any-return]


def _export(real_cast: bool = False) -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(EagerAttention(real_cast).eval(), (torch.randn(2, 4, 8),))


@pytest.fixture(scope="module")
def program() -> torch.export.ExportedProgram:
    return _export()


def _targets(gm: torch.fx.GraphModule, name: str) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == name]


def test_only_the_no_op_arguments_go() -> None:
    program = _export(real_cast=True)
    gm = working_copy(program)
    (cat,) = _targets(gm, "aten.cat.default")
    assert len(cat.args[0]) == 2
    assert drop_no_op_arguments(gm) == 2  # the cat, the float32 softmax
    assert len(cat.args[0]) == 1 and cat.args[0][0].meta["val"].shape == (2, 4, 8)
    own, wide = _targets(gm, "aten.softmax.int")
    assert own.args[2:] in ((), (None,)) and wide.args[2] == torch.float64
    gm.recompile()
    x = torch.randn(2, 4, 8)
    assert torch.equal(gm(x), program.module()(x))
    assert drop_no_op_arguments(gm) == 0  # nothing left to take out


@pytest.mark.parametrize(("backend", "options"), [("qnn_htp", {"soc_model": "SM8650"}), ("reference", {})])
def test_a_model_with_them_lowers(
    program: torch.export.ExportedProgram, backend: str, options: dict[str, str]
) -> None:
    pytest.importorskip(f"quantplug_{backend}")
    quantizer = quantplug.get_quantizer(backend, **options)
    prepared = quantplug.prepare(program, quantizer)
    for _ in range(2):
        prepared(torch.randn(2, 4, 8))
    artifact = quantplug.lower(quantplug.convert(prepared), quantizer)  # strict: every tensor encoded
    with tempfile.TemporaryDirectory() as out:
        artifact.save(out)
