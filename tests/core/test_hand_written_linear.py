"""``x @ W.T (+ b)`` written by hand is a linear (``_quantplug.rewrites.hand_written_linear``).

Falcon's ``FalconLinear`` exports as ``matmul(x, numpy_T(W))``. No rule saw a weight there: the
reference backend left those layers float at weight-only int4 (only the embedding became int4,
without a word) and put their weights on the activation grid at int8; no weight algorithm took
them for layers. prepare() now rewrites them as ``linear(x, W, b)`` on the same parameter.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import quantplug
from _quantplug.debug.compare import compare
from _quantplug.graph.working_copy import working_copy
from _quantplug.rewrites.hand_written_linear import linear_from_matmul

aten = torch.ops.aten
SPELLINGS = ("T", "t", "permute", "transpose", "transpose_negative")
BIASES = ("none", "after", "before")


def _transposed(w: torch.Tensor, spelling: str) -> torch.Tensor:
    if spelling == "T":
        return w.T
    if spelling == "t":
        return w.t()
    if spelling == "permute":
        return w.permute(1, 0)
    if spelling == "transpose":
        return w.transpose(0, 1)
    return w.transpose(-1, -2)


class HandWritten(nn.Module):
    """Falcon's ``FalconLinear``: ``W [out, in]``, ``x @ W.T``, the bias added after the product."""

    def __init__(self, spelling: str = "T", bias: str = "after", d_in: int = 12, d_out: int = 20) -> None:
        super().__init__()
        self.spelling, self.bias_side = spelling, bias
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.bias = nn.Parameter(torch.randn(d_out) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _transposed(self.weight, self.spelling)
        y = torch.mm(x, w) if x.dim() == 2 else x @ w
        if self.bias_side == "after":
            return y + self.bias
        return self.bias + y if self.bias_side == "before" else y


def _rewritten(model: nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, int]:
    gm = working_copy(torch.export.export(model.eval(), (x,)))
    return gm, linear_from_matmul(gm)


def _targets(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_becomes_one_linear_on_the_same_parameter(spelling: str, bias: str, rank: int) -> None:
    torch.manual_seed(0)
    model = HandWritten(spelling, bias)
    x = torch.randn(6, 12) if rank == 2 else torch.randn(2, 6, 12)
    gm, count = _rewritten(model, x)
    assert count == 1
    (linear,) = [n for n in gm.graph.nodes if n.target == aten.linear.default]
    assert linear.args[1].op == "get_attr" and linear.args[1].target == "weight"
    if bias == "none":
        assert len(linear.args) == 2
    else:  # the add folded: one op, as F.linear would be
        assert linear.args[2].target == "bias" and aten.add.Tensor not in _targets(gm)
    assert not {aten.matmul.default, aten.mm.default} & set(_targets(gm))
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-6)


class NotLinears(nn.Module):
    """Products that are not ``x @ W.T + b`` with a constant ``W``, or whose add is no bias."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.stack = nn.Parameter(torch.randn(2, 8, 8) / 3)
        self.b = nn.Parameter(torch.randn(8) / 4)
        self.rows = nn.Parameter(torch.randn(5, 8) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x @ x.transpose(-1, -2)  # two activations
        b = x @ self.stack.transpose(-1, -2)  # a 3-D constant: a batched product
        c = x @ self.w.T
        c = c + self.rows  # one bias per position, not per feature: stays an add
        d = x @ self.w.T
        e = d + self.b
        f = torch.add(x @ self.w.t(), self.b, alpha=2.0)  # a scaled bias
        return a.sum() + b.sum(0) + c + d + e + f  # d has two readers: its add stays


def test_what_is_not_a_linear_stays_as_written() -> None:
    torch.manual_seed(0)
    model = NotLinears()
    x = torch.randn(5, 8)
    gm, count = _rewritten(model, x)
    assert count == 3  # c, d and f, none with its add folded; neither a nor b
    linears = [n for n in gm.graph.nodes if n.target == aten.linear.default]
    assert len(linears) == 3 and all(len(n.args) == 2 for n in linears)
    assert _targets(gm).count(aten.matmul.default) == 2  # a and b
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


class Block(nn.Module):
    """Two hand-written linears whose outputs Falcon sums in place (``mlp_output += attention``),
    and a third after them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = HandWritten("T", "none"), HandWritten("T", "after")
        self.out = HandWritten("t", "none", d_in=20, d_out=12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y += torch.relu(self.b(x))
        return self.out(y)


class LinearBlock(nn.Module):
    """:class:`Block` with ``nn.Linear`` layers."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 20, bias=False), nn.Linear(12, 20)
        self.out = nn.Linear(20, 12, bias=False)
        for mine, theirs in ((self.a, block.a), (self.b, block.b), (self.out, block.out)):
            mine.weight.data.copy_(theirs.weight.data)
            if mine.bias is not None:
                mine.bias.data.copy_(theirs.bias.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y += torch.relu(self.b(x))
        return self.out(y)  # type: ignore[no-any-return]


def _quantize(model: nn.Module, quantizer: Any, batches: list[Any]) -> tuple[Any, Any]:
    program = torch.export.export(model.eval(), batches[0])
    prepared = quantplug.prepare(program, quantizer)
    with torch.no_grad():
        for batch in batches[:2]:
            prepared(*batch)
    return program, quantplug.convert(prepared)


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("reference", {"preset": "weight_only_int4"}),
        ("reference", {"preset": "int8"}),
        ("qnn_htp", {"precision": "16a4w"}),
        ("qnn_htp", {"precision": "16a4w_block"}),
    ],
)
def test_hand_written_layers_quantize_and_lower_as_nn_linear_does(
    backend: str, options: dict[str, Any]
) -> None:
    """Before: float at weight_only_int4, the weight on the activation grid elsewhere."""
    torch.manual_seed(0)
    model = Block().eval()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2, 6, 12, generator=g),) for _ in range(3)]
    quantizer = quantplug.get_quantizer(backend, **options)
    program, converted = _quantize(model, quantizer, batches)
    _, as_linears = _quantize(LinearBlock(model), quantizer, batches)
    with torch.no_grad():
        torch.testing.assert_close(converted(*batches[2]), as_linears(*batches[2]), rtol=0, atol=0)
    assert not [n for n in quantizer.coverage(program).float_nodes if n.op == "aten.linear.default"]
    # the in-place sum reads a linear that qnn_htp reshapes to 2-D: a strict lowering refuses a
    # model where that sum's output has no encoding
    artifact = quantplug.lower(converted, quantizer)
    if backend == "reference":  # what ships computes what the program computes
        report = compare(program, converted, [batches[2]], artifact=artifact)
        assert report.artifact is not None and report.artifact.ran
        assert report.artifact.vs_program_sqnr_db is not None and report.artifact.vs_program_sqnr_db > 40
